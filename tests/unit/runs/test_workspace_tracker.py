"""What the run store's tracker trusts without reading: a file's status, by its ctime."""

from __future__ import annotations

import hashlib
import zlib
from collections import Counter
from typing import Any

from stockade import Sandbox
from stockade.runs.workspace import Entry, WorkspaceTracker
from stockade.sandbox.base import OpResult
from stockade.sandbox.ops import Op
from stockade.testing import FakeBackend, MemoryWorkspace
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


class Counting(MemoryWorkspace):
    """A workspace that counts the requests of each kind it answers."""

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(files=files)
        self.asked: Counter[str] = Counter()

    def __call__(self, op: Op[Any]) -> OpResult:
        self.asked[type(op).__name__] += 1
        return super().__call__(op)


def test_many_changed_files_are_read_in_one_archive_and_few_one_by_one() -> None:
    # A call that rewrote 40,000 small files cost the host a request each to record: ~2 ms
    # of round trip and host time per file, over a minute in all.
    many = {f"d/f{i}.txt": f"{i}\n".encode() for i in range(500)}
    workspace = Counting(many)
    with Sandbox.create(backend=FakeBackend(workspace)) as sbx:
        scan = WorkspaceTracker().scan(sbx)
        assert workspace.asked["GetArchive"] == 1 and workspace.asked["ReadFile"] == 0
        assert len(scan.blobs) == 500 and scan.total_bytes == sum(map(len, many.values()))
        assert all(
            (e := scan.changes[p]) is not None and e.digest == hashlib.sha256(data).hexdigest()
            for p, data in many.items()
        )
        assert zlib.decompress(scan.blobs[hashlib.sha256(b"7\n").hexdigest()].data) == b"7\n"
    few = Counting({"a.txt": b"a", "b.txt": b"b"})
    with Sandbox.create(backend=FakeBackend(few)) as sbx:
        assert len(WorkspaceTracker().scan(sbx).blobs) == 2
        assert few.asked["GetArchive"] == 0 and few.asked["ReadFile"] == 2
