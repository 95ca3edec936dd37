"""The workspace as the supervisor sees it: path resolution that follows symlinks only while
they stay inside, directory entries, and emptying the writable places for a reset.
Standard library only.
"""

from __future__ import annotations

import errno
import os
import stat

from libc import libc

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Iterable


LINK_HOPS = 40
IPC_RMID = 0


class PathRefused(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class DirWalk:
    """Where a walk of folders is, holding one descriptor whatever its depth: the folders
    above are kept as (st_dev, st_ino) and reopened through ``..`` on the way back up, checked
    to be the same folder (one moved meanwhile is refused, never followed). A descriptor per
    level made a tree 300 folders deep fail at the sandbox's RLIMIT_NOFILE, as low as 32."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        self._ids = [(st.st_dev, st.st_ino)]

    @property
    def depth(self) -> int:
        return len(self._ids) - 1

    def down(self, name: str) -> None:
        """Into the folder ``name`` of this one (``OSError`` if it is none; nothing moves)."""
        self.enter(os.open(name, DIR_FLAGS, dir_fd=self.fd))

    def enter(self, sub: int) -> None:
        """Into the folder ``sub``, a descriptor of a folder of this one, now the walk's."""
        try:
            st = os.fstat(sub)
        except BaseException:
            os.close(sub)
            raise
        os.close(self.fd)
        self.fd = sub
        self._ids.append((st.st_dev, st.st_ino))

    def up(self, mode: int = -1) -> None:
        """Back to the folder this one was entered from; ``mode`` (unless -1) put back on
        this one as it is left (a walk that opened it up), once its ``..`` is open."""
        parent = os.open("..", DIR_FLAGS, dir_fd=self.fd)
        try:
            if mode >= 0:
                os.fchmod(self.fd, mode)
            st = os.fstat(parent)
        except BaseException:
            os.close(parent)
            raise
        if (st.st_dev, st.st_ino) != self._ids[-2]:
            os.close(parent)
            raise PathRefused("missing", "a folder was moved or removed while it was walked")
        os.close(self.fd)
        self.fd = parent
        self._ids.pop()

    def take(self) -> int:
        """The descriptor, now the caller's to close."""
        fd, self.fd = self.fd, -1
        return fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Workspace:
    """``links``: False under path rules (the host's policy judges a file call by the path it
    names, so a symbolic link on the way, to a file it would refuse, is refused here)."""

    def __init__(self, root: str, links: bool = True) -> None:
        self.root = root
        self.links = links

    def _split(self, path: str) -> list[str]:
        if path.startswith("/"):
            if path == self.root or path.startswith(self.root + "/"):
                path = path[len(self.root) :]
            else:
                raise PathRefused("escape", f"{path!r} is outside the workspace {self.root}")
        return [p for p in path.split("/") if p not in ("", ".")]

    def resolve(self, path: str, follow_last: bool, create_dirs: bool = False) -> tuple[int, str]:
        """Return (fd of the parent directory, final name); '' names the root itself."""
        queue = self._split(path)
        walk = DirWalk(os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        hops = 0
        try:
            while queue:
                part = queue.pop(0)
                if part == "..":
                    if walk.depth == 0:
                        raise PathRefused("escape", f"{path!r} leads outside the workspace")
                    walk.up()
                    continue
                last = not queue
                try:
                    st = os.stat(part, dir_fd=walk.fd, follow_symlinks=False)
                except FileNotFoundError:
                    if last:
                        return walk.take(), part
                    if not create_dirs:
                        raise PathRefused("missing", f"{path!r}: no such directory {part!r}")
                    os.mkdir(part, 0o755, dir_fd=walk.fd)
                    st = os.stat(part, dir_fd=walk.fd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode) and (not last or follow_last):
                    hops += 1
                    if hops > LINK_HOPS:
                        raise PathRefused("escape", f"{path!r}: too many levels of symlinks")
                    target = os.readlink(part, dir_fd=walk.fd)
                    if not self.links:
                        raise PathRefused(
                            "escape",
                            f"{path!r}: {part!r} is a symbolic link (to {target!r}); under the policy's "
                            "path rules a file is named by its own path, not through a link",
                        )
                    if target.startswith("/"):
                        if not (target == self.root or target.startswith(self.root + "/")):
                            raise PathRefused(
                                "escape", f"{path!r}: symlink {part!r} leads outside the workspace"
                            )
                        walk.close()
                        walk = DirWalk(os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
                        target = target[len(self.root) :]
                    queue[:0] = [p for p in target.split("/") if p not in ("", ".")]
                    continue
                if last:
                    return walk.take(), part
                if not stat.S_ISDIR(st.st_mode):
                    raise PathRefused("type", f"{path!r}: {part!r} is not a directory")
                walk.down(part)
            return walk.take(), ""
        finally:
            walk.close()


def _clean(name: str) -> str:
    """Undecodable bytes in a file name become U+FFFD: the host must never see a lone surrogate."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _entry(path: str, st: os.stat_result) -> dict[str, Any]:
    shown = _clean(path)
    lossy = shown != path  # its name (or a folder's on its way) is not UTF-8: no op can name it
    path = shown
    mode = st.st_mode
    kind = (
        "file"
        if stat.S_ISREG(mode)
        else "dir"
        if stat.S_ISDIR(mode)
        else "symlink"
        if stat.S_ISLNK(mode)
        else "other"
    )
    entry = {
        "path": path,
        "name": path.rsplit("/", 1)[-1],
        "type": kind,
        "size": st.st_size,
        "mode": stat.S_IMODE(mode),
        "mtime": st.st_mtime,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
    }
    if lossy:
        entry["lossy"] = True
    return entry


def _listxattr(path: str) -> "list[str]":
    try:
        return os.listxattr(path)
    except OSError:  # no xattr support on this filesystem
        return []


def empty_dir(path: str, keep: "Iterable[str]" = ()) -> None:
    """Remove everything under ``path``, whatever modes the code left on it, but the
    folders ``keep`` (absolute paths) and those on the way to them, emptied.

    Each directory is listed once (linear in the size of the tree: a pool's reset must not
    stall on a wide one) and one directory is held open at a time (a tree may be thousands
    deep); ``pending`` keeps, per level, the subdirectories still to empty.
    Every process of the sandbox is dead by now, so nothing moves under us.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    kept = set()
    for folder in keep:
        while folder.startswith(path.rstrip("/") + "/"):
            kept.add(folder)
            folder = os.path.dirname(folder)
    fd = os.open(path, flags)
    names: list[str] = []  # the path from ``path`` down to ``fd``
    pending: list[list[str]] = [_unlink_files(fd)]
    try:
        while True:
            if pending[-1]:
                child = pending[-1].pop()
                sub = os.open(child, flags, dir_fd=fd)
                os.close(fd)
                fd = sub
                names.append(child)
                pending.append(_unlink_files(fd))
                continue
            pending.pop()
            if not names:
                return
            parent = os.open("..", flags, dir_fd=fd)
            os.close(fd)
            fd = parent
            if os.path.join(path, *names) in kept:
                names.pop()
            else:
                os.rmdir(names.pop(), dir_fd=fd)
    finally:
        os.close(fd)


def _unlink_files(fd: int) -> list[str]:
    """Unlink every non-directory in ``fd``; return its subdirectories, made enterable."""
    subdirs = []
    with os.scandir(fd) as it:
        entries = list(it)  # all first: a directory is not changed while it is read
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            os.unlink(entry.name, dir_fd=fd)
            continue
        st = entry.stat(follow_symlinks=False)
        if st.st_mode & 0o700 != 0o700:
            os.chmod(entry.name, 0o700, dir_fd=fd)
        subdirs.append(entry.name)
    return subdirs


# The system calls that make SysV IPC objects and POSIX message queues (x86_64).
NR_SHMGET, NR_SEMGET, NR_MSGGET, NR_MQ_OPEN = 29, 64, 68, 240


def unlisted_ipc() -> "tuple[int, ...]":
    """The calls that make IPC objects a reset could not find here: SysV's where the kernel
    does not list them (/proc/sysvipc, which ``remove_sysv_ipc`` reads), POSIX queues where
    /dev/mqueue is no mount to empty. gVisor's kernel does neither, and the next user read a
    segment, a queue and a semaphore the last one made; there code may make none
    (``callfilters.deny_calls``)."""
    calls: "tuple[int, ...]" = ()
    if not os.path.isdir("/proc/sysvipc"):
        calls += (NR_SHMGET, NR_SEMGET, NR_MSGGET)
    if not os.path.ismount("/dev/mqueue"):
        calls += (NR_MQ_OPEN,)
    return calls


def remove_sysv_ipc() -> None:
    """Remove the IPC namespace's SysV shared memory, message queues and semaphores."""
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:  # a kernel without SysV IPC, or a tier that hides it
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 1 and fields[1].isdigit():
                try:
                    ident = int(fields[1])  # semctl(id, semnum, cmd), the others (id, cmd, buf)
                    libc(f"{kind}ctl", *((ident, 0, IPC_RMID) if kind == "sem" else (ident, IPC_RMID, 0)))
                except OSError:
                    pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_exactly(fd: int, size: int) -> bytes:
    """``size`` bytes from ``fd``, fewer only at its end; never a byte more."""
    data = b""
    while len(data) < size:
        try:
            chunk = os.read(fd, size - len(data))
        except InterruptedError:
            continue
        if not chunk:
            break
        data += chunk
    return data


def _os_error(rid: int, exc: OSError) -> dict[str, Any]:
    kind = {
        errno.ENOENT: "missing",
        errno.ENOTDIR: "type",
        errno.EISDIR: "type",
        errno.ELOOP: "escape",
        errno.ENOSPC: "full",
        errno.EDQUOT: "full",
        errno.EEXIST: "exists",
        errno.EACCES: "permission",
        errno.EPERM: "permission",
        errno.ENOTEMPTY: "type",
        errno.EROFS: "permission",
    }.get(exc.errno or 0, "os")
    return {
        "id": rid,
        "ev": "error",
        "kind": kind,
        "message": f"{exc.strerror}: {exc.filename or ''}".rstrip(": "),
    }
