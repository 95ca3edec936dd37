"""Room and collection: the store's limit (``max_bytes``), held by each snapshot being
written before a byte is, and what is removed once nothing keeps it.

A part of ``SnapshotStore``. Room is reserved under the store's lock, in any process sharing
the folder; writers that together do not fit give way youngest first; boot images are evicted
first. ``collect`` removes only the names the store writes, in a folder ``recognised`` as a
store; ``discard`` and ``reading`` remove or keep objects now, while restores read them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from stockade import exceptions as exc
from stockade._checks import MAX_TIMEOUT_S, check_instance, check_number, check_text
from stockade.sandbox._snapshot_content import Manifest, SnapshotContent
from stockade.sandbox._snapshot_files import (
    _DIGEST,
    _MANIFEST_NAME,
    _NAME,
    ID_HEX,
    ID_PREFIX,
    MAX_BYTES,
    REF_KINDS,
    MiB,
    _disk_size,
    _entries,
    _is_folder,
    _snapshot_id,
    _writer_gone,
)
from stockade.sandbox._snapshot_refs import CLAIMED
from stockade.types import Snapshot

# Unreferenced files younger than this are being written by someone: collect leaves them.
GRACE_S = 120.0
CLAIM_STALE_S = 24 * 3600.0  # a claim this old is a resume that died: its ref is put back
# A file's time is the kernel's clock tick, which may read a little behind time.time() read
# before: an object written since a writer began may seem this much older than its start.
WRITER_SLACK_S = 1.0
# A reservation grows to a multiple of this (when there is room): little held unused.
RESERVE_STEP = MiB
# How long a writer short of room waits for younger writers to give theirs up.
WAIT_S = 30.0
# What the store writes, and all that collection removes: a ``temp_path`` (and a boot image's
# lock beside them) in tmp/, objects and their stamps (being written: ``.<hex>-<token>``),
# manifests. Anything else there is no store's: it stays, whatever its age.
_WRITE_NAME = re.compile(
    r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,127}-[0-9]+-[0-9a-f]{12}|boot-[0-9a-f]{16}\.lock)$", re.ASCII
)
_STAMP_NAME = re.compile(r"^\.?[0-9a-f]{64}(?:-[0-9a-f]{8})?$")


class SnapshotRoom(SnapshotContent):
    """The store's room (reservations, its lock, eviction of boot images), its collection,
    and the objects restores are reading."""

    # -- removal while restores read ----------------------------------------------------

    def discard(self, snapshot: Snapshot | str) -> list[str]:
        """``delete`` a snapshot and remove, now, the objects no other snapshot uses (what
        ``collect`` removes besides): deleted snapshots left their bytes in a service's tenant
        stores for good, counted against its quota. Under the store's lock, no snapshot begins
        meanwhile; one already being written may be about to name one of these objects (a
        snapshot of the same files), so an object written since the oldest such writer began
        is left to ``collect``'s grace, and so are the objects of a snapshot a resume claimed."""
        sid = _snapshot_id(snapshot)
        if not self.root.is_dir():
            return []
        with self.locked():
            objects: frozenset[str] = frozenset()
            with contextlib.suppress(exc.SnapshotError, OSError):
                objects = frozenset(self.load(sid).blobs.values())
            if sid in self._claimed_refs([]):  # a resume is reading it: its objects wait
                objects = frozenset()
            self.delete(sid)
            return self._remove_now(objects)

    def _remove_now(self, objects: frozenset[str]) -> list[str]:
        """Under the store's lock: remove those of ``objects`` that nothing uses, now, but
        those a restore is reading and those a snapshot being written may be about to name."""
        objects -= self._being_read()
        begun = (name.split("-", 1)[0] for name in self._held_by_others(Path()))
        writers = [int(ns) for ns in begun if ns.isdigit()]
        if writers:
            since = min(writers) / 1e9 - WRITER_SLACK_S
            objects = frozenset(d for d in objects if _mtime(self.object_path(d)) < since)
        try:
            return self.collect(evicted=objects)
        except OSError:  # what is left goes at the next collection; the snapshot is gone
            return []

    @contextlib.contextmanager
    def reading(self, snapshot: Snapshot | str) -> Iterator[Manifest]:
        """The snapshot's manifest, and its objects kept for as long as the block runs (a
        restore reading them), by ``discard`` and ``collect`` in any process sharing the
        folder: a snapshot deleted while a sandbox was restored from it had its objects
        removed under the restore, which failed ``SnapshotCorrupt`` ("object ... is
        missing"). The snapshot itself goes at once (a later restore finds none); its objects
        when the last restore reading them ends. ``SnapshotNotFound`` when it is gone already."""
        sid = _snapshot_id(snapshot)
        marked: Path | None = None
        try:
            folder = self._dir("reading")
            path = folder / f"{sid}-{os.getpid()}-{secrets.token_hex(6)}"
            temp = folder / f".{path.name}"
            with self.locked():  # never between a discard's look at the readers and its removal
                manifest = self.load(sid)
                objects = frozenset(manifest.blobs.values())
                temp.write_text(json.dumps(sorted(objects)))
                os.replace(temp, path)  # whole, or not there, to a collection that does not lock
                marked = path
        except OSError as error:
            if error.errno != errno.EROFS:
                raise
        if marked is None:  # a store mounted read-only (one shared by many hosts): nothing
            # through this mount deletes from it, so there is nothing to keep
            yield self.load(sid)
            return
        try:
            yield manifest
        finally:
            marked.unlink(missing_ok=True)
            try:
                self._manifest_path(sid)
            except exc.SnapshotNotFound:  # deleted meanwhile: what it alone used goes now
                with contextlib.suppress(OSError), self.locked():
                    self._remove_now(objects)

    def _being_read(self) -> set[str]:
        """The objects restores are reading (``reading``); the marks of the dead are removed."""
        found: set[str] = set()
        for path in _entries(self.root / "reading"):
            if path.name.startswith("."):
                continue
            if _writer_gone(path):
                path.unlink(missing_ok=True)
                continue
            with contextlib.suppress(OSError, ValueError):
                found.update(str(d) for d in json.loads(path.read_text()))
        return found

    # -- room and collection ------------------------------------------------------------

    @contextlib.contextmanager
    def reserve(self) -> Iterator[Reservation]:
        """Room for one snapshot in the making, held until the block ends (its objects are in
        by then, and count themselves). Its file is locked for as long as it is held: one whose
        lock is free was left by a process that died, and counts no more."""
        path = self._dir("reserved") / f"{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(6)}"
        with self.locked():  # made and locked at once: never seen unlocked, as a dead writer's
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield Reservation(self, path, fd)
        finally:
            path.unlink(missing_ok=True)
            os.close(fd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the store's room still: while held, no reservation grows (in any process), so
        what is on disk can be measured against ``max_bytes``."""
        fd = os.open(self._dir("reserved").parent / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # another open of the file: threads exclude each other too
            yield
        finally:
            os.close(fd)

    def _reserved_by_others(self, own: Path) -> int:
        """The room the other snapshots in the making hold; reservations of the dead are removed."""
        return sum(self._held_by_others(own).values())

    def _held_by_others(self, own: Path) -> dict[str, int]:
        """Each other live reservation's name and the room it holds; the dead's are removed,
        and what the dead were writing with them (its room was no longer held, its bytes still
        on the disk: two writers killed mid-snapshot left 333 MB past a 200 MB cap, found from
        outside)."""
        for path in _entries(self.root / "tmp"):
            if _WRITE_NAME.fullmatch(path.name) and _writer_gone(path):
                _remove(path)
        held: dict[str, int] = {}
        for path in _entries(self.root / "reserved"):
            if path == own:
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:  # held: its writer is alive
                    text = os.read(fd, 32).decode("ascii", "replace").strip()
                    held[path.name] = int(text) if text.isdigit() else 0
                else:
                    path.unlink(missing_ok=True)
            finally:
                os.close(fd)
        return held

    def fits(self, more: int) -> bool:
        """Whether the objects and ``more`` bytes are within ``max_bytes``."""
        check_number(more, argument="more", integer=True, low=0, high=MAX_BYTES, unit="bytes")
        return self.size() + more <= self.max_bytes

    def size(self) -> int:
        folder = self.root / "objects"
        return sum(_disk_size(p) for p in folder.iterdir()) if folder.is_dir() else 0

    def _make_room(self, keep: str) -> None:
        """Evict boot images, least recently used first, until the store fits its limit.
        Objects written in the last ``GRACE_S`` may be another process's snapshot in the
        making: they stay, and count."""
        if not self._evict_boots(keep, lambda: self.size() <= self.max_bytes):
            total = self.size()
            raise exc.SnapshotStoreFull(
                f"the snapshot store {self.label} is full ({total // MiB} MiB of "
                f"{self.max_bytes // MiB} MiB): delete snapshots or paused sandboxes, "
                "or raise STOCKADE_SNAPSHOT_MAX_MB"
            )

    def _evict_boots(self, keep: str, fits: Callable[[], bool]) -> bool:
        """Evict boot images, least recently used first, until ``fits``; whether it does."""
        if fits():
            return True
        boots = []
        for name, sid in self.refs("boot"):
            with contextlib.suppress(OSError):
                boots.append(((self.root / "refs" / "boot" / name).stat().st_mtime, name, sid))
        for _, _, sid in sorted(boots):
            if sid != keep:
                objects: frozenset[str] = frozenset()
                with contextlib.suppress(exc.SnapshotError, OSError):
                    objects = frozenset(self.load(sid).blobs.values())
                self.delete(sid)
                self.collect(keep=keep, evicted=objects)
                if fits():
                    return True
        return fits()

    def collect(
        self, *, grace_s: float = GRACE_S, keep: str = "", evicted: frozenset[str] = frozenset()
    ) -> list[str]:
        """Remove what nothing keeps: refs to missing snapshots, snapshots no ref keeps, objects
        no snapshot uses, writes a crash left. Files younger than ``grace_s`` are being written,
        except the ``evicted`` objects (of a snapshot deleted to make room)."""
        check_number(grace_s, argument="grace_s", integer=False, low=0, high=MAX_TIMEOUT_S, unit="seconds")
        check_text(keep, argument="keep")
        check_instance(evicted, frozenset, argument="evicted", fix="give a frozenset of object digests")
        if not self.root.is_dir() or not self.recognised():
            return []  # no store's: nothing in it is ours to remove
        now = time.time()

        def old(path: Path) -> bool:
            try:
                return now - path.lstat().st_mtime >= grace_s
            except FileNotFoundError:
                return False

        removed: list[str] = []
        kept = self._live_refs(removed) | ({keep} if keep else set())
        used = self._live_manifests(kept, old, removed) | self._being_read()
        for sub, named in (("objects", _DIGEST), ("verified", _STAMP_NAME)):
            for path in _entries(self.root / sub):
                if not named.fullmatch(path.name) or _is_folder(path):  # not the store's: it stays
                    continue
                name = path.name.lstrip(".").split("-")[0]
                # a stamp of an object no snapshot uses goes at once, but not one being written
                # (its rename then failed); an object of a snapshot in the making is young
                stamp = sub == "verified" and not path.name.startswith(".")
                if name not in used and (old(path) or stamp or name in evicted):
                    path.unlink(missing_ok=True)
                    if sub == "objects":
                        removed.append(f"snapshot object {name[:16]}")
        for path in _entries(self.root / "tmp"):
            if not _WRITE_NAME.fullmatch(path.name):  # not written by a store: it stays
                continue
            with contextlib.suppress(FileNotFoundError):  # moved into place while we looked
                if now - path.lstat().st_mtime <= max(grace_s, 3600.0) and not _writer_gone(path):
                    continue
                _remove(path)
                removed.append(f"unfinished snapshot write {path.name}")
        return removed

    def _live_refs(self, removed: list[str]) -> set[str]:
        """The snapshots refs keep; refs to missing snapshots are dropped. A claimed ref (a
        resume under way) keeps its snapshot too: a collection during a resume deleted the
        paused sandbox it was bringing back."""
        kept = self._claimed_refs(removed)
        for kind in REF_KINDS:
            for name, sid in self.refs(kind):
                try:
                    self._manifest_path(sid)
                    kept.add(sid)
                except exc.SnapshotNotFound:
                    self.drop_ref(kind, name)
                    removed.append(f"snapshot ref {kind}/{name} (its snapshot is gone)")
        return kept

    def _claimed_refs(self, removed: list[str]) -> set[str]:
        """The snapshots of refs being claimed. A claim older than ``CLAIM_STALE_S`` is a
        resume that died mid-way (one takes seconds): its ref is put back, for another."""
        kept: set[str] = set()
        now = time.time()
        for kind in REF_KINDS:
            folder = self.root / "refs" / kind
            for path in _entries(folder):
                name, marker, _ = path.name.lstrip(".").partition(CLAIMED)
                if not path.name.startswith(".") or not marker:
                    continue
                with contextlib.suppress(OSError, ValueError, KeyError):
                    kept.add(str(json.loads(path.read_text())["snapshot"]))
                    stale = now - path.lstat().st_mtime > CLAIM_STALE_S or _writer_gone(path)
                    if stale and _NAME.match(name):
                        ref = folder / name
                        if not ref.exists():
                            os.rename(path, ref)
                            removed.append(f"snapshot ref {kind}/{name} put back (its resume died)")
        return kept

    def _live_manifests(self, kept: set[str], old: Callable[[Path], bool], removed: list[str]) -> set[str]:
        """The objects of the snapshots kept (or too young to judge); the others are removed."""
        used: set[str] = set()
        for path in _entries(self.root / "snapshots"):
            if not _MANIFEST_NAME.fullmatch(path.name) or _is_folder(path):  # not the store's: it stays
                continue
            sid = ID_PREFIX + path.name[:ID_HEX]
            if sid not in kept and old(path):
                path.unlink(missing_ok=True)
                removed.append(f"snapshot {sid}")
                continue
            with contextlib.suppress(OSError, ValueError):
                used.update(str(d) for d in dict(json.loads(path.read_bytes()).get("blobs") or {}).values())
        return used


@dataclass
class Reservation:
    """Room a snapshot holds in its store while it is written (``SnapshotStore.reserve``):
    ``grow`` before writing, ``open`` a file of the store's ``tmp`` that grows it as it goes;
    ``expect`` and ``charge`` for a file another program writes (a memory image)."""

    store: SnapshotRoom
    path: Path
    fd: int
    held: int = 0  # bytes reserved
    used: int = 0  # bytes written, through ``open``'s files or charged
    expected: int = 0  # bytes held for what another program is about to write

    def room(self) -> int:
        """What could still be written: the held room unused, and what no one holds."""
        with self.store.locked():
            taken = self.store.size() + self.store._reserved_by_others(self.path)
        return max(0, self.store.max_bytes - taken - self.used - self.expected)

    def expect(self, size: int) -> None:
        """Hold ``size`` bytes more for a file that QEMU or runsc writes, which this process
        cannot stop midway: refused before it starts when the room is not there."""
        check_number(size, argument="size", integer=True, low=0, high=MAX_BYTES, unit="bytes")
        self.grow(self.used + self.expected + size)
        self.expected += size

    def charge(self, path: Path) -> None:
        """Count what another program wrote at ``path`` (a file or folder of the store's
        ``tmp``) in place of what ``expect`` held for it (``SnapshotStoreFull`` past the room)."""
        written = sum(_disk_size(p) for p in (path.rglob("*") if path.is_dir() else [path]))
        self.expected = 0
        self.grow(self.used + written)
        self.used += written

    def grow(self, total: int) -> None:
        """Hold at least ``total`` bytes (``SnapshotStoreFull`` when the store cannot make room:
        the objects and every other reservation count, boot images are evicted first; while
        snapshots begun later hold room, this one waits for them to end or give way)."""
        check_number(total, argument="total", integer=True, low=0, high=MAX_BYTES, unit="bytes")
        if total <= self.held:
            return
        store = self.store
        deadline = time.monotonic() + WAIT_S
        while True:
            with store.locked():
                others = store._held_by_others(self.path)
                taken = store.size() + sum(others.values())
                want = -(-total // RESERVE_STEP) * RESERVE_STEP
                if taken + want > store.max_bytes:
                    want = total
                held_elsewhere = sum(others.values())
                if taken + want <= store.max_bytes or store._evict_boots(
                    "", functools.partial(store.fits, held_elsewhere + want)
                ):
                    os.pwrite(self.fd, f"{want:<20d}".encode(), 0)
                    self.held = want
                    return
                # Snapshots begun later that hold room give way (the youngest is refused at
                # once): of writers that together do not fit, the oldest goes on.
                younger = any(room for name, room in others.items() if name > self.path.name)
                if not younger or time.monotonic() >= deadline:
                    raise exc.SnapshotStoreFull(
                        f"the snapshot store {store.label} is full: {taken // MiB} MiB of its "
                        f"{store.max_bytes // MiB} MiB are taken or being written, and this snapshot "
                        f"needs {-(-total // MiB)} MiB; delete snapshots or paused "
                        "sandboxes, or raise STOCKADE_SNAPSHOT_MAX_MB"
                    )
            time.sleep(0.05)

    @contextlib.contextmanager
    def open(self, hint: str) -> Iterator[tuple[Path, Callable[[bytes], None]]]:
        """A new file of the store's ``tmp`` and its ``write``, which grows the reservation
        before each chunk (every byte counts: holes would be written out at the restore anyway).
        The file is removed if the block raises."""
        path = self.store.temp_path(hint)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)

        def write(chunk: bytes) -> None:
            self.grow(self.used + self.expected + len(chunk))
            self.used += len(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]

        try:
            yield path, write
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)


def _remove(path: Path) -> None:
    """A file, link or folder of the store's tmp/: a link is removed, never followed."""
    if _is_folder(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except FileNotFoundError:
        return 0.0
