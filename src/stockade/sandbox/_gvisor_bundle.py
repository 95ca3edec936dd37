"""What a runsc sandbox holds on the host, and letting it go.

Apart from the launch (``_gvisor_launch``) because the garbage collector (``gvisor.py``)
releases the same things for a bundle whose creator is gone: the sandbox's boundary (alive,
its OOM count from the memory cgroup held for it, its kill), the memory cgroup, the bundle's
mounts and folder, and the head of runsc's log kept for the error of a start that fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade.sandbox import _guest, _host
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._gvisor_settings import CGROUP_PARENT, RunscSettings
from stockade.sandbox._supervised import Boundary


class RunscBoundary(Boundary):
    def __init__(
        self,
        backend: RunscSettings,
        sid: str,
        proc: subprocess.Popen[bytes],
        bundle: Path,
        mounts: list[Path],
    ) -> None:
        self.backend = backend
        self.sid = sid
        self.proc = proc
        self.bundle = bundle
        self.mounts = mounts

    def alive(self) -> bool:
        return not self._dead and self.proc.poll() is None

    def oom_kills(self) -> int | None:
        for counter in (
            Path("/sys/fs/cgroup/memory", CGROUP_PARENT, self.sid, "memory.oom_control"),
            Path("/sys/fs/cgroup", CGROUP_PARENT, self.sid, "memory.events"),
        ):
            found = _guest.read_oom_kills(counter)
            if found is not None:
                return found
        return None

    def _kill(self) -> None:
        # The channel closed the supervisor's stdin first, so a healthy sandbox is already
        # exiting; a stuck one is killed. Deleting a running sandbox would wait seconds.
        try:
            self.proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            self.backend.signal(self.sid, "KILL")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        self.backend.destroy(self.sid)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        release(self.bundle, self.mounts)


def preload_supervisor(config: dict[str, Any], egress: EgressHandle | None) -> None:
    """The egress connect shortcut in the supervisor's environment too (where there is one):
    the interpreters it forks for ``run_code`` take it."""
    if egress is not None and egress.preload is not None:
        config["process"]["env"].append(f"LD_PRELOAD={egress.preload}")


def _memory_group(sid: str) -> Path:
    return Path("/sys/fs/cgroup/memory", CGROUP_PARENT, sid)


def hold_memory_group(sid: str, limit: int) -> None:
    """Make the sandbox's v1 memory cgroup, with its ``limit``, before runsc does: runsc
    removes only the groups it made (and limits only those), and this one's OOM count must
    outlive the sandbox, which its memory limit may kill whole (gVisor's kernel and its TCP
    buffers are charged to it): the caller is then told it ran out of memory. Removed with
    the bundle (``release``)."""
    if not Path("/sys/fs/cgroup/memory/memory.oom_control").exists():
        return  # cgroup v2: the group's memory.events goes with it
    group = _memory_group(sid)
    try:
        group.mkdir(parents=True, exist_ok=True)
        for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
            if (group / name).exists():  # memsw: only with swap accounting
                (group / name).write_text(str(limit))
    except OSError as err:
        raise exc.SandboxStartError(f"cannot limit the sandbox's memory at {group}: {err}") from err


def release(bundle: Path, mounts: list[Path], egress: EgressHandle | None = None) -> None:
    if egress is not None:
        egress.close()
    for mount in mounts:
        _guest.umount(mount)
    with contextlib.suppress(OSError):  # absent, or (gc) a live sandbox's processes in it
        _memory_group(bundle.name.removeprefix("gv-")).rmdir()
    shutil.rmtree(bundle, ignore_errors=True)
    _host.release_folder(bundle)


# What of runsc's stderr the host keeps (what ``head`` reads when a start fails): the
# supervisor's stderr is runsc's, and gVisor's /proc lets code open /proc/1/fd/2 whatever our
# dumpable flag: written to a file, it took 1 GB of host disk in 0.74 s, counted nowhere
# (found from outside). The rest is read and dropped, so that nothing writing there blocks.
LOG_BYTES = 256 * 1024


def keep_head(proc: subprocess.Popen[bytes], path: Path) -> None:
    """Keep the first ``LOG_BYTES`` of ``proc``'s stderr in ``path``, in a thread that drains
    the rest until every holder of the pipe is gone."""
    assert proc.stderr is not None
    pipe = proc.stderr
    ended = _LOGS_ENDED[path] = threading.Event()

    def drain() -> None:
        kept = 0
        try:
            with pipe, open(path, "wb", buffering=0) as log:
                while data := os.read(pipe.fileno(), 1 << 20):
                    if kept < LOG_BYTES:
                        log.write(data[: LOG_BYTES - kept])
                        kept += min(len(data), LOG_BYTES - kept)
        finally:
            ended.set()
            _LOGS_ENDED.pop(path, None)

    threading.Thread(target=drain, name=f"runsc-log-{path.parent.name}", daemon=True).start()


_LOGS_ENDED: dict[Path, threading.Event] = {}  # the logs still being drained


def head(path: Path, limit: int = 2048) -> str:
    """The start of runsc's log; a runsc that is ending has its last words drained first."""
    ended = _LOGS_ENDED.get(path)
    if ended is not None:
        ended.wait(0.5)
    try:
        return path.read_bytes()[:limit].decode("utf-8", "replace").strip()
    except OSError:
        return ""
