"""A process-tier sandbox's boundary, as the host ends it: bwrap and the supervisor killed
and reaped in the order that leaves no zombie, its cgroup, mounts and run folder removed, its
uid released; and the same undoing for a start cut short (``cleanup``).

Apart from the backend, which only starts sandboxes: everything here runs once one ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

from stockade.sandbox import _cgroups, _slirp, _template
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._host import UidLease, release_folder, umount
from stockade.sandbox._supervised import Boundary

__all__ = ["ProcessBoundary", "children", "cleanup", "cleanup_init", "end_placeholder"]

REAP_S = 1.0  # how long bwrap may take to reap its killed child and end


def children(pid: int) -> list[int]:
    """``pid``'s children (its one thread's: bwrap has no other); none where the kernel does
    not list them (then bwrap goes first, as before)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except (OSError, ValueError):
        return []


class ProcessBoundary(Boundary):
    """``proc``: bwrap (its child is the supervisor), or the supervisor itself when the
    template started it (``_template.Init``); then ``placeholder`` is bwrap, which ends as
    soon as the sandbox started."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes] | _template.Init,
        cgroup: _cgroups.Cgroup | None,
        rundir: Path,
        mounts: list[Path],
        lease: UidLease | None,
        *,
        placeholder: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.proc = proc
        self.cgroup = cgroup
        self.rundir = rundir
        self.mounts = mounts
        self.lease = lease
        self.placeholder = placeholder
        self.slirp: _slirp.Slirp | None = None  # the whole network's way out, walled

    def alive(self) -> bool:
        return self.proc.poll() is None

    def oom_kills(self) -> int | None:
        return None if self.cgroup is None else self.cgroup.oom_kills()

    def lock_kills(self) -> int:
        return 0 if self.cgroup is None else self.cgroup.lock_kills()

    def death_cause(self) -> str:
        # bwrap ended by a signal nobody here sent: the sandbox was killed from outside.
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1)  # the stream may end a moment before the process
        code = self.proc.poll()
        return "killed" if not self._dead and code is not None and code < 0 else "unknown"

    def _kill(self) -> None:
        # The pid namespace's init (bwrap's child, the supervisor) first: every process of the
        # namespace dies with it, and bwrap reaps it and ends. Killed first, bwrap would leave
        # it to the host's init to reap (a zombie of the sandbox's uid, for good under an init
        # that reaps nothing, as in many containers). Then bwrap, if it has not ended; the
        # cgroup sweep catches anything still exiting.
        # Started from the template, the supervisor is the process followed (by a pidfd): its
        # keeper reaps it, reports its end and ends, and the template reaps the keeper, all
        # before the cgroup goes (which would otherwise find the keeper still in it).
        if self.slirp is not None:  # a process of the sandbox's uid and cgroups: ended, reaped
            self.slirp.close()
        init = self.proc if isinstance(self.proc, _template.Init) else None
        if init is not None:
            init.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                init.wait_reaped(REAP_S)
        for child in children(self.proc.pid) if init is None else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=REAP_S)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        if self.placeholder is not None:
            end_placeholder(self.placeholder)
        if self.cgroup is not None:
            self.cgroup.remove()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if init is not None:  # its keeper reaped too: not even a zombie of the sandbox's uid left
            with contextlib.suppress(subprocess.TimeoutExpired):
                init.wait_reaped(REAP_S)
            init.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        for mount in self.mounts:
            umount(mount)
        shutil.rmtree(self.rundir, ignore_errors=True)
        if self.lease is not None:  # last: no process of the sandbox is left with the uid
            self.lease.release()
        release_folder(self.rundir)  # the folder is gone: nothing left for gc to spare


def cleanup(
    proc: subprocess.Popen[bytes] | _template.Init | None,
    mounts: list[Path],
    rundir: Path,
    lease: UidLease | None,
    *,
    cgroup: _cgroups.Cgroup | None,
    egress: EgressHandle | None = None,
    placeholder: subprocess.Popen[bytes] | None = None,
) -> None:
    if egress is not None:
        egress.close()
    if isinstance(proc, _template.Init):
        cleanup_init(proc)
    elif proc is not None:
        try:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    if placeholder is not None:
        end_placeholder(placeholder)
    if cgroup is not None:
        cgroup.remove()
    for mount in mounts:
        umount(mount)
    shutil.rmtree(rundir, ignore_errors=True)
    if lease is not None:
        lease.release()
    release_folder(rundir)


def cleanup_init(init: _template.Init) -> None:
    """A pid 1 from the template that never became a sandbox: killed, reaped by its keeper,
    the host's ends closed."""
    init.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        init.wait_reaped(5)
    init.close()
    for pipe in (init.stdin, init.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


def end_placeholder(proc: subprocess.Popen[bytes]) -> None:
    """bwrap around the template's placeholder: ended (or killed), reaped, its pipes closed."""
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    try:
        proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
