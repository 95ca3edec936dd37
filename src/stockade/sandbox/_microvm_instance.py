"""One running microVM as the host holds it: the QEMU process and its cgroup (the
``Boundary``: alive, OOM kills, kill), the control port to the guest's root helper (``U``:
it listens; ``S``: reseed and set the clock; ``N``: written places noexec; ``D``: clean
caches dropped), the QMP monitor, and the instance whose memory a
snapshot keeps (QEMU's migration to a file).

Apart from ``microvm.py`` and its parts, which plan, launch, and restore guests (the QEMU
command line in ``_microvm_machine``, boot images in ``_microvm_snapshots``), because this is
what lives as long as one sandbox does.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade.sandbox import _cgroups, _host, _qmp
from stockade.sandbox._channel import send_all
from stockade.sandbox._supervised import Boundary, SupervisedInstance
from stockade.sandbox.ops import Reset
from stockade.sandbox.snapshots import Reservation

# Guest RAM on top of the memory limit: the guest kernel, its page cache of the root image.
GUEST_OVERHEAD_MB = 128
# The guest's receive ring on its port: 1024 page-sized buffers (measured: a 20 MiB upload
# left its last 4 MiB in the guest's memory, 1 MiB of zeros behind it 3 MiB).
PORT_RECEIVE_BYTES = 1024 * 4096
SNAPSHOT_PADDING = 2 * PORT_RECEIVE_BYTES


class SocketStream:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def recv(self) -> bytes:
        return self._sock.recv(1 << 20)

    def send(self, data: bytes, deadline: float | None = None) -> None:
        sock = self._sock
        send_all(sock.fileno(), lambda view: sock.send(view, socket.MSG_DONTWAIT), data, deadline)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)


class VMBoundary(Boundary):
    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        sock: socket.socket,
        rundir: Path,
        cgroup: _cgroups.Cgroup | None,
        *,
        ctl: socket.socket,
        qmp: socket.socket,
        egress_port: socket.socket | None = None,
    ) -> None:
        self.proc = proc
        self.sock = sock
        self.rundir = rundir
        self.cgroup = cgroup
        self.ctl = ctl
        self.qmp = qmp
        # Our end of the guest's egress port while no proxy is behind it (a guest started on
        # an image, not yet a sandbox's); the proxy takes it over when attached.
        self.egress_port = egress_port
        self._monitor: _qmp.Monitor | None = None

    def monitor(self) -> _qmp.Monitor:
        if self._monitor is None:
            self._monitor = _qmp.Monitor(self.qmp)
        return self._monitor

    def wait_up(self, timeout_s: float) -> None:
        """Wait for the guest's root helper to say it listens (``U``)."""
        self._expect(b"U", timeout_s)

    def reseed(self, timeout_s: float = 10.0) -> None:
        """Fresh randomness and the time for the guest's kernel, before anything else runs in
        a guest restored from a snapshot (its generator's state is the snapshot's)."""
        message = b"S" + time.time_ns().to_bytes(8, "big") + secrets.token_bytes(32)
        self._order(message, timeout_s, "be reseeded")

    def noexec(self, timeout_s: float = 10.0) -> None:
        """The sandbox's written places mounted noexec by the guest's root helper, in the
        sandbox's mount namespace (under an allowlist: ``_rules.written_noexec``)."""
        self._order(b"N", timeout_s, "mount the written places noexec")

    def drop_caches(self, timeout_s: float = 10.0) -> None:
        """The guest kernel's clean page cache dropped by its root helper (at a pool's reset):
        else which root-image files the last user read stays cached, for the next to see."""
        self._order(b"D", timeout_s, "drop its page cache")

    def _order(self, message: bytes, timeout_s: float, what: str) -> None:
        """``message`` to the guest's root helper, then its ``K`` (``E``: it could not)."""
        try:
            self.ctl.sendall(message)
        except OSError as err:
            raise exc.SandboxStartError(f"cannot reach the guest's helper: {err}") from None
        self._expect(b"K", timeout_s, what=what)

    def _expect(self, byte: bytes, timeout_s: float, what: str = "start") -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise exc.SandboxStartError(
                    f"the guest's helper did not answer {byte!r} within {timeout_s:g} s"
                )
            self.ctl.settimeout(left)
            try:
                data = self.ctl.recv(64)
            except TimeoutError:
                continue
            except OSError as err:
                raise exc.SandboxStartError(f"the guest's helper is gone: {err}") from None
            if not data:
                raise exc.SandboxStartError("the guest's helper is gone")
            if data.rstrip(b"U").endswith(b"E"):
                raise exc.SandboxStartError(f"the guest could not {what}")
            if byte in data:
                return

    def alive(self) -> bool:
        return not self._dead and self.proc.poll() is None

    def death_cause(self) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1)  # the stream may end a moment before the process
        # QEMU (or its jail) ended by a signal nobody here sent: bwrap, killed, says so by its
        # own status; its init says a QEMU killed by signal N by exiting 128 + N (QEMU's own
        # exits are 0 and 1).
        code = self.proc.poll()
        return "killed" if not self._dead and code is not None and (code < 0 or code > 128) else "unknown"

    def last_words(self) -> str:
        return tail(self.rundir / "console.log") or tail(self.rundir / "qemu.log")

    def qemu_pid(self) -> int | None:
        """QEMU's process id on the host: the one descendant of its jail (``proc``, bwrap)
        that runs QEMU; None once it is gone (or before the jail started it)."""
        return _descendant(self.proc.pid, b"qemu-system")

    def oom_kills(self) -> int | None:
        # The host's view: QEMU killed by its cgroup's limit. Kills inside the guest are
        # counted by the guest's kernel, and reported by the supervisor with each result.
        return None if self.cgroup is None else self.cgroup.oom_kills()

    def lock_kills(self) -> int:
        return 0 if self.cgroup is None else self.cgroup.lock_kills()

    def _kill(self) -> None:
        # The guest is one process on the host: killing QEMU kills every process inside.
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        for sock in (self.sock, self.ctl, self.qmp, self.egress_port):
            if sock is not None:
                sock.close()
        if self.cgroup is not None:
            self.cgroup.remove()
        shutil.rmtree(self.rundir, ignore_errors=True)
        _host.release_folder(self.rundir)


def _descendant(pid: int, comm: bytes) -> int | None:
    """The first process below ``pid`` whose name starts with ``comm``."""
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            try:
                if Path(f"/proc/{child}/comm").read_bytes().startswith(comm):
                    return child
            except OSError:
                continue
            todo.append(child)
    return None


class VMInstance(SupervisedInstance):
    """A microVM sandbox: its memory can be kept in a snapshot (QEMU's migration to a file)."""

    vm: VMBoundary
    machine_key: str
    masks: tuple[str, ...]
    # Where its guest came from: "cold boot", "boot image", "ready image" (its supervisor
    # configured and its interpreter started in the image) or "memory snapshot".
    started_from: str = "cold boot"

    def memory_snapshots(self) -> str | None:
        if self.spec.network.egress:
            # its relay's streams live in the guest's memory, their other ends in this process
            return "a microVM with an egress allowlist keeps files only in a snapshot"
        return None

    def _reset(self, op: Reset) -> None:
        super()._reset(op)
        # After the supervisor's reset (the last user's processes gone, the next interpreter
        # started): only what every user's sandbox holds mapped stays cached.
        try:
            self.vm.drop_caches()
        except exc.SandboxStartError as err:
            self.close()
            raise exc.SandboxCrashed(
                f"sandbox {self.id} could not be reset ({err}); it was closed: create a new one"
            ) from None

    def memory_image_bytes(self) -> int:
        return (self.spec.limits.memory_mb + GUEST_OVERHEAD_MB) << 20  # the guest's whole RAM, at most

    def save_memory(self, room: Reservation, *, stop: bool) -> tuple[dict[str, str], dict[str, Any]]:
        path = room.store.temp_path("memory")
        # The guest's virtio console keeps a ring of page-sized receive buffers it reuses and
        # never frees (init_on_free never zeroes them): the last MiBs the host sent, a last
        # user's uploads and code, stayed in the guest's memory, and so in the next user's
        # snapshot. Zeros first, twice round the ring: a buffer QEMU filled only in part (it
        # had less of the socket's bytes at hand) keeps the tail of what it held. Here, not
        # at every reset: 0.4 s under TCG, on a snapshot's seconds, not on a 40 ms reset.
        self.files.answer({"op": "ping"}, bytes(SNAPSHOT_PADDING))
        try:
            with open(path, "wb") as out:
                monitor = self.vm.monitor()
                try:
                    monitor.save(out)
                finally:
                    if not stop:
                        monitor.command("cont")
            room.charge(path)
            digest = room.store.add_file(path)
        finally:
            path.unlink(missing_ok=True)
        return {"memory": digest}, {"machine": self.machine_key, "masks": list(self.masks)}


def tail(path: Path, limit: int = 2048) -> str:
    """The last ``limit`` bytes of ``path`` as text (the guest writes its console: its end is
    read, never the whole of it)."""
    try:
        with path.open("rb") as file:
            file.seek(0, 2)
            file.seek(max(0, file.tell() - limit))
            return file.read(limit).decode("utf-8", "replace").strip()
    except OSError:
        return ""
