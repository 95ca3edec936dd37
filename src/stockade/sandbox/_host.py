"""Host-side plumbing the tiers share: tmpfs mounts, process identity, the supervisor's pipes."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from pathlib import Path

from stockade import exceptions as exc

_libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2


def mount_tmpfs(target: Path, *, size: int, inodes: int, uid: int, mode: int) -> None:
    """A size- and inode-limited tmpfs owned by ``uid`` (needs root): memory, never the disk."""
    opts = f"size={size},nr_inodes={inodes},mode={mode:o},uid={uid},gid={uid}".encode()
    if _libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
        err = ctypes.get_errno()
        raise exc.SandboxStartError(f"cannot mount a tmpfs at {target}: {os.strerror(err)}")


def umount(target: Path) -> None:
    """Detach a mount; a path that is no mount point is left alone."""
    _libc.umount2(str(target).encode(), MNT_DETACH)


def start_time(pid: int) -> str:
    """The kernel's start time of ``pid``: with the pid, it names a process across pid reuse."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return ""
    return data[data.rindex(b")") + 2 :].split()[19].decode()


class PipeStream:
    """A child's stdin/stdout pipes as the one byte stream the supervisor speaks over."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self._proc = proc
        self._in = proc.stdin.fileno()
        self._out = proc.stdout.fileno()

    def recv(self) -> bytes:
        return os.read(self._out, 1 << 20)

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._in, view) :]

    def close(self) -> None:
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
