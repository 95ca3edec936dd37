"""Unpacking on the host what a sandbox sends (``files.download_dir``): all or nothing, bounded.

The archive is made inside the sandbox, next to the code, so every byte of it is hostile
until checked. Our own streaming extractor, not tarfile's (whose filters had bypasses and
which wants the whole archive), gives these guarantees whatever the stream holds:

* **Nothing is written outside ``dest``.** Every folder is reached from ``dest`` with
  ``openat`` and ``O_NOFOLLOW``, files are created with ``O_EXCL | O_NOFOLLOW``: no link is
  ever followed while writing, and a member below a link (of the archive, or one already in
  ``dest``) is refused. Absolute names and names with ``..`` are refused.
* **Every symlink it creates resolves inside ``dest``, by every route, now and after any
  later download.** A ``..`` in a link's target may only undo a name that is a real folder
  (``_up_through_folders``): folders are never replaced, links and missing names can be. Links are created
  last, once the whole archive is known, and each is resolved against the final tree the
  way the kernel would (links followed, at most ``LINK_HOPS`` of them, ``..`` applied where
  they lead, missing parts taken as folders): first on a model of the archive, then again
  on the real tree once everything is in place, so that links already in ``dest`` count
  too. A link whose route leaves ``dest`` at any step (an absolute link, a loop, a route
  through a file) is left out and reported (``"link out"``), so that one link the code made
  does not block the download of the rest; on the real tree (through a link ``dest``
  already had) it fails the download. Each pass over the links looks each folder up once
  (the links come in walk order) and takes at most ``max_link_steps`` (``LINK_WORK``)
  steps, components walked and queued: past it the download stops, ``FileTooLarge`` (a
  link alone may take ``LINK_STEPS``, and 100,000 of them minutes of CPU).
* **Bounded writes.** A hard link stays a hard link, to a file this download created: a
  thousand names of one file cost one copy. ``max_bytes`` caps the file contents (apparent
  sizes) and what the entries take on disk besides: each its name and ``ENTRY_COST`` (a
  file, a link with its target, a further name), or ``FOLDER_COST`` (a folder, made by a
  member or implied by a name); ``max_entries`` caps the entries. Past either the download
  stops, ``FileTooLarge``.
* **Sparse stays sparse.** Aligned 64 KiB runs of zeros in a file's data (``HOLE``) are
  left holes, not written: a sandbox's sparse file, whose holes come as zeros, takes no more
  of the host's disk than its data. ``max_bytes`` counts apparent sizes all the same.
* **Bounded memory.** File data goes straight to disk; one header at a time is held (an
  extended header at most 16 KiB), and the model keeps one small node per entry.
* **All or nothing.** Members are unpacked into a hidden folder inside ``dest``
  (``.stockade-download-*``), then moved into place; an entry of ``dest`` that the download
  replaces is set aside until the end. On any failure (a cap, a refused member, a malformed
  archive, a sandbox that dies mid-way) the moves are undone, what was set aside comes
  back, and the hidden folder is removed, as is ``dest`` itself when the download made it.
* FIFOs, sockets, devices, links out and names that changed kind while the sandbox archived
  them are skipped and reported in the result; setuid, setgid,
  sticky and group/other write bits are dropped.

A folder of the download never replaces a folder of ``dest``: the two are merged. A file
where ``dest`` has a folder, and a folder where ``dest`` has a symlink, are refused.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import secrets
import shutil
import stat
import tarfile
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from stockade import exceptions as exc
from stockade.sandbox._tar import NO_DATA, Member, TarReader, malformed
from stockade.sandbox.ops import DOWNLOAD_MAX_BYTES, DOWNLOAD_MAX_ENTRIES
from stockade.types import DownloadResult, SkippedEntry

__all__ = ["Extraction", "Inflated", "extract_archive"]

MAX_NAME = 4096  # bytes of a member's name or link target
MAX_COMPONENT = 255  # bytes of one name in it, as on every Linux filesystem
MAX_LINK_BYTES = 32 * 1024 * 1024  # link targets of one download together: held until the end
MAX_DEPTH = 128  # folders in a member's name
LINK_HOPS = 40  # links followed to resolve one link, as the kernel allows
LINK_STEPS = 512  # path components walked to resolve one link, links expanded
LINK_WORK = 8_000_000  # steps of one pass over a download's links (about a second of CPU)
FOLDER_COST = 4096  # bytes a folder takes on disk besides its name (one block)
ENTRY_COST = 256  # bytes a file or link takes on disk besides its name (an inode)
HOLE = 64 * 1024  # an aligned run of zeros this long is left a hole, not written
_ZEROS = bytes(HOLE)
MAX_REPORTED = 1000  # skipped entries listed in the result (all are counted)
STAGE_PREFIX = ".stockade-download-"

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
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
Parts = tuple[str, ...]
H = TypeVar("H")
T = TypeVar("T")


# -- the model of the tree ---------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Node:
    kind: str  # "dir", "file" or "link"
    mode: int = 0o700  # a folder's final mode
    target: str = ""  # a link's target
    inode: tuple[int, int] = (0, 0)  # a file's (st_dev, st_ino) as created here
    hard: bool = False  # a file made as a further name of another
    children: dict[str, _Node] | None = None

    @classmethod
    def folder(cls, mode: int = 0o700) -> _Node:
        return cls("dir", mode=mode, children={})


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


def _components(target: str) -> list[str]:
    return [p for p in target.split("/") if p not in ("", ".")]


Child = Callable[[H | None, str], tuple[str, str, H | None]]


@dataclass(slots=True)
class _Meter:
    """The work of one pass over a download's links: each component walked or queued, each
    folder looked up. A link costs at most ``LINK_STEPS`` steps (and ``LINK_HOPS`` targets
    queued), so without a bound of its own 100,000 links of a download cost minutes."""

    limit: int
    dest: str
    used: int = 0

    def charge(self, n: int = 1) -> None:
        self.used += n
        if self.used > self.limit:
            raise exc.FileTooLarge(
                f"checking the links of the download into {self.dest!r} takes more than "
                f"{self.limit} steps (links through links, long targets, deep folders)",
                path=self.dest,
            )


def _starts(
    links: list[tuple[Parts, _Node]], root: H, descend: Callable[[H | None, str], H | None], meter: _Meter
) -> Iterator[tuple[Parts, _Node, list[H | None]]]:
    """Each link with the handles of its folder's chain, root first. Links come in walk
    order: the chain is kept from one to the next and only what changes is looked up, once
    per folder (rebuilt per link, it cost depth squared: minutes for 20,000 links 127 deep)."""
    parts_now: Parts = ()
    chain: list[H | None] = [root]
    for parts, node in links:
        folder = parts[:-1]
        if folder != parts_now:
            keep = 0
            while keep < min(len(folder), len(parts_now)) and folder[keep] == parts_now[keep]:
                keep += 1
            del chain[keep + 1 :]
            for name in folder[keep:]:
                meter.charge()
                chain.append(descend(chain[-1], name))
            parts_now = folder
        yield parts, node, chain


def _leaves(start: list[H | None], target: str, child: Child[H], meter: _Meter) -> str | None:
    """Why a link in the folder ``start`` (handles from the root down) to ``target`` would
    leave the root, or None when every step of its resolution stays inside.

    ``child(folder, name)`` says what ``name`` is: ``("dir", "", handle)``, ``("link",
    target, None)``, ``("file", "", None)`` or ``("missing", "", None)``; a missing name is
    taken as a folder, so that the answer holds whatever is made there later.
    """
    if target.startswith("/"):
        return "is absolute"
    why = _up_through_folders(start, target, child, meter)
    if why is not None:
        return why
    here = list(start)
    queue = deque(_components(target))
    steps = hops = 0
    while queue:
        steps += 1
        meter.charge()
        if steps > LINK_STEPS:
            return f"takes more than {LINK_STEPS} steps to resolve"
        part = queue.popleft()
        if part == "..":
            if len(here) == 1:
                return "leads out of the folder"
            here.pop()
            continue
        kind, link, handle = child(here[-1], part)
        if kind == "link":
            hops += 1
            if hops > LINK_HOPS:
                return f"goes through more than {LINK_HOPS} links"
            if link.startswith("/"):
                return f"goes through {part!r}, a link to the absolute path {link!r}"
            more = _components(link)
            meter.charge(len(more))
            queue.extendleft(reversed(more))
        elif kind == "file" and queue:
            return f"goes through {part!r}, which is not a folder"
        else:
            here.append(handle)
    return None


def _up_through_folders(start: list[H | None], target: str, child: Child[H], meter: _Meter) -> str | None:
    """Why the ``..`` of a link's target may lead elsewhere later, or None: each must undo a
    name that is a real folder, reached through real folders. ``x/..`` goes to the parent of
    wherever ``x`` leads when it is followed: a later download, or a link already in ``dest``,
    can make a missing ``x`` (or a link ``x``) a link to ``.``, and two downloads into one
    folder left ``x/../secret`` pointing at the folder's parent. Folders are never replaced
    (``_make_room``), so a ``..`` after folders only stays where this check puts it."""
    here = list(start)
    settled = True  # every name so far a real folder
    for part in _components(target):
        meter.charge()
        if part == "..":
            if not settled:
                return "goes up ('..') after a name that is no folder: it leads wherever that name will"
            if len(here) == 1:
                return "leads out of the folder"
            here.pop()
        elif settled:
            kind, _, handle = child(here[-1], part)
            if kind == "dir":
                here.append(handle)
            else:
                settled = False
    return None


def _model_child(folder: _Node | None, name: str) -> tuple[str, str, _Node | None]:
    node = None if folder is None or folder.children is None else folder.children.get(name)
    if node is None:
        return "missing", "", None
    return node.kind, node.target, node if node.kind == "dir" else None


def _model_folder(folder: _Node | None, name: str) -> _Node | None:
    return _model_child(folder, name)[2]


def _host_folder(folder: str | None, name: str) -> str:
    return f"{folder}/{name}" if folder else name


# -- the extraction ----------------------------------------------------------------------


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


class Extraction:
    """One download into ``dest``: ``feed`` the tar stream as it comes (``sink`` is the same
    as an ``OutputSink``), then ``finish``; ``abort`` (or leaving the ``with`` block
    without finishing) undoes everything. Thread-safe: a worker thread may feed while
    another thread aborts."""

    def __init__(
        self,
        dest: str | os.PathLike[str],
        *,
        max_bytes: int = DOWNLOAD_MAX_BYTES,
        max_entries: int = DOWNLOAD_MAX_ENTRIES,
        links_anywhere: bool = False,
        max_link_steps: int = LINK_WORK,
        count_metadata: bool = True,
        global_comments: bool = False,
    ) -> None:
        """``links_anywhere``: for a folder only a sandbox ever sees (the tmpfs a gVisor
        sandbox is restored on), whose links may point anywhere, as the sandbox's own do.
        They are still created last and never followed while writing. ``max_link_steps``
        bounds each pass of the link check (``LINK_WORK``). ``count_metadata=False``: entries
        cost ``max_bytes`` nothing, for a tmpfs whose own caps bound them.
        ``global_comments``: a global pax header with only a comment (``git archive``'s) is
        skipped, for an upload; a sandbox's tar has none."""
        for name, value in (
            ("max_bytes", max_bytes),
            ("max_entries", max_entries),
            ("max_link_steps", max_link_steps),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise exc.ConfigurationError(f"{name} must be an int >= 0, got {value!r}")
        self.dest = Path(dest)
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.links_anywhere = links_anywhere
        self.max_link_steps = max_link_steps
        self.count_metadata = count_metadata
        self.link_steps = 0  # the link check's work so far, all passes (what max_link_steps caps per pass)
        self.folder_opens = 0  # names opened to reach folders of the tree or dest (for tests)
        self._here: tuple[Parts, int] | None = None  # the folder the last member went to, open
        self._lock = threading.Lock()
        self._reader = TarReader(self._member, self._data, self._end, global_comments=global_comments)
        self._root = _Node.folder()
        self._tally = _Tally()
        self._file: _Open | None = None
        self._made: list[Path] = []  # dest and its parents, when this download made them
        self._journal: list[tuple[Parts, str]] = []  # (path, slot in trash or "" for a move)
        self._done = False
        self._stage = STAGE_PREFIX + secrets.token_hex(8)
        self._dest_fd = self._stage_fd = self._tree_fd = self._trash_fd = -1
        try:
            with self._mapped():
                self._begin()
        except BaseException:
            self._discard()
            raise

    # -- the public side -----------------------------------------------------------------

    def feed(self, data: bytes | memoryview) -> None:
        with self._lock:
            self._guarded(lambda: self._reader.feed(data))

    @property
    def ended(self) -> bool:
        """Whether the archive's end blocks came: what follows is padding, not to be fed."""
        return self._reader.ended

    def sink(self, fd: int, data: bytes) -> None:
        """``feed`` with an ``OutputSink``'s signature: what ``GetArchive`` streams to."""
        self.feed(data)

    def finish(self) -> DownloadResult:
        with self._lock:
            return self._guarded(self._commit)

    def abort(self) -> None:
        with self._lock:
            if not self._done:
                self._discard()

    def __enter__(self) -> Extraction:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc_val: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()

    # -- plumbing ------------------------------------------------------------------------

    def _guarded(self, step: Callable[[], T]) -> T:
        if self._done:
            raise exc.WorkspaceError(
                f"the download into {str(self.dest)!r} is over (finished or undone)", path=str(self.dest)
            )
        try:
            with self._mapped():
                return step()
        except BaseException:
            self._discard()
            raise

    @contextlib.contextmanager
    def _mapped(self) -> Iterator[None]:
        try:
            yield
        except OSError as err:
            where = str(self.dest)
            # its text would repeat a path of up to 4 KiB; what is wrong with it is said instead
            why = (
                "a name in the path is longer than the file system takes"
                if err.errno == errno.ENAMETOOLONG
                else err
            )
            raise exc.WorkspaceError(f"cannot unpack into {where!r}: {why}", path=where) from None

    def _begin(self) -> None:
        missing: list[Path] = []
        probe = self.dest
        while not os.path.lexists(probe) and probe.parent != probe:
            missing.append(probe)
            probe = probe.parent
        for path in reversed(missing):
            try:
                os.mkdir(path)
            except FileExistsError:  # made by someone else meanwhile: not ours to remove
                continue
            self._made.append(path)
        self._dest_fd = os.open(self.dest, _DIR)
        os.mkdir(self._stage, 0o700, dir_fd=self._dest_fd)
        self._stage_fd = os.open(self._stage, _DIR, dir_fd=self._dest_fd)
        for name in ("tree", "trash"):
            os.mkdir(name, 0o700, dir_fd=self._stage_fd)
        self._tree_fd = os.open("tree", _DIR, dir_fd=self._stage_fd)
        self._trash_fd = os.open("trash", _DIR, dir_fd=self._stage_fd)

    def _discard(self) -> None:
        """Undo everything this download did; never raises."""
        self._done = True
        if self._file is not None:
            with contextlib.suppress(OSError):
                os.close(self._file.fd)
            self._file = None
        for path, slot in reversed(self._journal):
            with contextlib.suppress(OSError, exc.StockadeError):
                self._undo(path, slot)
        self._journal.clear()
        if self._dest_fd >= 0:
            with contextlib.suppress(OSError):
                shutil.rmtree(self._stage, dir_fd=self._dest_fd)
        self._close_fds()
        for made in reversed(self._made):
            with contextlib.suppress(OSError):
                os.rmdir(made)
        self._made.clear()

    def _folder_fd(self, parts: Parts) -> int:
        """The tree's folder ``parts``, open and kept for the next member (not to close):
        members come grouped by folder, and reopening every name of a path 127 deep for
        each of 50,000 members cost seconds of CPU. A folder of the tree is never replaced
        or removed before the move (``_make_room``), so the descriptor stays that path's."""
        base, below = self._tree_fd, parts
        if self._here is not None:
            held, held_fd = self._here
            if held == parts:
                return held_fd
            if held == parts[: len(held)]:  # a folder below it: open only what is new
                base, below = held_fd, parts[len(held) :]
        fd = self._open(base, below)
        self._drop_folder_fd()
        self._here = (parts, fd)
        return fd

    def _drop_folder_fd(self) -> None:
        here, self._here = self._here, None
        if here is not None:
            with contextlib.suppress(OSError):
                os.close(here[1])

    def _close_fds(self) -> None:
        self._drop_folder_fd()
        for fd in (self._trash_fd, self._tree_fd, self._stage_fd, self._dest_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._dest_fd = self._stage_fd = self._tree_fd = self._trash_fd = -1

    def _open(self, base: int, parts: Parts) -> int:
        """A real folder under ``base``, reached without following any link."""
        fd = os.dup(base)
        try:
            for part in parts:
                self.folder_opens += 1
                sub = os.open(part, _DIR, dir_fd=fd)
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- members, as they come -----------------------------------------------------------

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

    # -- the end: links, modes, moving into place ----------------------------------------

    def _commit(self) -> DownloadResult:
        self._reader.close()
        links, folders = self._walk()
        if not self.links_anywhere:
            links = self._links_inside(links)
        for parts, node in links:
            os.symlink(node.target, parts[-1], dir_fd=self._folder_fd(parts[:-1]))
        self._drop_folder_fd()  # the tree moves into dest below
        for parts, node in reversed(folders):  # deepest first: a mode never locks us out
            fd = self._open(self._tree_fd, parts)
            try:
                os.fchmod(fd, node.mode)
            finally:
                os.close(fd)
        self._move(self._plan())
        if not self.links_anywhere:
            self._check_on_host(links)
        self._journal.clear()  # from here on, the download stands
        self._made.clear()
        self._done = True
        try:
            shutil.rmtree(self._stage, dir_fd=self._dest_fd)
        finally:
            self._close_fds()
        tally = self._tally
        files = [n for _, n in self._walk_all() if n.kind == "file"]
        return DownloadResult(
            dest=str(self.dest),
            bytes_written=tally.written,
            files=len(files),
            directories=len(folders),
            symlinks=len(links),
            hard_links=sum(1 for n in files if n.hard),
            skipped=tuple(tally.skipped),
            skipped_count=tally.skipped_count,
        )

    def _walk_all(self) -> Iterator[tuple[Parts, _Node]]:
        pending: list[tuple[Parts, _Node]] = [((), self._root)]
        while pending:
            parts, node = pending.pop()
            for name, child in sorted((node.children or {}).items(), reverse=True):
                yield (*parts, name), child
                if child.kind == "dir":
                    pending.append(((*parts, name), child))

    def _walk(self) -> tuple[list[tuple[Parts, _Node]], list[tuple[Parts, _Node]]]:
        links: list[tuple[Parts, _Node]] = []
        folders: list[tuple[Parts, _Node]] = []
        for parts, node in self._walk_all():
            if node.kind == "link":
                links.append((parts, node))
            elif node.kind == "dir":
                folders.append((parts, node))
        folders.sort(key=lambda item: len(item[0]))
        return links, folders

    def _links_inside(self, links: list[tuple[Parts, _Node]]) -> list[tuple[Parts, _Node]]:
        """The links that stay inside ``dest`` by every route; the others are left out (and
        reported as ``"link out"``): one link made by the code must not block the download
        of everything else. A route through a link that leads out leads out with it, so the
        links kept resolve as before; they are resolved again all the same (refused if not)."""
        out = self._leaving(links)
        for parts, _node, _why in out:
            parent = self._lookup(parts[:-1])
            if parent is not None and parent.children is not None:
                parent.children.pop(parts[-1], None)
            self._skip("/".join(parts), "link out")
        gone = {id(node) for _, node, _ in out}
        kept = [(parts, node) for parts, node in links if id(node) not in gone]
        for parts, node, why in self._leaving(kept) if out else []:
            raise self._link_out(parts, node.target, why)
        return kept

    def _leaving(self, links: list[tuple[Parts, _Node]]) -> list[tuple[Parts, _Node, str]]:
        """The links of the model that leave ``dest`` by some route, and why."""
        out: list[tuple[Parts, _Node, str]] = []
        with self._metered() as meter:
            for parts, node, start in _starts(links, self._root, _model_folder, meter):
                why = _leaves(start, node.target, _model_child, meter)
                if why is not None:
                    out.append((parts, node, why))
        return out

    @contextlib.contextmanager
    def _metered(self) -> Iterator[_Meter]:
        meter = _Meter(limit=self.max_link_steps, dest=str(self.dest))
        try:
            yield meter
        finally:
            self.link_steps += meter.used

    def _link_out(self, parts: Parts, target: str, why: str) -> exc.PathEscapeError:
        path = "/".join(parts)
        return exc.PathEscapeError(f"{path!r} is a link out of the folder ({target!r} {why})", path=path)

    def _plan(self) -> list[tuple[Parts, bool]]:
        """What to move into ``dest``: (path, replaces an entry of dest). Refuses conflicts
        before anything moves."""
        plan: list[tuple[Parts, bool]] = []
        pending: list[Parts] = [()]
        while pending:
            prefix = pending.pop()
            src = self._open(self._tree_fd, prefix)
            try:
                dst = self._open(self._dest_fd, prefix)
                try:
                    for name in sorted(os.listdir(src)):
                        path = (*prefix, name)
                        mine = os.stat(name, dir_fd=src, follow_symlinks=False).st_mode
                        try:
                            theirs = os.stat(name, dir_fd=dst, follow_symlinks=False).st_mode
                        except FileNotFoundError:
                            plan.append((path, False))
                            continue
                        shown = "/".join(path)
                        if stat.S_ISDIR(mine) and stat.S_ISDIR(theirs):
                            pending.append(path)
                        elif stat.S_ISDIR(theirs):
                            message = (
                                f"{shown!r} is a folder in {str(self.dest)!r}; the download has a file there"
                            )
                            raise exc.FileTypeError(message, path=shown)
                        elif stat.S_ISLNK(theirs) and stat.S_ISDIR(mine):
                            message = (
                                f"{shown!r} is a link in {str(self.dest)!r}; the download has a folder there"
                            )
                            raise exc.PathEscapeError(message, path=shown)
                        else:
                            plan.append((path, True))
                finally:
                    os.close(dst)
            finally:
                os.close(src)
        return plan

    def _move(self, plan: list[tuple[Parts, bool]]) -> None:
        for path, replaces in plan:
            src = self._open(self._tree_fd, path[:-1])
            try:
                dst = self._open(self._dest_fd, path[:-1])
                try:
                    if replaces:
                        slot = str(len(self._journal))
                        os.rename(path[-1], slot, src_dir_fd=dst, dst_dir_fd=self._trash_fd)
                        self._journal.append((path, slot))
                    os.rename(path[-1], path[-1], src_dir_fd=src, dst_dir_fd=dst)
                    self._journal.append((path, ""))
                finally:
                    os.close(dst)
            finally:
                os.close(src)

    def _undo(self, path: Parts, slot: str) -> None:
        dst = self._open(self._dest_fd, path[:-1])
        try:
            if slot:
                os.rename(slot, path[-1], src_dir_fd=self._trash_fd, dst_dir_fd=dst)
                return
            src = self._open(self._tree_fd, path[:-1])
            try:
                os.rename(path[-1], path[-1], src_dir_fd=dst, dst_dir_fd=src)
            finally:
                os.close(src)
        finally:
            os.close(dst)

    def _check_on_host(self, links: list[tuple[Parts, _Node]]) -> None:
        """Resolve every new link again on the real tree: links already in dest count too.
        A folder is its path from ``dest`` ("" for dest itself)."""
        seen: dict[str, tuple[str, str, str | None]] = {}

        def child(folder: str | None, name: str) -> tuple[str, str, str | None]:
            if folder is None:
                return "missing", "", None
            key = _host_folder(folder, name)
            known = seen.get(key)
            if known is None:
                known = seen[key] = self._host_entry(key)
            return known

        with self._metered() as meter:
            for parts, node, start in _starts(links, "", _host_folder, meter):
                why = _leaves(start, node.target, child, meter)
                if why is not None:
                    raise self._link_out(parts, node.target, why)

    def _host_entry(self, key: str) -> tuple[str, str, str | None]:
        # Every folder on ``key`` was seen as a real folder by lstat just before (nothing
        # else writes to dest meanwhile), so the kernel follows no link to reach the last name.
        try:
            mode = os.stat(key, dir_fd=self._dest_fd, follow_symlinks=False).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return "missing", "", None
        if stat.S_ISDIR(mode):
            return "dir", "", key
        if stat.S_ISLNK(mode):
            return "link", os.readlink(key, dir_fd=self._dest_fd), None
        return "file", "", None


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _dir_mode(mode: int) -> int:
    return (mode & 0o755) | 0o700


def extract_archive(
    data: bytes,
    dest: str | os.PathLike[str],
    *,
    max_bytes: int = DOWNLOAD_MAX_BYTES,
    max_entries: int = DOWNLOAD_MAX_ENTRIES,
) -> DownloadResult:
    """Unpack a whole archive held in memory; see ``Extraction``."""
    with Extraction(dest, max_bytes=max_bytes, max_entries=max_entries) as unpack:
        unpack.feed(data)
        return unpack.finish()


class Inflated:
    """A gzipped tar (a run's artifacts, a seed; a plain tar is taken too) into ``feed``
    (``Extraction.feed``) as it arrives, a bounded piece at a time: a few hundred KiB of gzip
    that inflate to a gigabyte stop at the extraction's ``max_bytes``, never held in memory."""

    PIECE = 1 << 20

    def __init__(self, feed: Callable[[bytes], None]) -> None:
        self._feed = feed
        self._head = b""
        self._inflate: Any = None  # zlib's decompressor, once the stream is known to be gzip
        self._plain = False

    def feed(self, data: bytes) -> None:
        if not self._plain and self._inflate is None:
            self._head += data
            if len(self._head) < 2:
                return
            data, self._head = self._head, b""
            if data[:2] == b"\x1f\x8b":
                self._inflate = zlib.decompressobj(wbits=31)
            else:
                self._plain = True
        if self._inflate is None:
            self._feed(data)
            return
        try:
            while data:
                if self._inflate.eof:
                    raise malformed("data past the end of the gzip stream")
                out = self._inflate.decompress(data, self.PIECE)
                if out:
                    self._feed(out)
                data = self._inflate.unconsumed_tail or self._inflate.unused_data
        except zlib.error as error:
            raise malformed(f"a broken gzip stream ({error})") from None

    def finish(self) -> None:
        if self._head:
            self._feed(self._head)
        if self._inflate is not None:
            try:
                rest = self._inflate.flush()  # what zlib held back: less than its window
            except zlib.error as error:
                raise malformed(f"a broken gzip stream ({error})") from None
            if rest:
                self._feed(rest)
            if not self._inflate.eof:
                raise malformed("the gzip stream is cut short")
