"""Host-side plumbing the tiers share: tmpfs mounts, process identity, host uids of their own,
the supervisor's pipes."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from stockade import exceptions as exc
from stockade.sandbox._channel import send_all

_libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MNT_DETACH = 2


def mount_tmpfs(target: Path, *, size: int, inodes: int, uid: int, mode: int, noexec: bool = False) -> None:
    """A size- and inode-limited tmpfs owned by ``uid`` (needs root): memory, never the disk.
    ``noexec``: nothing on it can be executed nor mapped executable (a library loaded)."""
    opts = f"size={size},nr_inodes={inodes},mode={mode:o},uid={uid},gid={uid}".encode()
    flags = MS_NOSUID | MS_NODEV | (MS_NOEXEC if noexec else 0)
    if _libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", flags, opts) != 0:
        err = ctypes.get_errno()
        raise exc.SandboxStartError(f"cannot mount a tmpfs at {target}: {os.strerror(err)}")


def mount_layers(layers: list[Path], target: Path) -> None:
    """An image's layers (top first) as one read-only folder: an overlay with no upper layer
    (needs root, and two layers at least)."""
    opts = ("lowerdir=" + ":".join(str(p) for p in layers)).encode()
    flags = MS_RDONLY | MS_NOSUID | MS_NODEV
    if _libc.mount(b"overlay", str(target).encode(), b"overlay", flags, opts) != 0:
        err = ctypes.get_errno()
        raise exc.SandboxStartError(f"cannot mount an image's layers at {target}: {os.strerror(err)}")


def umount(target: Path) -> None:
    """Detach a mount; a path that is no mount point is left alone."""
    _libc.umount2(str(target).encode(), MNT_DETACH)


# The new mount API (Linux 5.2): a superblock reconfigured by the host through the sandbox's
# /proc/PID/root, with no setns (which a threaded process cannot do for a mount namespace) and
# no process spawned. x86_64 and arm64 share these numbers.
SYS_FSCONFIG, SYS_FSPICK = 431, 433
FSPICK_CLOEXEC, FSPICK_SYMLINK_NOFOLLOW = 1, 2
FSCONFIG_SET_FLAG, FSCONFIG_SET_STRING, FSCONFIG_CMD_RECONFIGURE = 0, 1, 7


# A network namespace of its own keeps no TIME_WAIT: a connection code closed first would
# outlive a pool's reset for 60 s (addresses, ports, taken binds; the reset's check,
# supervisor/netstate.py, would then replace the member).
NO_TIME_WAIT = {"net.ipv4.tcp_max_tw_buckets": "0"}
# A transmit timestamp that carries what was sent sits on the socket's error queue as a clone
# holding the sent data's pages, which no cgroup charges once the data itself is acknowledged:
# a 128 MiB sandbox held ~1 GB of the host's that way (found from outside). Without
# CAP_NET_RAW, code then gets timestamps without data (SOF_TIMESTAMPING_OPT_TSONLY) or none.
# On the host's kernel only: gVisor keeps its own sockets in its own memory.
NO_TIMESTAMPED_DATA = {"net.core.tstamp_allow_data": "0"}
CLONE_NEWNET = 0x40000000


def quiet_network(pid: int) -> None:
    """``NO_TIME_WAIT`` and ``NO_TIMESTAMPED_DATA`` in ``pid``'s network namespace (as the
    process template's start and Docker's ``sysctls`` set them), for a sandbox bwrap started itself
    (its netns is made by bwrap, after the host's last say): a thread of ours enters it (root
    may enter any), writes, and ends there. Never the host's own namespace: nothing is written
    where ``pid`` shares ours. SandboxStartError where it cannot be written."""
    theirs, ours = os.stat(f"/proc/{pid}/ns/net"), os.stat("/proc/self/ns/net")
    if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
        return
    failed: list[str] = []

    def enter_and_write() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            finally:
                os.close(fd)
            # /proc/sys/net shows the namespace of the thread that looks (this one, now)
            for name, value in {**NO_TIME_WAIT, **NO_TIMESTAMPED_DATA}.items():
                with open(f"/proc/sys/{name.replace('.', '/')}", "wb", buffering=0) as fh:
                    fh.write(value.encode())
        except OSError as err:
            failed.append(f"{err.strerror or err}")

    # A thread of its own: it ends in the sandbox's namespace, no other of ours enters it.
    worker = threading.Thread(target=enter_and_write, name="stockade-netns")
    worker.start()
    worker.join()
    if failed:
        raise exc.SandboxStartError(f"cannot set the sandbox's network namespace up: {failed[0]}")


def bound_ptys(pid: int, most: int) -> None:
    """The devpts instance at /dev/pts in ``pid``'s mount namespace holds at most ``most``
    ptys (``max=``; needs CAP_SYS_ADMIN over the instance: root). A reconfigure resets every
    option it is not given, so the instance's own (mode, ptmxmode, gid) are given again. Only
    the host can undo it: code inside has no capability over the instance."""
    where = f"/proc/{pid}/root/dev/pts"
    options = _devpts_options(pid)
    if options is None:
        raise exc.SandboxStartError(f"no devpts at /dev/pts in the sandbox (pid {pid}) to bound its ptys")
    fd = _libc.syscall(SYS_FSPICK, -100, where.encode(), FSPICK_CLOEXEC | FSPICK_SYMLINK_NOFOLLOW)
    if fd < 0:
        raise exc.SandboxStartError(f"cannot bound the sandbox's ptys: {os.strerror(ctypes.get_errno())}")
    try:
        for key, value in [*options, ("max", str(most))]:
            kind = FSCONFIG_SET_FLAG if value is None else FSCONFIG_SET_STRING
            given = None if value is None else value.encode()
            if _libc.syscall(SYS_FSCONFIG, fd, kind, key.encode(), given, 0) < 0:
                raise exc.SandboxStartError(
                    f"cannot bound the sandbox's ptys ({key}): {os.strerror(ctypes.get_errno())}"
                )
        if _libc.syscall(SYS_FSCONFIG, fd, FSCONFIG_CMD_RECONFIGURE, None, None, 0) < 0:
            raise exc.SandboxStartError(f"cannot bound the sandbox's ptys: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def _devpts_options(pid: int) -> list[tuple[str, str | None]] | None:
    """The options of the devpts at /dev/pts as ``pid`` sees it (mountinfo's superblock
    options; a flag's value is None), but ``rw`` and ``max``; None where it is no devpts."""
    try:
        with open(f"/proc/{pid}/mountinfo") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    found: list[tuple[str, str | None]] | None = None
    for line in lines:  # the last mount at /dev/pts is the one on top
        fields = line.split()
        if len(fields) < 10 or fields[4] != "/dev/pts":
            continue
        rest = fields[fields.index("-") + 1 :]
        if rest[0] != "devpts":
            found = None
            continue
        found = []
        for option in rest[2].split(","):
            key, equals, value = option.partition("=")
            if key not in ("rw", "ro", "max"):
                found.append((key, value if equals else None))
    return found


def start_time(pid: int) -> str:
    """The kernel's start time of ``pid``: with the pid, it names a process across pid reuse."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return ""
    return data[data.rindex(b")") + 2 :].split()[19].decode()


# Host uids for sandboxes: systemd's unused range (above its container ranges, below 2^31), so
# no account, no dynamic user and no nspawn container of this host has one of them.
UID_BASE = 0x70000000
UID_SPAN = 1 << 24


@dataclass(frozen=True)
class UidLease:
    """A host uid that one sandbox alone runs as, held until ``release``.

    The kernel counts many limits per user (processes, inotify instances and watches, pipe
    buffers, pending signals, message queue bytes): sandboxes that shared a uid would share
    those, with each other and with any account of that uid. A lease is a lock file under the
    state folder, flocked while the sandbox lives; a crashed owner's lock goes with it.
    """

    uid: int
    path: Path
    fd: int
    # Taken by the first release, never given back: a clean-up run again (cut short by an
    # interrupt, then at exit) must neither close an fd reused since nor unlink another's lease.
    _released: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def release(self) -> None:
        if not self._released.acquire(blocking=False):
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(self.fd)


def lease_uid(state_dir: Path) -> UidLease:
    folder = state_dir / "uids"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for _ in range(100):
        uid = UID_BASE + secrets.randbelow(UID_SPAN)
        path = folder / str(uid)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # The file may have been released (unlinked) between our open and our lock.
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return UidLease(uid, path, fd)
        except OSError:
            pass
        os.close(fd)
    raise exc.ResourceContention("no free host uid for a sandbox", retry_after=0.1)


def collect_uid_leases(state_dir: Path) -> int:
    """Remove the lock files of leases whose owner is gone (their flock went with it)."""
    removed = 0
    folder = state_dir / "uids"
    if not folder.is_dir():
        return 0
    for path in folder.iterdir():
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)  # a racing lease_uid sees the inode change and picks another
            removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


# A sandbox's folder on the host (a run folder, a bundle, a container's mounts, a microVM's
# sockets) is claimed by its creator: it appears, renamed from a staging name, with a file in
# it flocked until the creator releases it (or dies). Garbage collection takes a held lock for
# a live creator, at every instant of the start, before its other files say who created it.
# In the staging folder the file is itself made under PENDING and renamed once locked, so no
# staging folder shows its file unheld while its creator lives.
CLAIM_FILE = ".claim"
STAGING = ".claiming-"
PENDING = ".pending"
_claims: dict[str, int] = {}  # folder -> the locked descriptor, for release_folder
_claims_lock = threading.Lock()


def claim_folder(folder: Path, *, file: str = CLAIM_FILE, text: str = "") -> None:
    """Make ``folder`` (0700, its parent must exist) with ``file`` in it saying ``text``,
    held by this process until ``release_folder``; FileExistsError if it exists.

    ``file`` is the name gc asks (``claimed``): the process tier's is ``owner``, whose
    text is ``pid start-time``, what its previous versions' gc reads."""
    staging = Path(tempfile.mkdtemp(prefix=STAGING, dir=folder.parent))
    fd = os.open(staging / PENDING, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # nobody else knows the file yet: never waits
        if text:
            os.write(fd, text.encode())
        os.rename(staging / PENDING, staging / file)
        if folder.exists():  # rename would replace an empty folder: mkdir's answer instead
            raise FileExistsError(f"{folder} exists")
        os.rename(staging, folder)
    except OSError:
        os.close(fd)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    with _claims_lock:
        _claims[str(folder)] = fd


def release_folder(folder: Path) -> None:
    """Let go of ``folder``'s claim (after removing it): no-op if this process holds none."""
    with _claims_lock:
        fd = _claims.pop(str(folder), None)
    if fd is not None:
        os.close(fd)


def claimed(folder: Path, file: str = CLAIM_FILE) -> bool:
    """Whether a live process holds ``folder``'s claim (a staging folder's included).
    A folder that is a link is held by nobody: gc never looks through one."""
    try:
        dir_fd = os.open(folder, _DIR_FLAGS)
    except OSError:
        return False
    try:
        return _held(dir_fd, file)
    finally:
        os.close(dir_fd)


# Gc looks into folders a shared temporary folder lets anyone make: it opens no link (to a
# device, say) and no FIFO (whose open would wait for a writer: gc, and every server and
# worker that runs it as it starts, hung on one).
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _held(dir_fd: int, name: str) -> bool:
    """Whether a live process holds the lock of the regular file ``name`` in ``dir_fd``."""
    try:
        if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return False
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped since the look
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # the lock, if taken, goes with it: a creator never locks it again
    return False


def collect_staging(state_dir: Path) -> int:
    """Remove the staging folders of creators that died before renaming them (no mounts
    yet), whatever their claim file's name. One without a claimed file is a creator between
    its mkdtemp and its lock, or a crash there: left for an hour. Only this user's folders
    are looked into and removed, never a link: the folder may be a shared temporary one."""
    removed = 0
    for staging in state_dir.glob(STAGING + "*"):
        try:
            dir_fd = os.open(staging, _DIR_FLAGS)
        except OSError:  # a link, no folder, or renamed into place meanwhile
            continue
        try:
            info = os.fstat(dir_fd)
            if info.st_uid != os.geteuid():
                continue
            names = os.listdir(dir_fd)
            # Not the pending file: probing its lock would make its creator wait on us.
            if any(_held(dir_fd, name) for name in names if name != PENDING):
                continue
            if all(name == PENDING for name in names) and time.time() - info.st_mtime < 3600:
                continue
        except OSError:
            continue
        finally:
            os.close(dir_fd)
        # Ours, in a sticky or private folder: nobody else can rename another in its place.
        shutil.rmtree(staging, ignore_errors=True)
        removed += 1
    return removed


def seconds_since_change(folder: Path) -> float | None:
    """How long ago ``folder``'s entries last changed; None if it is gone (its creator
    removed it while gc looked)."""
    try:
        return time.time() - folder.stat().st_mtime
    except FileNotFoundError:
        return None


class Piped(Protocol):
    """A process the host speaks to on its stdin and stdout, as a Popen does."""

    stdin: IO[bytes] | None
    stdout: IO[bytes] | None


class PipeStream:
    """A child's stdin/stdout pipes as the one byte stream the supervisor speaks over.

    The stream reads and writes descriptors of its own (duplicates) and frees each number
    only once no thread can use it again: the read end when its reader has read the end,
    the write end when no send is under way. Until then a closed stream's ends are
    /dev/null (a read is the end, a write goes nowhere). A number freed early is the next
    pipe's: the channel's reader, between two reads when its sandbox was closed, read the
    next sandbox's ``ready`` off it (that start then waited 20 s for an answer), and a call
    racing a close could have written into another sandbox."""

    def __init__(self, proc: subprocess.Popen[bytes] | Piped) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self._proc = proc
        self._fds = [os.dup(proc.stdin.fileno()), os.dup(proc.stdout.fileno())]  # [in, out]; -1 once freed
        # Written only when there is room (``send_all``): a supervisor that stopped reading
        # fails the send, never holds it. Only the host writes to this end.
        os.set_blocking(self._fds[0], False)
        self._closed = False
        self._sending = 0
        self._lock = threading.Lock()
        weakref.finalize(self, _close_all, self._fds)  # a reader that stopped before the end

    def recv(self) -> bytes:
        fd = self._fds[1]  # only the reader (one thread) reads, and frees, this end
        if fd < 0:
            return b""
        try:
            data = os.read(fd, 1 << 20)
        except OSError:
            self._free(1)
            raise
        if not data:
            self._free(1)
        return data

    def send(self, data: bytes, deadline: float | None = None) -> None:
        with self._lock:
            fd = self._fds[0]
            if fd < 0:
                raise BrokenPipeError(errno.EPIPE, "the stream is closed")
            self._sending += 1
        try:
            send_all(fd, lambda view: os.write(fd, view), data, deadline)
        finally:
            with self._lock:
                self._sending -= 1
                last = self._closed and not self._sending
            if last:
                self._free(0)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            try:  # dup2 ends the pipe's end and keeps its number at once: no gap to reuse it
                for fd in self._fds:
                    if fd >= 0:
                        os.dup2(null, fd, inheritable=False)
            finally:
                os.close(null)
            idle = not self._sending
        if idle:
            self._free(0)
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()

    def _free(self, end: int) -> None:
        with self._lock:
            fd, self._fds[end] = self._fds[end], -1
        if fd >= 0:
            os.close(fd)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
