"""The hidden folder a download is unpacked into, and the moves that put it in place: the
all-or-nothing side of ``Extraction``.

A part of ``Extraction``. Members are unpacked into ``.stockade-download-*`` inside ``dest``,
its folders reached from a descriptor with ``openat`` and ``O_NOFOLLOW`` (``_open``), then
moved into ``dest`` by a plan that refuses conflicts before anything moves; each move, and
each entry of ``dest`` set aside, is journaled so that ``_discard`` undoes them all.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from pathlib import Path

from stockade import exceptions as exc
from stockade.sandbox._archive_links import Parts

__all__ = ["STAGE_PREFIX", "ExtractionStage"]

STAGE_PREFIX = ".stockade-download-"

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ExtractionStage:
    """The stage of one download into ``dest``: made by ``_begin``, moved into place by
    ``_move(_plan())``, undone by ``_discard``."""

    def __init__(self, dest: str | os.PathLike[str]) -> None:
        self.dest = Path(dest)
        self.folder_opens = 0  # names opened to reach folders of the tree or dest (for tests)
        self._here: tuple[Parts, int] | None = None  # the folder the last member went to, open
        self._made: list[Path] = []  # dest and its parents, when this download made them
        self._journal: list[tuple[Parts, str]] = []  # (path, slot in trash or "" for a move)
        self._done = False
        self._stage = STAGE_PREFIX + secrets.token_hex(8)
        self._dest_fd = self._stage_fd = self._tree_fd = self._trash_fd = -1

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
