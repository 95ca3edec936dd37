"""QEMU's machine protocol (QMP), for the microVM tier's snapshots: stop, save, restore, go on.

The monitor is one half of a socketpair QEMU was given (no path on the host to find it by);
files travel to QEMU as descriptors over it (``getfd``), so QEMU, whose seccomp filter forbids
it to spawn anything, never runs a helper to write or read a migration stream.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, BinaryIO

from stockade import exceptions as exc

__all__ = ["Monitor"]

# QEMU throttles migration to 128 MiB/s unless told: a file is no network link to spare.
UNTHROTTLED = 1 << 40


class Monitor:
    """One QMP connection, used from one thread at a time (a lock keeps it so)."""

    def __init__(self, sock: socket.socket, *, timeout_s: float = 30.0) -> None:
        self._sock = sock
        self._buf = b""
        self._lock = threading.Lock()
        self._timeout_s = timeout_s
        sock.settimeout(timeout_s)
        self._read()  # the greeting
        self.command("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        while b"\n" not in self._buf:
            try:
                data = self._sock.recv(65536)
            except (TimeoutError, OSError) as err:
                raise exc.SandboxCrashed(
                    f"QEMU's monitor did not answer: {err}", cause="unresponsive"
                ) from None
            if not data:
                raise exc.SandboxCrashed("QEMU's monitor closed: the VM is gone")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def command(self, name: str, *, fds: tuple[int, ...] = (), **arguments: Any) -> Any:
        # QMP's names have dashes where Python's keywords have underscores
        args = {k.replace("_", "-"): v for k, v in arguments.items()}
        message = {"execute": name, **({"arguments": args} if args else {})}
        data = json.dumps(message).encode() + b"\n"
        with self._lock:
            try:
                if fds:
                    socket.send_fds(self._sock, [data], list(fds))
                else:
                    self._sock.sendall(data)
            except OSError as err:
                raise exc.SandboxCrashed(f"QEMU's monitor is gone: {err}") from None
            while True:
                reply = self._read()
                if "event" in reply:
                    continue
                if "error" in reply:
                    error = reply["error"]
                    raise exc.SnapshotError(f"QEMU refused {name}: {error.get('desc', error)}")
                return reply.get("return")

    def status(self) -> str:
        return str(self.command("query-status").get("status", ""))

    def save(self, out: BinaryIO, *, ignore_shared: bool = False, timeout_s: float = 300.0) -> None:
        """Stop the VM and write its state to ``out`` (RAM too, unless ``ignore_shared``: then
        RAM that is a shared file is left in its file). The VM stays stopped."""
        self.command("stop")
        self.command(
            "migrate-set-capabilities",
            capabilities=[{"capability": "x-ignore-shared", "state": ignore_shared}],
        )
        self.command("migrate-set-parameters", max_bandwidth=UNTHROTTLED)
        self.command("getfd", fds=(out.fileno(),), fdname="snapshot")
        self.command("migrate", uri="fd:snapshot")
        self._wait_migration(timeout_s, "save")

    def load(
        self, fd: int, *, ignore_shared: bool = False, run: bool = True, timeout_s: float = 300.0
    ) -> None:
        """Read the state QEMU was started to wait for (``-incoming defer``) from ``fd`` (a file
        QEMU holds), then run the VM (unless ``run`` is false: then it stays stopped, and
        ``cont`` runs it)."""
        self.command(
            "migrate-set-capabilities",
            capabilities=[{"capability": "x-ignore-shared", "state": ignore_shared}],
        )
        self.command("migrate-incoming", uri=f"fd:{fd}")
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.status()
            if state == "paused":  # loaded; a stopped VM's state says so
                break
            if state == "running":  # the VM was running when saved, and runs on at once
                return
            if state not in ("inmigrate", "prelaunch"):
                raise exc.SnapshotError(f"QEMU could not restore the snapshot (state {state!r})")
            if time.monotonic() > deadline:
                raise exc.SnapshotError(f"QEMU did not restore the snapshot within {timeout_s:g} s")
            time.sleep(0.002)
        if run:
            self.command("cont")

    def _wait_migration(self, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.command("query-migrate") or {}
            state = info.get("status")
            if state == "completed":
                return
            if state in ("failed", "cancelled"):
                raise exc.SnapshotError(f"QEMU could not {what} the VM: {info.get('error-desc', state)}")
            if time.monotonic() > deadline:
                raise exc.SnapshotError(f"QEMU did not {what} the VM within {timeout_s:g} s")
            time.sleep(0.005)

    def close(self) -> None:
        self._sock.close()
