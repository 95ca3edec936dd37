"""The workspace's entries as the files API lists them (``EntryInfo``, ``EntryType``,
``Listing``) and what a folder's download brought to the host (``DownloadResult``,
``SkippedEntry``).

Apart because these describe files, not the code that ran.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class EntryType(enum.StrEnum):
    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"
    OTHER = "other"  # FIFO, socket, device: never opened by the files API


@dataclass(frozen=True, kw_only=True)
class EntryInfo:
    """One entry of the workspace. ``path`` is relative to the workspace root."""

    path: str
    name: str
    type: EntryType
    size: int
    mode: int
    mtime: float
    # Its status change time and inode number, where the tier says (0: not known). Code can set
    # mtime back (utime), never ctime: a write, a utime, a chmod or a rename moves it to now.
    ctime_ns: int = 0
    inode: int = 0
    # Its name (or a folder's it is in) is not UTF-8: ``path`` shows those bytes as U+FFFD, so
    # no files call can name it. Diffs and the run store name it as left out, not dropped.
    lossy: bool = False


class Listing(list[EntryInfo]):
    """``files.list``'s entries. ``truncated``: the listing stopped at its cap (100,000 entries)
    and the folder holds more; list a folder inside it, or to a smaller depth, to see them."""

    def __init__(self, entries: Iterable[EntryInfo] = (), *, truncated: bool = False) -> None:
        super().__init__(entries)
        self.truncated = truncated

    def __repr__(self) -> str:
        return f"Listing({super().__repr__()}, truncated={self.truncated})"


@dataclass(frozen=True, kw_only=True)
class SkippedEntry:
    """An entry ``files.download_dir`` did not bring to the host: a FIFO, socket or device,
    a symlink that would lead out of the folder, or a folder past the depth a download takes.

    ``kind`` is ``"fifo"``, ``"socket"``, ``"char device"``, ``"block device"``, ``"link out"``,
    ``"too deep"`` (a folder 128 deep: it and all in it were left out) or ``"other"``;
    ``path`` is relative to the downloaded folder.
    """

    path: str
    kind: str


@dataclass(frozen=True, kw_only=True)
class DownloadResult:
    """What one ``files.download_dir`` wrote under ``dest`` on the host.

    ``bytes_written`` counts file contents (a hard-linked file once, as it is stored);
    ``files`` counts regular files, of which ``hard_links`` are further names of a file of
    the same download; ``skipped`` lists what was left out (special files, links out), the
    first thousand of them; ``skipped_count`` counts them all.
    """

    dest: str
    bytes_written: int = 0
    files: int = 0
    directories: int = 0
    symlinks: int = 0
    hard_links: int = 0
    skipped: tuple[SkippedEntry, ...] = ()
    skipped_count: int = 0
