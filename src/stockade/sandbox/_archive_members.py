"""The members of a download as they come: each name checked, each entry and byte counted,
each written into the stage: the streaming side of ``Extraction``.

A part of ``Extraction``. A member's name must stay under ``dest`` (``_parts``); it is
written below real folders of the stage only, files created with ``O_EXCL | O_NOFOLLOW``;
links are only modelled here (``_Node``), made at the end once checked. Every entry counts
against ``max_entries`` and, with its metadata, ``max_bytes``; a file's aligned runs of zeros
are left holes.
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
import tarfile
from dataclasses import dataclass, field

from stockade import exceptions as exc
from stockade.sandbox._archive_links import Parts, _Node
from stockade.sandbox._archive_stage import ExtractionStage
from stockade.sandbox._tar import NO_DATA, Member, malformed
from stockade.types import SkippedEntry

__all__ = ["ENTRY_COST", "FOLDER_COST", "MAX_DEPTH", "ExtractionMembers"]

MAX_NAME = 4096  # bytes of a member's name or link target
MAX_COMPONENT = 255  # bytes of one name in it, as on every Linux filesystem
MAX_LINK_BYTES = 32 * 1024 * 1024  # link targets of one download together: held until the end
MAX_DEPTH = 128  # folders in a member's name
FOLDER_COST = 4096  # bytes a folder takes on disk besides its name (one block)
ENTRY_COST = 256  # bytes a file or link takes on disk besides its name (an inode)
HOLE = 64 * 1024  # an aligned run of zeros this long is left a hole, not written
_ZEROS = bytes(HOLE)
MAX_REPORTED = 1000  # skipped entries listed in the result (all are counted)

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)
_SPECIAL = {
    tarfile.FIFOTYPE: "fifo",
    tarfile.CHRTYPE: "char device",
    tarfile.BLKTYPE: "block device",
    b"s": "socket",  # the supervisor's mark: tar has no type for sockets
    b"d": "too deep",  # the supervisor's mark: a folder past MAX_DEPTH, left out with its contents
    b"c": "changed",  # the supervisor's mark: a name that changed kind while it was archived
}


def _parts(name: str, what: str = "member") -> Parts:
    """A member's name as folder names under ``dest``; refuses names that lead out."""
    if "\x00" in name or name.startswith("/"):
        raise exc.PathEscapeError(f"the archive's {what} {name!r} leads outside", path=name)
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise exc.PathEscapeError(f"the archive's {what} {name!r} leads outside", path=name)
    if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME or len(parts) > MAX_DEPTH:
        raise malformed(f"a {what} name over {MAX_NAME} bytes or {MAX_DEPTH} folders deep")
    if any(len(p.encode("utf-8", "surrogateescape")) > MAX_COMPONENT for p in parts):
        raise malformed(f"a {what} name with a part over {MAX_COMPONENT} bytes")
    return parts


@dataclass(slots=True)
class _Open:
    fd: int
    mode: int
    mtime: float
    size: int = 0  # its data so far, holes included
    zeros: int = 0  # zeros that began the aligned run ending at ``size``, not written yet


@dataclass(frozen=True, slots=True)
class _Place:
    """Where a member goes: its path, the model of its folder and the folder, open."""

    parts: Parts
    path: str
    folder: _Node
    parent: int

    @property
    def name(self) -> str:
        return self.parts[-1]

    @property
    def entries(self) -> dict[str, _Node]:
        assert self.folder.children is not None
        return self.folder.children


@dataclass(slots=True)
class _Tally:
    charged: int = 0  # data bytes the archive declared (what max_bytes caps)
    written: int = 0  # bytes written to files
    entries: int = 0
    link_bytes: int = 0  # link targets, held in the model until the end
    skipped: list[SkippedEntry] = field(default_factory=list)
    skipped_count: int = 0


class ExtractionMembers(ExtractionStage):
    """The members of one download into ``dest``, handed out by the tar reader (``_member``,
    ``_data``, ``_end``), with the model of the tree they make (``_root``)."""

    def __init__(
        self,
        dest: str | os.PathLike[str],
        *,
        max_bytes: int,
        max_entries: int,
        links_anywhere: bool,
        count_metadata: bool,
    ) -> None:
        super().__init__(dest)
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.links_anywhere = links_anywhere
        self.count_metadata = count_metadata
        self._root = _Node.folder()
        self._tally = _Tally()
        self._file: _Open | None = None

    def _discard(self) -> None:
        """Undo everything this download did, the file being written closed first; never raises."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                os.close(self._file.fd)
            self._file = None
        super()._discard()

    def _count(self) -> None:
        self._tally.entries += 1
        if self._tally.entries > self.max_entries:
            raise exc.FileTooLarge(
                f"the download into {str(self.dest)!r} has more than max_entries={self.max_entries} "
                "entries; pass a larger max_entries to files.download_dir to allow it",
                path=str(self.dest),
            )

    def _charge(self, size: int, path: str, what: str) -> None:
        if self._tally.charged + size > self.max_bytes:
            raise exc.FileTooLarge(
                f"the download into {str(self.dest)!r} would write more than max_bytes="
                f"{self.max_bytes} bytes ({path!r} {what}, after {self._tally.charged}); "
                "pass a larger max_bytes to files.download_dir to allow it",
                path=path,
            )
        self._tally.charged += size

    def _charge_entry(self, kind: str, path: str, name: str, extra: int = 0) -> None:
        """An entry made on disk costs its name and an inode, a folder a block, a link its
        target too: without this, 60,000 empty folders of 255-byte names wrote 257 MB of
        metadata at ``max_bytes=0``."""
        if self.count_metadata:
            size = (FOLDER_COST if kind == "dir" else ENTRY_COST) + extra
            size += len(name.encode("utf-8", "surrogateescape"))
            self._charge(size, path, f"takes {size} bytes as a {kind} on disk")

    def _member(self, m: Member) -> bool:
        self._count()
        if m.type not in NO_DATA:  # files, and unknown types whose data is skipped
            self._charge(m.size, m.name, f"is {m.size} bytes")
        parts = _parts(m.name)
        path = "/".join(parts) or "."
        skipped = _SPECIAL.get(m.type)
        if skipped is None and m.type not in _FILE_TYPES and m.type not in NO_DATA:
            skipped = "other"  # a type tar readers do not know: its data is skipped too
        if skipped is not None:
            self._skip(path, skipped)
            return False
        if not parts:
            if m.type == tarfile.DIRTYPE:
                return False  # the downloaded folder itself: dest
            raise exc.FileTypeError(f"the archive's root is not a folder (type {m.type!r})", path=path)
        if parts[0] == self._stage:
            raise malformed(f"a member named like the download's own folder ({parts[0]!r})")
        folder = self._folder(parts, path)
        parent = self._folder_fd(parts[:-1])
        return self._place(m, _Place(parts=parts, path=path, folder=folder, parent=parent))

    def _place(self, m: Member, at: _Place) -> bool:
        """Put one member in its folder; True when its data should follow."""
        old = at.entries.get(at.name)
        if m.type == tarfile.DIRTYPE:
            if old is not None and old.kind == "dir":
                old.mode = _dir_mode(m.mode)
                return False
            self._make_room(at, "folder")
            self._charge_entry("dir", at.path, at.name)
            os.mkdir(at.name, 0o700, dir_fd=at.parent)
            at.entries[at.name] = _Node.folder(_dir_mode(m.mode))
        elif m.type == tarfile.SYMTYPE:
            target = m.linkname
            if not target or "\x00" in target:
                raise exc.PathEscapeError(f"{at.path!r} is a link to {target!r}", path=at.path)
            if target.startswith("/") and not self.links_anywhere:
                self._skip(at.path, "link out")  # as the links whose ``..`` lead out, at the end
                return False
            size = len(target.encode("utf-8", "surrogateescape"))
            if size > MAX_NAME:
                raise malformed(f"a link target over {MAX_NAME} bytes")
            self._tally.link_bytes += size
            if self._tally.link_bytes > MAX_LINK_BYTES:
                message = f"the download's link targets add up to more than {MAX_LINK_BYTES} bytes"
                raise exc.FileTooLarge(message, path=at.path)
            self._make_room(at, "link")
            self._charge_entry("link", at.path, at.name, size)
            at.entries[at.name] = _Node("link", target=target)
        elif m.type == tarfile.LNKTYPE:
            self._hard_link(m, at)
        else:
            self._make_room(at, "file")
            self._charge_entry("file", at.path, at.name)
            fd = os.open(at.name, _NEW_FILE, 0o600, dir_fd=at.parent)
            st = os.fstat(fd)
            at.entries[at.name] = _Node("file", inode=(st.st_dev, st.st_ino))
            self._file = _Open(fd=fd, mode=m.mode, mtime=m.mtime)
            return True
        return False

    def _folder(self, parts: Parts, path: str) -> _Node:
        """The node of the folder holding ``parts``, made with those above it when missing."""
        node = self._root
        for depth, name in enumerate(parts[:-1]):
            assert node.children is not None
            child = node.children.get(name)
            if child is None:
                self._count()  # a folder the archive implies is an entry too
                self._charge_entry("dir", "/".join(parts[: depth + 1]), name)
                os.mkdir(name, 0o700, dir_fd=self._folder_fd(parts[:depth]))
                child = node.children[name] = _Node.folder()
            elif child.kind != "dir":
                above = "/".join(parts[: depth + 1])
                if child.kind == "link":
                    raise exc.PathEscapeError(
                        f"{path!r} would be written through the link {above!r}", path=path
                    )
                raise exc.FileTypeError(f"{path!r} is under {above!r}, which is a file", path=path)
            node = child
        return node

    def _make_room(self, at: _Place, kind: str) -> None:
        """A later member replaces an earlier one of the same name, as tar does; never a folder."""
        old = at.entries.get(at.name)
        if old is None:
            return
        if old.kind == "dir":
            message = f"{at.path!r} comes as a folder, then as a {kind}: a folder is never replaced"
            raise exc.FileTypeError(message, path=at.path)
        if old.kind == "file":
            os.unlink(at.name, dir_fd=at.parent)
        del at.entries[at.name]

    def _hard_link(self, m: Member, at: _Place) -> None:
        target_parts = _parts(m.linkname, "hard link target")
        target = self._lookup(target_parts)
        if target is None or target.kind != "file":
            message = f"{at.path!r} is a hard link to {m.linkname!r}, which is no file of this download"
            raise exc.PathEscapeError(message, path=at.path)
        if target is at.entries.get(at.name):
            return  # a name linked to itself: already there
        self._make_room(at, "hard link")
        self._charge_entry("hard link", at.path, at.name)
        source = self._open(self._tree_fd, target_parts[:-1])
        try:
            st = os.stat(target_parts[-1], dir_fd=source, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != target.inode:
                raise exc.WorkspaceError(f"{m.linkname!r} changed under the download", path=at.path)
            os.link(target_parts[-1], at.name, src_dir_fd=source, dst_dir_fd=at.parent, follow_symlinks=False)
        finally:
            os.close(source)
        at.entries[at.name] = _Node("file", inode=target.inode, hard=True)

    def _skip(self, path: str, kind: str) -> None:
        self._tally.skipped_count += 1
        if len(self._tally.skipped) < MAX_REPORTED:
            self._tally.skipped.append(SkippedEntry(path=path, kind=kind))

    def _lookup(self, parts: Parts) -> _Node | None:
        node: _Node | None = self._root
        for name in parts:
            if node is None or node.children is None:
                return None
            node = node.children.get(name)
        return node

    def _data(self, piece: memoryview) -> None:
        """Write a piece of the file, its aligned ``HOLE``-long runs of zeros left holes
        (a run may span pieces: its zeros are held back until it ends): a sparse file of the
        sandbox, whose holes come as zeros, stays sparse here. Checking a run costs a copy and
        a compare (about 20 GB/s)."""
        opened = self._file
        assert opened is not None
        start = at = 0  # piece[start:at]: data not written yet
        while at < len(piece):
            offset = opened.size + at
            end = min(len(piece), at + HOLE - offset % HOLE)
            run = piece[at:end]
            if opened.zeros == offset % HOLE and run[0] == 0 and run.tobytes() == _ZEROS[: len(run)]:
                _write_at(opened.fd, piece[start:at], opened.size + start)
                start = end
                opened.zeros = (opened.zeros + len(run)) % HOLE  # a whole run: a hole, left so
            elif opened.zeros:  # its run has data after all: its zeros are written before it
                _write_at(opened.fd, memoryview(_ZEROS)[: opened.zeros], offset - opened.zeros)
                opened.zeros = 0
            at = end
        _write_at(opened.fd, piece[start:], opened.size + start)
        opened.size += len(piece)
        self._tally.written += len(piece)

    def _end(self) -> None:
        opened, self._file = self._file, None
        assert opened is not None
        try:
            os.ftruncate(opened.fd, opened.size)  # a hole at its end has no byte written to give it
            os.fchmod(opened.fd, (opened.mode & 0o755) | 0o600)
            if math.isfinite(opened.mtime):
                with contextlib.suppress(OverflowError, ValueError, OSError):
                    os.utime(opened.fd, (opened.mtime, opened.mtime))
        finally:
            os.close(opened.fd)


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _dir_mode(mode: int) -> int:
    return (mode & 0o755) | 0o700
