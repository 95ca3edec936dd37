"""A workspace folder as a tar stream, made piece by piece as the host pulls it.

``files.download_dir`` asks for the next chunk (at most a few MiB) until the end: memory
here stays one chunk and one open file whatever the tree holds, a 10 GB sparse file
included. The host checks every member again (it trusts nothing from inside); the caps here
only make an honest refusal early and cheap: a tree over the host's ``max_bytes`` (file
contents by apparent size, a hard-linked file once) or ``max_entries`` is refused as soon
as the walk sees it, before its data is read.

Entries are walked through directory descriptors with ``O_NOFOLLOW``, never by path: code
racing the walk cannot point it outside the folder; one is held whatever the depth
(``DirWalk``). A folder ``MAX_DEPTH`` deep (what the host takes in a member's name) is sent
as a bare header of type ``d`` and left out with what it holds: the host reports it (a
download), or the walk is refused (``deep``: a snapshot, which must not lose files).
Symlinks are sent as links, further names of a file as hard links, FIFOs, devices and
sockets as bare headers (the host skips and reports them; tar has no type for sockets, so
they carry ``SOCKTYPE``). A name that changed kind between its listing and its reading (a
file become a link, a link a FIFO) is sent as a bare header of ``CHANGEDTYPE``, reported by
the host: the code may change its files at any time, and one race must not fail the rest. A
path longer than ``MAX_NAME`` is refused (``long_path``): the host takes no longer name.

An entry of the sandbox's own user whose mode denies that user a read (``chmod 0``: a file
without ``r``, a folder without ``r`` or ``x``) is still taken: the supervisor runs as that
user, so it adds the bits it lacks, reads, and puts the mode back; the archive keeps the
mode it had. The bits are added through a descriptor of the very inode that was checked
(``O_PATH | O_NOFOLLOW``, then its ``/proc/self/fd`` name), never by a path a racing link
could redirect; a file's mode is back as soon as it is open, a folder's once its walk
leaves it.

Standard library only; runs on any Python >= 3.8 found inside the sandbox.
"""

from __future__ import annotations

import errno
import os
import stat
import tarfile

from fileops import DirWalk, PathRefused

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any

    from fileops import Workspace

BLOCK = 512
MAX_CHUNK = 16 << 20
MAX_DEPTH = 128  # folders in a member's name: what the host takes
MAX_NAME = 4096  # bytes of a member's path: what the host accepts
OPEN_TRANSFERS = 4  # a host that vanished mid-download leaves at most this many behind
SOCKTYPE = b"s"
DEEPTYPE = b"d"  # a folder past MAX_DEPTH, left out: its name only, for the host to report
CHANGEDTYPE = b"c"  # a name that changed kind while it was archived: left out, reported
# What opening or reading a listed name gives when it changed kind meanwhile: a link where a
# file was (ELOOP, O_NOFOLLOW), a file where a link was (EINVAL from readlink), a socket
# (ENXIO), a file where a folder was (ENOTDIR), or nothing any more (ENOENT).
CHANGED = (errno.ENOENT, errno.EINVAL, errno.ELOOP, errno.ENOTDIR, errno.ENXIO)
O_PATH = getattr(os, "O_PATH", 0o10000000)  # Linux's value, for a Python without the name
READ_DIR = stat.S_IRUSR | stat.S_IXUSR  # what the owner needs to list a folder and reach its entries
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
HINT = "; pass a larger {} to files.download_dir to allow it"

_transfers: "dict[str, TarStream]" = {}
_opened = [0]


def handle(workspace: "Workspace", h: "dict[str, Any]") -> "tuple[dict[str, Any], bytes]":
    """One ``get_archive`` request: ``open`` a transfer, take its ``next`` chunk, ``close`` it."""
    stage = h.get("stage")
    if stage == "open":
        root = _open_root(workspace, str(h.get("path", "")))
        stream = TarStream(root, int(h["max_bytes"]), int(h["max_entries"]), h.get("deep") == "refuse")
        _opened[0] += 1
        tx = "t%d" % _opened[0]
        _transfers[tx] = stream
        while len(_transfers) > OPEN_TRANSFERS:
            _transfers.pop(next(iter(_transfers))).close()
        return {"tx": tx}, b""
    tx = str(h.get("tx", ""))
    stream = _transfers.get(tx)
    if stage == "close":
        if stream is not None:
            del _transfers[tx]
            stream.close()
        return {}, b""
    if stage != "next":
        raise PathRefused("internal", "unknown get_archive stage %r" % (stage,))
    if stream is None:
        raise PathRefused("internal", "no open download %r" % tx)
    try:
        data = stream.read(max(1, min(int(h.get("length", BLOCK)), MAX_CHUNK)))
    except BaseException:
        del _transfers[tx]
        stream.close()
        raise
    if stream.finished:
        del _transfers[tx]
        stream.close()
    return {"eof": stream.finished}, data


def _open_root(workspace: "Workspace", path: str) -> int:
    parent, name = workspace.resolve(path, follow_last=True)
    try:
        if not name:
            return os.dup(parent)
        try:
            return os.open(name, DIR_FLAGS, dir_fd=parent)
        except NotADirectoryError:
            raise PathRefused("type", "%r is not a directory" % path) from None
    finally:
        os.close(parent)


def _open_entry(parent: int, name: str, st: os.stat_result, flags: int, bits: int) -> "tuple[int, int]":
    """``name`` of ``parent`` opened with ``flags``, and the mode to put back on it, or -1.

    An entry of our own user whose mode denies us ``bits`` (``chmod 0`` by the code, so that
    downloads and snapshots fail) is opened up first: through a descriptor of the inode
    ``st`` describes (``O_PATH | O_NOFOLLOW``: a link swapped in meanwhile is that link, never
    what it points to), and its ``/proc/self/fd`` name, which leads to that inode alone. Where
    that cannot be done, the plain open says why (``EACCES``), as it would have."""
    if bits & ~st.st_mode and st.st_uid == os.geteuid():
        pinned = os.open(name, O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            now = os.fstat(pinned)
            mode = stat.S_IMODE(now.st_mode)
            if (now.st_dev, now.st_ino, stat.S_IFMT(now.st_mode)) == (
                st.st_dev,
                st.st_ino,
                stat.S_IFMT(st.st_mode),
            ):
                fd = _opened_up(pinned, mode, bits, flags & ~os.O_NOFOLLOW)
                if fd >= 0:
                    return fd, mode
        finally:
            os.close(pinned)
    return os.open(name, flags, dir_fd=parent), -1


def _opened_up(pinned: int, mode: int, bits: int, flags: int) -> int:
    """The inode of the ``O_PATH`` descriptor ``pinned``, opened with ``bits`` added to its
    ``mode``; -1 when its mode cannot be changed (no /proc, another owner)."""
    inode = "/proc/self/fd/%d" % pinned
    try:
        os.chmod(inode, mode | bits)
    except OSError:
        return -1
    try:
        return os.open(inode, flags)
    except BaseException:
        os.chmod(inode, mode)
        raise


def _names(fd: int) -> "list[str]":
    """A folder's names, last first (the walk pops them in order)."""
    return sorted(os.listdir(fd), reverse=True)


class TarStream:
    """The tar stream of one folder; ``read(n)`` makes just enough of it for ``n`` bytes."""

    def __init__(self, root: int, max_bytes: int, max_entries: int, refuse_deep: bool = False) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.refuse_deep = refuse_deep  # a snapshot: a folder past MAX_DEPTH fails it, not left out
        self.total = 0
        self.entries = 0
        self.pending = bytearray()
        # each level's names to come, its prefix, and its mode to put back on leaving (or -1)
        self.dirs: "list[tuple[list[str], str, int]]" = []
        self.file = -1
        self.left = 0
        self.pad = 0
        self.first_names: "dict[tuple[int, int], str]" = {}  # (dev, ino) -> its first name
        self.ended = False
        self.finished = False
        self.walk = DirWalk(root)  # one descriptor whatever the depth
        try:
            self.dirs.append((_names(root), "", -1))
        except BaseException:
            self.walk.close()
            raise

    def read(self, size: int) -> bytes:
        while len(self.pending) < size and not self.ended:
            self._step(size - len(self.pending))
        data = bytes(self.pending[:size])
        del self.pending[:size]
        self.finished = self.ended and not self.pending
        return data

    def close(self) -> None:
        if self.file >= 0:
            os.close(self.file)
            self.file = -1
        # A walk cut short (an error, a host gone) still puts back the modes it opened up.
        while len(self.dirs) > 1 and self.walk.fd >= 0:
            mode = self.dirs.pop()[2]
            try:
                self.walk.up(mode)
            except (OSError, PathRefused):
                break
        self.walk.close()
        self.dirs = []
        self.pending = bytearray()

    def _step(self, want: int) -> None:
        if self.file >= 0:
            if self.left:
                chunk = os.read(self.file, min(self.left, want, 4 << 20))
                if not chunk:  # the file shrank meanwhile: zeros keep the archive whole
                    chunk = bytes(min(self.left, want))
                self.pending += chunk
                self.left -= len(chunk)
                return
            self.pending += bytes(self.pad)
            os.close(self.file)
            self.file = -1
            return
        if not self.dirs:
            self.pending += bytes(2 * BLOCK)
            self.ended = True
            return
        names, prefix, mode = self.dirs[-1]
        if not names:
            if len(self.dirs) > 1:
                self.walk.up(mode)
            else:
                self.walk.close()
            self.dirs.pop()  # after the move up: a walk cut by it still knows where it is
            return
        name = names.pop()
        self._member(self.walk.fd, name, prefix + name)

    def _member(self, parent: int, name: str, arc: str) -> None:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:  # removed since the folder was listed
            return
        self.entries += 1
        if self.entries > self.max_entries:
            message = "the folder has more than max_entries=%d entries" % self.max_entries
            raise PathRefused("too_large", message + HINT.format("max_entries"))
        if len(arc.encode("utf-8", "surrogateescape")) > MAX_NAME:
            message = "%r... is a path longer than the %d bytes an archive takes" % (arc[:200], MAX_NAME)
            raise PathRefused("long_path", message)
        info = tarfile.TarInfo(arc)
        info.mode = stat.S_IMODE(st.st_mode)  # as it is, though the walk may open it up a moment
        info.mtime = int(st.st_mtime)
        if stat.S_ISDIR(st.st_mode):
            if len(self.dirs) >= MAX_DEPTH:  # what is in it would be past what the host takes
                if self.refuse_deep:
                    message = "%r... is %d folders deep: what is in it is past what an archive takes" % (
                        arc[:200],
                        MAX_DEPTH,
                    )
                    raise PathRefused("deep", message)
                info.type = DEEPTYPE
                self._header(info)
                return
            try:
                sub, mode = _open_entry(parent, name, st, DIR_FLAGS, READ_DIR)
            except OSError as error:
                self._changed(info, error)
                return
            self.walk.enter(sub)
            names: "list[str]" = []
            self.dirs.append((names, arc + "/", mode))  # before listing: close() knows the level
            names += _names(self.walk.fd)
            info.type = tarfile.DIRTYPE
            self._header(info)
        elif stat.S_ISLNK(st.st_mode):
            info.type = tarfile.SYMTYPE
            try:
                info.linkname = os.readlink(name, dir_fd=parent)
            except OSError as error:
                self._changed(info, error)
                return
            self._header(info)
        elif stat.S_ISREG(st.st_mode):
            self._file(parent, name, arc, info, st)
        else:
            self._special(info, st)

    def _file(self, parent: int, name: str, arc: str, info: tarfile.TarInfo, st: os.stat_result) -> None:
        first = self.first_names.get((st.st_dev, st.st_ino))
        if first is not None:
            info.type = tarfile.LNKTYPE
            info.linkname = first
            self._header(info)
            return
        try:
            fd, mode = _open_entry(parent, name, st, FILE_FLAGS, stat.S_IRUSR)
        except OSError as error:
            self._changed(info, error)
            return
        try:
            if mode >= 0:  # opened: its mode is what it was again before a byte is read
                os.fchmod(fd, mode)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # replaced meanwhile: send what it is now, or nothing
                os.close(fd)
                if not stat.S_ISDIR(st.st_mode):
                    self._special(info, st)
                return
            if self.total + st.st_size > self.max_bytes:
                message = "%r is %d bytes: with the %d bytes before it, more than max_bytes=%d" % (
                    arc,
                    st.st_size,
                    self.total,
                    self.max_bytes,
                )
                raise PathRefused("too_large", message + HINT.format("max_bytes"))
        except BaseException:
            os.close(fd)
            raise
        self.total += st.st_size
        if st.st_nlink > 1:
            self.first_names[(st.st_dev, st.st_ino)] = arc
        info.size = st.st_size
        self._header(info)
        self.file = fd
        self.left = st.st_size
        self.pad = -st.st_size % BLOCK

    def _changed(self, info: tarfile.TarInfo, error: OSError) -> None:
        """A name that is no longer what it was listed as (``error``, of opening or reading
        it, says so): sent as a bare ``CHANGEDTYPE`` header, for the host to report."""
        if error.errno not in CHANGED:
            raise error
        info.type = CHANGEDTYPE
        info.linkname = ""
        self._header(info)

    def _special(self, info: tarfile.TarInfo, st: os.stat_result) -> None:
        mode = st.st_mode
        if stat.S_ISFIFO(mode):
            info.type = tarfile.FIFOTYPE
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            info.type = tarfile.CHRTYPE if stat.S_ISCHR(mode) else tarfile.BLKTYPE
            info.devmajor = os.major(st.st_rdev)
            info.devminor = os.minor(st.st_rdev)
        else:
            info.type = SOCKTYPE
        self._header(info)

    def _header(self, info: tarfile.TarInfo) -> None:
        self.pending += info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
