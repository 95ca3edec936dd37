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

``Extraction`` is made of parts, each in a module of its own: the hidden folder and the moves
into place (``_archive_stage``), the members as they come (``_archive_members``), where a
link leads (``_archive_links``); it adds the lock, the reader and the end. ``Inflated``
(``_archive_gzip``) feeds it a gzipped stream.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TypeVar

from stockade import exceptions as exc
from stockade.sandbox._archive_gzip import Inflated
from stockade.sandbox._archive_links import (
    LINK_WORK,
    Parts,
    _host_folder,
    _leaves,
    _Meter,
    _model_child,
    _model_folder,
    _Node,
    _starts,
)
from stockade.sandbox._archive_members import ExtractionMembers
from stockade.sandbox._tar import TarReader
from stockade.sandbox.ops import DOWNLOAD_MAX_BYTES, DOWNLOAD_MAX_ENTRIES
from stockade.types import DownloadResult

__all__ = ["Extraction", "Inflated", "extract_archive"]

T = TypeVar("T")


class Extraction(ExtractionMembers):
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
        super().__init__(
            dest,
            max_bytes=max_bytes,
            max_entries=max_entries,
            links_anywhere=links_anywhere,
            count_metadata=count_metadata,
        )
        self.max_link_steps = max_link_steps
        self.link_steps = 0  # the link check's work so far, all passes (what max_link_steps caps per pass)
        self._lock = threading.Lock()
        self._reader = TarReader(self._member, self._data, self._end, global_comments=global_comments)
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
