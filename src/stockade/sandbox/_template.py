"""The process tier's template: one warm Python per backend, forked into each new sandbox.

A sandbox's cold start used to pay two Python starts after bubblewrap's (the supervisor's,
then ``site`` in the zygote at the first ``run_code``). The template pays them once per
backend: it imports the supervisor's modules and loads ``site``, holds nothing of any user,
and forks once per sandbox into a process that becomes the sandbox's pid 1, the supervisor
(``_template_program.py`` says how, step by step). bubblewrap still builds the sandbox: it joins
the user and pid namespaces the template's fork made (``--userns``, ``--pidns``), makes the
others and the mounts around a placeholder, which pid 1 then enters.

Here, the host's side: the template's process (``Template``), and the sandbox's pid 1 as the
host follows it (``Init``: through a pidfd, and its keeper, which reports its end).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import signal
import socket
import struct
import subprocess
import threading
from pathlib import Path
from typing import IO, Any

from stockade import exceptions as exc

__all__ = ["Init", "Template", "supported"]

PROGRAM = Path(__file__).with_name("_template_program.py")
# Its command line shows in every sandbox as /proc/1/cmdline: no path of the host's in it.
BOOT = "import os; exec(os.read(0, 1 << 20))  # stockade's template"
READY_S = 20.0  # how long the template may take to load (once per backend)


@functools.cache
def supported(bwrap: str) -> bool:
    """Whether ``bwrap`` can join namespaces made before it (``--userns``, ``--pidns``:
    bubblewrap 0.8), and this kernel has pidfds (5.3)."""
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    if b"--pidns" not in out.stdout + out.stderr:
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


class Template:
    """The template's process, started at the first request; ``close`` ends it once the
    sandboxes it made have ended (each lives on until its host closes it or dies)."""

    def __init__(self, python: str, shared: Path) -> None:
        self.python = python
        self.shared = shared  # the supervisor's folder on the host: what the template imports
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.pid = 0

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [self.python, "-S", "-E", "-s", "-B", "-c", BOOT],
                stdin=theirs.fileno(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={}, cwd="/", close_fds=True,
            )  # fmt: skip
        except OSError as err:
            ours.close()
            raise exc.SandboxStartError(f"cannot start the process tier's template: {err}") from err
        finally:
            theirs.close()
        source = PROGRAM.read_text().replace('SHARED = ""', f"SHARED = {str(self.shared)!r}", 1)
        try:
            ours.send(source.encode())
            if not select.select([ours], [], [], READY_S)[0]:
                raise OSError("the template did not load in time")
            said = ours.recv(16)
            if len(said) != 4:
                raise OSError("the template ended while loading")
        except OSError as err:
            ours.close()
            self._end()
            raise exc.SandboxStartError(f"the process tier's template failed: {err}") from err
        self.pid = struct.unpack("i", said)[0]
        self._sock = ours
        return ours

    def fork(self, request: dict[str, Any], fds: list[int]) -> None:
        """Ask for a new sandbox's keeper and pid 1, on ``fds`` (``_template_program.FDS``)."""
        message = json.dumps(request).encode()
        with self._lock:
            for attempt in (1, 2):
                sock = self._sock or self._start()
                try:
                    socket.send_fds(sock, [message], fds)
                    return
                except OSError as err:  # the template died (killed from outside): a new one
                    sock.close()
                    self._sock = None
                    self._end()
                    if attempt == 2:
                        raise exc.SandboxStartError(f"the process tier's template is gone: {err}") from err

    def close(self) -> None:
        """No more sandboxes: the template ends when the last of its keepers has."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._end()

    def _end(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.wait(timeout=1)  # at once, unless sandboxes of ours are still open
        except subprocess.TimeoutExpired:  # reaped when the last of them is closed
            threading.Thread(target=proc.wait, name="stockade-template-reaper", daemon=True).start()


class Init:
    """A sandbox's pid 1 started from the template, as the host follows it: a Popen's
    ``pid``, ``poll``, ``wait``, ``kill``, ``stdin`` and ``stdout``. Its end is told by its
    keeper (its parent) on ``ctl``, which reads EOF once the keeper is reaped too; signals go
    through a pidfd, which never reaches another process."""

    def __init__(
        self, pid: int, pidfd: int, *, keeper: int, ctl: socket.socket, pipes: tuple[IO[bytes], IO[bytes]]
    ) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.keeper = keeper
        self.ctl = ctl
        self.stdin: IO[bytes] | None = pipes[0]
        self.stdout: IO[bytes] | None = pipes[1]
        self.returncode: int | None = None
        self._gone = False  # the keeper is reaped (its socket read EOF)
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired("the sandbox's pid 1", timeout or 0)
        return self.returncode

    def wait_reaped(self, timeout: float) -> None:
        """Until the keeper is reaped too: no process of the sandbox left, not even a zombie."""
        self.wait(timeout)
        while not self._gone and self._read(timeout):
            pass

    def _read(self, timeout: float | None) -> bool:
        with self._lock:
            # closed: a kill run again (after an interrupt) finds nothing left to wait for
            if self._gone or self.ctl.fileno() == -1 or not select.select([self.ctl], [], [], timeout)[0]:
                return False
            try:
                said = self.ctl.recv(64)
            except OSError:
                said = b""
            if said.startswith(b"exit "):
                self.returncode = os.waitstatus_to_exitcode(int(said.split()[1]))
            elif not said:
                self._gone = True
                if self.returncode is None:  # the keeper ended without a word: killed
                    self.returncode = -signal.SIGKILL
            return True

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self.pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """The host's part, once the sandbox is gone (closing ``ctl`` earlier kills it)."""
        self.ctl.close()
        pidfd, self.pidfd = self.pidfd, -1  # first: a close run again closes no fd reused since
        with contextlib.suppress(OSError):
            os.close(pidfd)
