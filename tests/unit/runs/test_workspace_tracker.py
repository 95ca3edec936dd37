"""What the run store's tracker trusts without reading: a file's status, by its ctime."""

from __future__ import annotations

from stockade.runs.workspace import Entry, WorkspaceTracker
from stockade.types import EntryInfo, EntryType

OLD_MTIME = 946_684_800.0  # what code can set a file's mtime back to (os.utime)


def info(path: str, *, ctime_ns: int, mtime: float = OLD_MTIME, inode: int = 7) -> EntryInfo:
    return EntryInfo(
        path=path, name=path, type=EntryType.FILE, size=4, mode=0o644, mtime=mtime, ctime_ns=ctime_ns,
        inode=inode,
    )  # fmt: skip


def tracker(*listing: EntryInfo) -> WorkspaceTracker:
    kept = WorkspaceTracker()
    kept.restored(
        {e.path: Entry(kind="file", mode=0o644, digest="aaaa", size=4) for e in listing},
        1,
        listing,
        kept_bytes=0,
    )
    return kept


def test_a_rewrite_with_its_old_mtime_put_back_is_read_again() -> None:
    # size, mode and mtime alike: trusted on mtime, "EVIL" kept the digest of "AAAA"
    kept = tracker(info("a.txt", ctime_ns=100), info("b.txt", ctime_ns=200, mtime=2e9))
    assert kept._unchanged(info("a.txt", ctime_ns=100))
    assert not kept._unchanged(info("a.txt", ctime_ns=300))
    assert not kept._unchanged(info("a.txt", ctime_ns=100, inode=8))  # another file renamed over it


def test_a_file_changed_in_the_listings_last_tick_or_of_unknown_ctime_is_read_again() -> None:
    assert not tracker(info("a.txt", ctime_ns=200), info("b.txt", ctime_ns=200))._unchanged(
        info("a.txt", ctime_ns=200)
    )
    assert not tracker(info("a.txt", ctime_ns=0), info("b.txt", ctime_ns=0))._unchanged(
        info("a.txt", ctime_ns=0)
    )
