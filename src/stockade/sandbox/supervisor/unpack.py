"""A tar stream unpacked as the host pushes it, a chunk at a time: a folder uploaded
(``files.upload_dir``, a workspace seeded), an archive put, a snapshot's files restored.

``put_archive`` in stages: ``open`` a transfer (the destination folder, made when missing, a
staging folder in it, and a thread that unpacks what a socket pair carries into it),
``append`` each chunk (a few MiB: the host never sends more in one frame), then ``commit``
(the host sent it all, and saw a snapshot's object hash to its name: the staged entries
move into place) or ``abort``.
Memory here stays one chunk and the socket's buffer whatever the archive holds; a 1 GiB archive
sent as one frame killed a 128 MiB sandbox's supervisor, and a 560 MiB folder uploaded as one
killed a 1 GiB sandbox.

Nothing half-unpacked is ever in place: a transfer that fails (a member that does not fit, a
malformed archive, the host's ``abort``, a move into place refused midway: every move before it
is taken back, ``_Moves``) has its staging folder removed, and the folders made
for the destination (a restore that failed leaves no sandbox anyway). The unpacking refuses, as soon
as a member's header comes and before its data, a tree whose files would not fit the
destination's filesystem (kind ``full``): the host then stops after a chunk or two instead
of sending gigabytes into a tmpfs they cannot fit.

What is not workspace content never enters: FIFOs, sockets (``archive.py`` marks them
``SOCKTYPE``, which tarfile would have made an empty executable file) and devices are left out
and named in the commit's reply, as a download names them. A restore may also carry the
restoring sandbox's rules (``keep``, compiled by the host: ``_sandbox_rules.unpack_filter``):
what they hide, or do not let the run read, is left out as it streams past, its data never
written, as the host's walk leaves it out of an upload.

Standard library only; runs on any Python >= 3.8 found inside the sandbox.
"""

from __future__ import annotations

import _socket
import os
import re
import stat
import threading
import unicodedata

from fileops import PathRefused, _write_all, empty_dir

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Iterator, Optional

    from fileops import Workspace

OPEN_TRANSFERS = 2  # a host that vanished mid-restore leaves at most this many behind
STAGING = ".stockade-unpacking-"
READ_BUFFER = 1 << 20
MAX_REPORTED = 1000  # left-out entries named in the reply (as a download names at most)
_CONTENT = (b"0", b"\0", b"7", b"1", b"2", b"5")  # files, hard links, symlinks, folders
_SPECIAL = {
    b"6": "fifo",
    b"3": "char device",
    b"4": "block device",
    b"s": "socket",
    b"d": "too deep",
    b"c": "changed",
}

_transfers: "dict[str, Unpacking]" = {}
_opened = [0]


def handle(area: "Workspace", h: "dict[str, Any]", body: bytes) -> "dict[str, Any]":
    """One staged ``put_archive`` request; what the reply adds (``tx`` for an ``open``)."""
    stage = h.get("stage")
    if stage == "open":
        path = str(h.get("path", ""))
        made = _missing(area, path)
        _opened[0] += 1
        tx = "u%d" % _opened[0]
        try:
            dest = _destination(area, path)
            keep = Keep(h["keep"]) if isinstance(h.get("keep"), dict) else None
            _transfers[tx] = Unpacking(dest, "%s%d-%s" % (STAGING, os.getpid(), tx), made, keep)
        except BaseException:
            _remove_made(made)
            raise
        while len(_transfers) > OPEN_TRANSFERS:
            _transfers.pop(next(iter(_transfers))).abort()
        return {"tx": tx}
    tx = str(h.get("tx", ""))
    unpacking = _transfers.get(tx)
    if stage == "abort":
        if unpacking is not None:
            del _transfers[tx]
            unpacking.abort()
        return {}
    if unpacking is None:
        raise PathRefused("internal", "no open upload or restore %r" % tx)
    if stage not in ("append", "commit"):
        raise PathRefused("internal", "unknown put_archive stage %r" % (stage,))
    try:
        if stage == "append":
            unpacking.append(body)
        else:
            del _transfers[tx]
            unpacking.commit()
            return {"skipped": unpacking.skipped, "skipped_count": unpacking.skipped_count}
    except BaseException:
        _transfers.pop(tx, None)
        unpacking.abort()
        raise
    return {}


class Keep:
    """What a restore lets in, by the restoring sandbox's rules, matched as the host's
    ``_globs`` matches them (the host sends each glob compiled): nothing ``hide`` covers (a
    folder with what it holds; a repository's store by its name, whose history holds every
    file), and only what ``read`` names and the folders on the way to it."""

    def __init__(self, spec: "dict[str, Any]") -> None:
        self.hide = [(re.compile(p, re.DOTALL), re.compile(f, re.DOTALL) if f else None, bool(plain))
                     for p, f, plain in spec.get("hide") or ()]  # fmt: skip
        self.stores = frozenset(spec.get("stores") or ())
        read = spec.get("read")
        self.read = None if read is None else [(re.compile(p, re.DOTALL), bool(plain), str(prefix))
                                               for p, plain, prefix in read]  # fmt: skip

    def allows(self, name: str, is_dir: bool) -> bool:
        if not name.isascii():
            name = unicodedata.normalize("NFC", name)
        parts = [p for p in name.split("/") if p not in ("", ".")]
        for i in range(1, len(parts) + 1):
            path = "/".join(parts[:i])
            if parts[i - 1] in self.stores or self._hidden(path):
                return False
            folder = is_dir or i < len(parts)
            if self.read is not None and not (self._read(path) or (folder and self._on_way(path))):
                return False
        return True

    def _hidden(self, path: str) -> bool:  # _globs.covers
        for pattern, folder, plain in self.hide:
            if pattern.fullmatch(path) or (folder is not None and folder.fullmatch(path)):
                return True
            if plain and any(pattern.fullmatch(up) for up in _above(path)):
                return True
        return False

    def _read(self, path: str) -> bool:  # _globs.glob_matches
        assert self.read is not None
        for pattern, plain, _ in self.read:
            if pattern.fullmatch(path) or (plain and any(pattern.fullmatch(up) for up in _above(path))):
                return True
        return False

    def _on_way(self, folder: str) -> bool:  # _globs.may_hold
        assert self.read is not None
        for _, _, prefix in self.read:
            if not prefix or folder == prefix or folder.startswith(prefix + "/"):
                return True
            if prefix.startswith(folder + "/"):
                return True
        return False


def _above(path: str) -> "Iterator[str]":
    while "/" in path:
        path = path.rsplit("/", 1)[0]
        yield path


def _missing(area: "Workspace", path: str) -> "list[str]":
    """The folders on the way to ``path`` that are not there yet: what an upload makes, and
    removes again when it fails."""
    parts = area._split(path)
    joined = ["/".join([area.root.rstrip("/"), *parts[:i]]) for i in range(1, len(parts) + 1)]
    return [p for p in joined if not os.path.lexists(p)]


def _remove_made(made: "list[str]") -> None:
    for folder in reversed(made):  # deepest first; one the code put something in stays
        try:
            os.rmdir(folder)
        except OSError:
            pass


def _destination(area: "Workspace", path: str) -> str:
    """The folder ``path`` names in ``area``, made when missing (with the folders above it).
    Links on the way are followed only where they stay inside, as for any file request."""
    parent, name = area.resolve(path, follow_last=True, create_dirs=True)
    try:
        if name:
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
            except FileExistsError:
                pass
    finally:
        os.close(parent)
    root = os.path.realpath(area.root)
    dest = os.path.realpath("/".join([area.root.rstrip("/"), *area._split(path)]))
    if dest != root and not dest.startswith(root + "/"):  # changed since it was resolved
        raise PathRefused("escape", "%r leads outside %s" % (path, area.root))
    if not os.path.isdir(dest):
        raise PathRefused("type", "%r is not a directory" % path)
    return dest


class Unpacking:
    """One archive being unpacked into ``staging`` (made in ``dest``) by a thread that reads
    a socket pair: ``append`` writes a chunk to it, ``commit`` waits for the end and moves the
    staged entries into ``dest``, ``abort`` stops and removes them."""

    def __init__(self, dest: str, name: str, made: "list[str]", keep: "Optional[Keep]" = None) -> None:
        self.dest = dest
        self.made = made  # the folders made for dest: removed again if it fails
        self.keep = keep
        self.skipped: "list[dict[str, str]]" = []  # named, up to MAX_REPORTED
        self.skipped_count = 0
        self._left_out: "set[str]" = set()  # files left out: a further name of one stays out too
        self.staging = dest + "/" + name
        self.size = 0
        self.entries = 0
        self.error: "Optional[BaseException]" = None
        os.mkdir(self.staging, 0o700)
        # What the destination's filesystem can take (a tmpfs states its size; a filesystem
        # that states none is not checked here, its ENOSPC still is), the staging folder's
        # inode taken: counted before it, the last entry that fits was a bare ENOSPC.
        st = os.statvfs(dest)
        self.room = st.f_bavail * st.f_frsize if st.f_blocks else None
        self.inodes = st.f_favail if st.f_files else None
        # A socket pair, not a pipe: on gVisor code opens any pipe of ours through
        # /proc/1/fd/N, and could read the upload, add to it, or hold a reader of its own
        # and leave our write to it blocked for good; no /proc path opens a socket (ENXIO).
        theirs, ours = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
        read_fd, self.write_fd = theirs.detach(), ours.detach()
        self.thread = threading.Thread(target=self._unpack, args=(read_fd,), daemon=True)
        self.thread.start()

    def append(self, chunk: bytes) -> None:
        try:
            _write_all(self.write_fd, chunk)
        except BrokenPipeError:  # the unpacking stopped: its error says why
            self._finish()
            raise PathRefused("internal", "the unpacking stopped early") from None
        if self.error is not None:
            self._finish()

    def commit(self) -> None:
        """The staged entries into place, all of them or none: a move that fails midway (a
        name the workspace refuses, a folder of another owner's mode) takes back every move
        before it, and what they replaced comes back."""
        self._finish()
        moves = _Moves(self.staging + "-replaced")
        try:
            moves.into(self.staging, self.dest)
        except BaseException:
            moves.undo()
            raise
        moves.forget()
        empty_dir(self.staging)  # what is left: the folders merged into those already there
        os.rmdir(self.staging)

    def abort(self) -> None:
        try:
            self._finish()
        except BaseException:
            pass
        if os.path.isdir(self.staging):
            empty_dir(self.staging)
            os.rmdir(self.staging)
        _remove_made(self.made)

    def _finish(self) -> None:
        """End the stream, wait for the thread, raise what stopped it."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1
        self.thread.join()
        error, self.error = self.error, None
        if error is not None:
            raise error

    def _unpack(self, read_fd: int) -> None:
        import tarfile  # lazily: importing it costs more than starting the supervisor

        try:
            with os.fdopen(read_fd, "rb", buffering=READ_BUFFER) as pipe:
                tar = tarfile.open(fileobj=pipe, mode="r|*")  # compressed too, as a put archive may be
                tar.copybufsize = READ_BUFFER
                members = self._fitting(tar)
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(self.staging, members=members, filter="data")
                else:
                    tar.extractall(self.staging, members=members)
                while pipe.read(READ_BUFFER):  # the end's padding: every chunk is taken whole
                    pass
        except BaseException as error:  # raised by the main thread (``_finish``)
            self.error = error

    def _fitting(self, tar: "Any") -> "Iterator[Any]":
        """The archive's members but those left out, refused at the first one the filesystem
        has no room for."""
        for member in tar:
            if member.type not in _CONTENT:  # tarfile makes an unknown type a regular file
                self._skip(member.name, _SPECIAL.get(member.type, "other"))
                continue
            if (self.keep is not None and not self.keep.allows(member.name, member.isdir())) or (
                member.islnk() and member.linkname in self._left_out
            ):
                if not member.isdir():
                    self._left_out.add(member.name)
                continue  # by the rules: left out in silence, as an upload leaves it out
            self.entries += 1
            if self.inodes is not None and self.entries > self.inodes:
                message = "more than the %d entries %s can still hold" % (self.inodes, self.dest)
                raise PathRefused("full", message)
            if member.isfile():
                self.size += member.size
                if self.room is not None and self.size > self.room:
                    raise PathRefused(
                        "full",
                        "%r is %d bytes: with the %d bytes before it, more than the %d bytes free in %s"
                        % (member.name, member.size, self.size - member.size, self.room, self.dest),
                    )
            yield member

    def _skip(self, name: str, kind: str) -> None:
        self._left_out.add(name)
        self.skipped_count += 1
        if len(self.skipped) < MAX_REPORTED:
            self.skipped.append({"path": name, "kind": kind})


class _Moves:
    """Moves of staged entries into place, journaled so that they can all be taken back:
    what a move replaces is first moved aside (into ``aside``, on the same filesystem), never
    removed until every move is done."""

    def __init__(self, aside: str) -> None:
        self.aside = aside
        self.done: "list[tuple[str, str]]" = []  # (from, to) renames, in order
        self._set_aside = 0

    def into(self, source: str, dest: str) -> None:
        """Every entry of ``source`` into ``dest``, as unpacking there would have left them:
        a folder merged into a folder already there, anything else replacing what is there.
        A loop, not a recursion: the trees merged may be thousands of folders deep."""
        pending = [(source, dest)]
        while pending:
            source, dest = pending.pop()
            for name in sorted(os.listdir(source)):
                here, there = source + "/" + name, dest + "/" + name
                try:
                    old = os.lstat(there)
                except FileNotFoundError:
                    self._rename(here, there)
                    continue
                new = os.lstat(here).st_mode
                if stat.S_ISDIR(old.st_mode) and stat.S_ISDIR(new):
                    if not new & stat.S_IWUSR:  # its entries leave it: a staged folder, removed after
                        os.chmod(here, stat.S_IMODE(new) | stat.S_IWUSR)
                    pending.append((here, there))
                    continue
                if not self._set_aside:
                    os.mkdir(self.aside, 0o700)
                self._set_aside += 1
                self._rename(there, "%s/%d" % (self.aside, self._set_aside))
                self._rename(here, there)

    def _rename(self, source: str, dest: str) -> None:
        _rename(source, dest)
        self.done.append((source, dest))

    def undo(self) -> None:
        """Every move taken back, the last first; one that cannot be does not stop the rest."""
        for source, dest in reversed(self.done):
            try:
                _rename(dest, source)
            except OSError:
                pass
        self.done = []
        try:  # empty once all came back; what could not stays, never removed
            os.rmdir(self.aside)
        except OSError:
            pass
        self._set_aside = 0

    def forget(self) -> None:
        """What the moves replaced, removed (they are in place for good)."""
        if self._set_aside and os.path.isdir(self.aside):
            empty_dir(self.aside)
            os.rmdir(self.aside)
        self._set_aside = 0


def _rename(source: str, dest: str) -> None:
    """``os.rename``, also of a folder whose mode forbids writing in it: moving a folder to
    another parent writes its ``..`` entry, which needs that right (a read-only folder of the
    archive, 0555, was refused EACCES). Its mode is put back once it is moved."""
    mode = os.lstat(source).st_mode
    if not stat.S_ISDIR(mode) or mode & stat.S_IWUSR:
        os.rename(source, dest)
        return
    os.chmod(source, stat.S_IMODE(mode) | stat.S_IWUSR)
    try:
        os.rename(source, dest)
    except BaseException:
        os.chmod(source, stat.S_IMODE(mode))
        raise
    os.chmod(dest, stat.S_IMODE(mode))
