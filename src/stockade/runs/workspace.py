"""A run's workspace, kept step by step so that a resumed run continues from it.

After each tool call the loop asks the run store to record the workspace. ``WorkspaceTracker``
lists it (one request), compares each entry with the last listing (size, mode, mtime, ctime,
inode) and reads only the files that may have changed (a request each; many of them, when the
files that did not change are few, in one archive of the workspace, spooled on the host);
their contents are named by SHA-256, and what is written is only what changed: a blob per
content the store does not have yet, and a row per path that changed or went away. A resume
folds the rows back into the last recorded state and ``restore`` makes a fresh sandbox's
workspace exactly that, the diff's baseline (``.stockade/baseline.json``) included.

An unchanged entry is trusted by its ctime, which code cannot set: every write, utime, chmod
or rename moves it to the kernel's now. mtime is the code's to set (``os.utime``): trusted on
it, a file rewritten at the same size with its old mtime put back kept its old content in the
store, and a resume restored that. A file is trusted only when its ctime is older than the
newest ctime of the listing it was seen in (git's "racily clean" rule; no ctime is later than
the listing): times advance in clock ticks of a few milliseconds, so a file changed within the
tick of a listing is read again next time rather than trusted. A tier that does not say a
file's ctime (0) has every file read each time.

Kept: regular files (content and permission bits) and folders. A file or folder whose name is
not UTF-8 (``EntryInfo.lossy``) cannot be read or named by any files call: it is recorded as
``unnamed`` (its name shown with U+FFFD, no content), never restored, and named as left out by
``stockade runs workspace``. Not kept: symlinks, FIFOs,
sockets and devices, owners and times, and everything that is not a file: processes, the
``run_code`` interpreter's variables, ``/tmp``. A resumed run starts a new interpreter, unless
it resumes from a snapshot of its sandbox (``stockade.runs.snapshots``).

The whole workspace is capped (``max_bytes`` of file content, ``max_entries``): past either,
``SeedTooLarge`` says by how much and how to raise the cap. The bytes cap counts what is read,
not only what the listing said: code still running in the sandbox may grow files in between,
so each read asks for no more than the room left. Each content is compressed as it is read and
its raw bytes dropped, so the host never holds more than about the cap.

That cap is per version: a call that rewrites a file with new content stores it again, and
the versions of one run add up. What one run has added to the store (compressed, all its
versions) is capped too (``max_run_bytes``): a version that would pass it is
``RunHistoryFull``, found as its contents are read.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from stockade import exceptions as exc
from stockade.sandbox._archive_members import MAX_DEPTH
from stockade.sandbox.facade import Sandbox
from stockade.sandbox.ops import GetArchive, PutArchive, ReadFile
from stockade.types import EntryInfo, EntryType

__all__ = [
    "MAX_RUN_BYTES",
    "MAX_WORKSPACE_BYTES",
    "MAX_WORKSPACE_ENTRIES",
    "Entry",
    "Packed",
    "Scan",
    "WorkspaceTracker",
    "decode_entry",
    "relative_path",
    "restore",
]

MAX_WORKSPACE_BYTES = 256 * 1024 * 1024  # of file content, uncompressed
MAX_WORKSPACE_ENTRIES = 50_000
# what one run's versions add to the store, compressed: four whole workspaces of new content
MAX_RUN_BYTES = 4 * MAX_WORKSPACE_BYTES
_BATCH_BYTES = 8 * 1024 * 1024  # what one archive sent to the sandbox holds at most
_ARCHIVE_FROM = 64  # files to read past which they come in one archive, not a request each


@dataclass(frozen=True)
class Entry:
    """One path of a recorded workspace: a file (its content's digest) or a folder."""

    kind: str  # "file", "dir", or "unnamed" (a name not UTF-8: listed, not kept)
    mode: int
    digest: str = ""
    size: int = 0

    def encode(self) -> str:
        return json.dumps([self.kind, self.mode, self.digest, self.size], separators=(",", ":"))


def decode_entry(text: str) -> Entry:
    """The entry a stored row holds; ``ValueError`` when it is not one."""
    kind, mode, digest, size = json.loads(text)
    if kind not in ("file", "dir", "unnamed") or not isinstance(mode, int) or not isinstance(size, int):
        raise ValueError(f"not a workspace entry: {text[:80]!r}")
    return Entry(kind=str(kind), mode=mode, digest=str(digest), size=size)


@dataclass(frozen=True)
class Packed:
    """A content as the store keeps it: zlib-compressed, and its size before."""

    size: int
    data: bytes


@dataclass(frozen=True, kw_only=True)
class Scan:
    """What changed since the last recorded state: ``changes`` (path -> entry, None: gone)
    and the contents not recorded before (digest -> compressed)."""

    changes: dict[str, Entry | None]
    blobs: dict[str, Packed]
    listing: tuple[EntryInfo, ...]
    total_bytes: int

    @property
    def changed(self) -> bool:
        return bool(self.changes)

    @property
    def added_bytes(self) -> int:
        """What storing it adds to the run's total (compressed)."""
        return sum(len(p.data) for p in self.blobs.values())


def relative_path(path: str) -> bool:
    """Whether a stored path stays in the workspace (relative, no ``..``)."""
    return bool(path) and not path.startswith("/") and ".." not in path.split("/")


@dataclass
class WorkspaceTracker:
    """The last recorded state of one run's workspace, and how to see what changed since."""

    max_bytes: int = MAX_WORKSPACE_BYTES
    max_entries: int = MAX_WORKSPACE_ENTRIES
    max_run_bytes: int = MAX_RUN_BYTES
    entries: dict[str, Entry] = field(default_factory=dict)
    version: int = 0
    kept_bytes: int = 0  # what the run's recorded versions added to the store (compressed)
    # size, mode, mtime, ctime, inode
    _seen: dict[str, tuple[int, int, float, int, int]] = field(default_factory=dict)
    _horizon: int = 0  # the newest ctime of the last listing (ns)

    def scan(self, sandbox: Sandbox, *, known: Callable[[str], bool] = lambda _: False) -> Scan:
        """List the workspace and read what may have changed; nothing is recorded yet
        (``commit`` once the store has it). ``known(digest)``: the store has that content."""
        found = sandbox.files.list("", depth=MAX_DEPTH + 1)
        deep = next((e.path for e in found if e.path.count("/") >= MAX_DEPTH), None)
        if deep is not None:  # a resume would come back without it
            raise exc.SeedTooLarge(
                f"the workspace holds {deep[:200]!r}..., more than {MAX_DEPTH} folders deep, past what "
                "the run store keeps: keep such trees out of the workspace"
            )
        listing = tuple(
            e for e in found if relative_path(e.path) and e.type in (EntryType.FILE, EntryType.DIR)
        )
        if found.truncated:  # the listing stopped at its cap: a snapshot would miss the rest
            raise exc.SeedTooLarge(
                f"the workspace holds over {len(found):,} entries, more than one listing carries: "
                "keep build output and dependencies out of the workspace"
            )
        if len(listing) > self.max_entries:
            raise exc.SeedTooLarge(
                f"the workspace holds {len(listing):,} files and folders, over the run store's "
                f"snapshot cap of {self.max_entries:,}: raise it (RunStore(max_workspace_entries=...)), "
                "or keep build output and dependencies out of the workspace"
            )
        total = sum(e.size for e in listing if e.type == EntryType.FILE)
        if total > self.max_bytes:
            raise self.too_large(total)
        # What was listed is checked, but what is read is what counts: code still running in
        # the sandbox (a thread of run_code) can grow a file after the listing, so each read
        # gets only the room the cap leaves and the host holds at most ``max_bytes``.
        to_read = {
            e.path for e in listing if e.type == EntryType.FILE and not e.lossy and not self._unchanged(e)
        }
        charged = sum(e.size for e in listing if e.type == EntryType.FILE and e.path not in to_read)
        with contextlib.closing(self._reader(sandbox, listing, to_read, unchanged=charged)) as read:
            changes, blobs, charged = self._compare(listing, to_read, read, charged=charged, known=known)
        present = {e.path for e in listing}
        for path in self.entries.keys() - present:
            changes[path] = None
        return Scan(changes=changes, blobs=blobs, listing=listing, total_bytes=charged)

    def _compare(
        self,
        listing: tuple[EntryInfo, ...],
        to_read: set[str],
        read: _Reader,
        *,
        charged: int,
        known: Callable[[str], bool],
    ) -> tuple[dict[str, Entry | None], dict[str, Packed], int]:
        """What changed of what is listed, the new contents, and the bytes counted in all."""
        changes: dict[str, Entry | None] = {}
        blobs: dict[str, Packed] = {}
        added = 0
        for info in listing:
            old = self.entries.get(info.path)
            mode = info.mode & 0o7777
            if info.lossy:  # no call can read it: named as left out, never dropped unsaid
                entry = Entry(kind="unnamed", mode=mode)
            elif info.type == EntryType.DIR:
                entry = Entry(kind="dir", mode=mode)
            elif info.path not in to_read:
                continue  # unchanged since a listing that came after its last write
            else:
                data = read(info.path, room=self.max_bytes - charged)
                if data is None:
                    continue  # gone since the listing: it is not in this state
                charged += len(data)
                digest = hashlib.sha256(data).hexdigest()
                entry = Entry(kind="file", mode=mode, digest=digest, size=len(data))
                if digest not in blobs and (old is None or old.digest != digest) and not known(digest):
                    blobs[digest] = packed = self._pack(data, adding=added)
                    added += len(packed.data)
                del data  # compressed now: the host holds one raw file at a time
            if entry != old:
                changes[info.path] = entry
        return changes, blobs, charged

    def _reader(
        self, sandbox: Sandbox, listing: tuple[EntryInfo, ...], to_read: set[str], *, unchanged: int
    ) -> _Reader:
        """How the files to read are read: one request each, or, when they are many and the
        files that did not change are few, one archive of the workspace (a request each cost a
        round trip: 40,000 small files rewritten took 42 s to record, 11 s in one archive)."""
        sizes = sum(e.size for e in listing if e.path in to_read)
        if len(to_read) >= _ARCHIVE_FROM and unchanged <= max(sizes, _BATCH_BYTES):
            return _Archived(self, sandbox, to_read)
        return _Requests(self, sandbox)

    def _unchanged(self, info: EntryInfo) -> bool:
        """Whether a listed file is what was recorded: its status unchanged since a listing
        that came after its last change (its ctime older than that listing's newest)."""
        old = self.entries.get(info.path)
        return (
            old is not None
            and old.kind == "file"
            and info.ctime_ns > 0
            and self._seen.get(info.path) == _status(info)
            and info.ctime_ns < self._horizon
        )

    def read(self, sandbox: Sandbox, path: str, *, room: int) -> bytes | None:
        """The file's content, None when it is gone; ``SeedTooLarge`` when it is over ``room``
        (one byte past it is asked for, to tell "exactly the room" from "more")."""
        try:
            data = sandbox.instance.execute(ReadFile(path=path, max_bytes=max(room, 0) + 1))
        except exc.SandboxFileNotFound:
            return None
        except exc.FileTooLarge as error:
            raise self.too_large(grew=True) from error
        if len(data) > room:
            raise self.too_large(grew=True)
        return data

    def too_large(self, total: int = 0, *, grew: bool = False) -> exc.SeedTooLarge:
        held = (
            f"the workspace's files grew past the run store's snapshot cap of {self.max_bytes:,} "
            "bytes while they were read"
            if grew
            else f"the workspace holds {total:,} bytes of files, over the run store's snapshot cap of "
            f"{self.max_bytes:,}"
        )
        return exc.SeedTooLarge(
            f"{held}: raise it (RunStore(max_workspace_bytes=...)), or keep build output and "
            "dependencies out of the workspace"
        )

    def _pack(self, data: bytes, *, adding: int) -> Packed:
        """``data`` as the store keeps it; ``RunHistoryFull`` when, with the ``adding`` bytes
        this version adds before it, the run's versions would hold more than ``max_run_bytes``."""
        packed = Packed(len(data), zlib.compress(data, 6))
        added = adding + len(packed.data)
        if self.kept_bytes + added > self.max_run_bytes:
            raise exc.RunHistoryFull(
                f"the run's recorded workspaces hold {self.kept_bytes:,} bytes (compressed) in the run "
                f"store and this one adds {added:,} or more, over the store's total per run of "
                f"{self.max_run_bytes:,}: raise it (RunStore(max_run_bytes=...)), or rewrite less in "
                "the workspace (a file rewritten with new content is kept again at every call)"
            )
        return packed

    def commit(self, scan: Scan, version: int) -> None:
        """The store has recorded ``scan`` as ``version``."""
        self.kept_bytes += scan.added_bytes
        for path, entry in scan.changes.items():
            if entry is None:
                self.entries.pop(path, None)
            else:
                self.entries[path] = entry
        self._remember(scan.listing)
        self.version = version

    def restored(
        self, entries: Mapping[str, Entry], version: int, listing: tuple[EntryInfo, ...], *, kept_bytes: int
    ) -> None:
        """The workspace was just made ``entries`` (by ``restore``), now listed as ``listing``;
        the run's versions hold ``kept_bytes`` in the store."""
        self.entries = dict(entries)
        self.version = version
        self.kept_bytes = kept_bytes
        self._remember(listing)

    def _remember(self, listing: tuple[EntryInfo, ...]) -> None:
        self._seen = {e.path: _status(e) for e in listing if e.type == EntryType.FILE}
        self._horizon = max((e.ctime_ns for e in listing), default=0)


def _status(info: EntryInfo) -> tuple[int, int, float, int, int]:
    return info.size, info.mode, info.mtime, info.ctime_ns, info.inode


class _Reader:
    """Reads the files a scan needs: ``reader(path, room=...)`` is the content, None when it
    is gone since the listing; ``SeedTooLarge`` when it is over ``room``."""

    def __call__(self, path: str, *, room: int) -> bytes | None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Requests(_Reader):
    """One ``ReadFile`` per file."""

    def __init__(self, tracker: WorkspaceTracker, sandbox: Sandbox) -> None:
        self.tracker, self.sandbox = tracker, sandbox

    def __call__(self, path: str, *, room: int) -> bytes | None:
        return self.tracker.read(self.sandbox, path, room=room)


class _Archived(_Reader):
    """One archive of the workspace, spooled on the host (to disk past 8 MiB: it may be as
    large as the cap), its members taken as they are asked for."""

    def __init__(self, tracker: WorkspaceTracker, sandbox: Sandbox, wanted: set[str]) -> None:
        self.tracker, self.sandbox = tracker, sandbox
        self.spool = tempfile.SpooledTemporaryFile(max_size=_BATCH_BYTES)  # noqa: SIM115 - closed by close()
        try:
            op = GetArchive(path="", max_bytes=tracker.max_bytes, max_entries=tracker.max_entries + 1)
            whole = sandbox.instance.execute(op, self._spool)
            self.spool.write(whole)  # a backend that does not stream gives it whole
            self.spool.seek(0)
            self.tar = tarfile.open(fileobj=self.spool, mode="r:")  # noqa: SIM115 - closed by close()
            self.members = {m.name: m for m in self.tar.getmembers() if m.name in wanted}
        except exc.FileTooLarge as error:
            self.spool.close()
            raise tracker.too_large(grew=True) from error
        except (exc.ListingTooLarge, tarfile.TarError) as error:
            self.spool.close()
            raise exc.SeedTooLarge(
                f"the workspace could not be read in one archive ({error}): over the run store's "
                f"snapshot cap of {tracker.max_entries:,} entries, or changed while it was read"
            ) from error
        except BaseException:
            self.spool.close()
            raise

    def _spool(self, _fd: int, chunk: bytes) -> None:
        self.spool.write(chunk)

    def __call__(self, path: str, *, room: int) -> bytes | None:
        member = self.members.get(path)
        try:
            source = self.tar.extractfile(member) if member is not None and member.isfile() else None
            data = None if source is None else source.read(max(room, 0) + 1)
        except tarfile.TarError:
            data = None
        if data is None:  # not in the archive as a file (gone, or made since): asked for alone
            return self.tracker.read(self.sandbox, path, room=room)
        if len(data) > room:
            raise self.tracker.too_large(grew=True)
        return data

    def close(self) -> None:
        self.spool.close()


def restore(
    sandbox: Sandbox, entries: Mapping[str, Entry], blob: Callable[[str], bytes]
) -> tuple[EntryInfo, ...]:
    """Make the workspace of ``sandbox`` exactly ``entries`` (contents from ``blob(digest)``);
    returns the listing after it."""
    for top in sandbox.files.list("", depth=1):
        if not top.lossy:  # a name not UTF-8 cannot be named to remove it: it stays
            sandbox.files.remove(top.path)
    batch: list[tuple[tarfile.TarInfo, bytes | None]] = []
    size = 0
    for path in sorted(p for p in entries if relative_path(p)):
        entry = entries[path]
        if entry.kind == "unnamed":
            continue  # its name was lost: it cannot be made again
        info = tarfile.TarInfo(path)
        info.mode = entry.mode & 0o777
        if entry.kind == "dir":
            info.type = tarfile.DIRTYPE
            info.mode |= 0o700  # the restore writes into it
            batch.append((info, None))
            continue
        data = blob(entry.digest)
        if len(data) > _BATCH_BYTES:  # alone, in chunks: a frame to the sandbox is bounded
            sandbox.files.write(path, data, mode=entry.mode & 0o777)
            continue
        info.size = len(data)
        batch.append((info, data))
        size += len(data)
        if size >= _BATCH_BYTES:
            _put(sandbox, batch)
            batch, size = [], 0
    _put(sandbox, batch)
    return tuple(sandbox.files.list("", depth=MAX_DEPTH))


def _put(sandbox: Sandbox, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> None:
    if not members:
        return
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    sandbox.instance.execute(PutArchive(path="", data=buffer.getvalue()))
