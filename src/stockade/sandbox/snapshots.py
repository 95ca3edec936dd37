"""Where snapshots are kept: a content-addressed folder on this host.

    STORE/
      objects/<sha256>            the bytes: a tar of /workspace or /tmp, a memory image
      snapshots/<sha256>.json     a manifest: what one snapshot is made of; its id is its hash
      refs/<kind>/<name>          what keeps a snapshot: a paused sandbox (``paused``), a
                                  snapshot a caller took (``kept``), a microVM's boot image (``boot``),
                                  the sandbox of an agent run that paused (``run``, by run id)
      verified/<sha256>           the object's identity (inode, size, times) when last hashed
      tmp/                        what is being written
      reserved/<ns>-<pid>-<token> the room a snapshot being written holds (bytes; locked by its
                                  writer; named by when it began, so the oldest sorts first)
      reading/<id>-<pid>-<token>  the objects a restore is reading (kept until it ends)
      lock                        taken while room is counted and reserved
      .stockade-snapshot-store    the mark that this folder is a store (its layout's version)

Every object is named by the SHA-256 of its bytes and every manifest by the SHA-256 of its
text, so a snapshot is its id: before anything is restored, the manifest and each object are
hashed again (``SnapshotCorrupt`` on any difference). Hashing a memory image of a few hundred
MiB on every start would cost more than the start, so a full hash is recorded with the
object's inode, size, modification and change times, and skipped while they are unchanged:
any write to the file changes its change time, which only the clock can set back. The
stamps are the store's own files: whoever can write the store (root: it is 0700) can forge
one, and a check that trusts the stamp is a check against damage, not against root. An
object is opened as a regular file only (not through a link, not waited on: a FIFO in its
place hung a restore, a link to /dev/zero streamed zeros), and an object added again
replaces the one there (kept, one damaged since was stamped anew with its damage).

Objects are kept once, whatever shares them (every fork of one snapshot, two snapshots of
one workspace). ``collect`` (``stockade gc``) removes what no ref keeps, in a folder
``recognised`` as a store only, and there only names the store writes (a folder given by
mistake, a home or a project holding a tmp/, lost its files to gc once), ``discard`` a
snapshot and, at once, the objects only it used; the store holds at
most ``max_bytes`` (disk blocks), dropping the boot images used longest ago first, and
refuses a snapshot that would not fit otherwise. Room is reserved before a byte is written
(``reserve``): the objects, plus what every snapshot in the making holds, in this process and
any other sharing the folder, never exceed ``max_bytes`` by more than a write's rounding to
disk blocks, and a writer stops at the first chunk that would not fit. Writers that together
do not fit give way youngest first: one that finds no room while snapshots begun after it
hold some waits (up to ``WAIT_S``) for them to end or be refused, and the youngest is refused
at once, so of several snapshots taken at once the oldest that fits is kept, never none. The
folder is root's alone (0700): a snapshot holds the sandbox's environment and memory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from stockade import exceptions as exc
from stockade._checks import (
    MAX_TIMEOUT_S,
    _shown,
    check_choice,
    check_host_path,
    check_instance,
    check_number,
    check_strings,
    check_text,
)
from stockade.sandbox import _trusted
from stockade.types import Snapshot, SnapshotKind

__all__ = ["FORMAT", "ROLE_KEY", "Held", "Manifest", "Reservation", "SnapshotStore"]

FORMAT = 1
MiB = 1024 * 1024
DEFAULT_MAX_MB = 20 * 1024
MAX_BYTES = 1 << 62  # past any disk; and a size an int64 (st_blocks, a tar header) holds
ID_PREFIX = "snap-"
ID_HEX = 32  # 128 bits of the manifest's hash name a snapshot
# Unreferenced files younger than this are being written by someone: collect leaves them.
GRACE_S = 120.0
CHUNK = 4 * MiB
REF_KINDS = ("paused", "kept", "boot", "run")
# A ref's field naming the role that took the snapshot (a service's tenant store): none, a
# token without a role, or a snapshot taken before the service said
ROLE_KEY = "role"
CLAIMED = ".claimed-"  # a ref being claimed (a resume): ``.NAME.claimed-PID-TOKEN``
CLAIM_STALE_S = 24 * 3600.0  # a claim this old is a resume that died: its ref is put back
# A file's time is the kernel's clock tick, which may read a little behind time.time() read
# before: an object written since a writer began may seem this much older than its start.
WRITER_SLACK_S = 1.0
# A reservation grows to a multiple of this (when there is room): little held unused.
RESERVE_STEP = MiB
# How long a writer short of room waits for younger writers to give theirs up.
WAIT_S = 30.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_WRITER = re.compile(r"-([0-9]+)-[0-9a-f]{8,12}$")  # the pid in a ``temp_path``'s or claim's name
# What the store writes, and all that collection removes: a ``temp_path`` (and a boot image's
# lock beside them) in tmp/, objects and their stamps (being written: ``.<hex>-<token>``),
# manifests. Anything else there is no store's: it stays, whatever its age.
_WRITE_NAME = re.compile(
    r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,127}-[0-9]+-[0-9a-f]{12}|boot-[0-9a-f]{16}\.lock)$", re.ASCII
)
_STAMP_NAME = re.compile(r"^\.?[0-9a-f]{64}(?:-[0-9a-f]{8})?$")
_MANIFEST_NAME = re.compile(r"^[0-9a-f]{64}\.json$")
# Written when a store is made: no folder is collected without it (but one an older version
# made, known by its layout, and marked then). Its format is the layout's: a newer one's
# store is not collected by code that may misjudge it.
MARKER = ".stockade-snapshot-store"
STORE_FORMAT = 1
_MARKER_KIND = "stockade snapshot store"
_STORE_PARTS = frozenset({"objects", "snapshots", "refs", "verified", "tmp", "reserved", "reading", "lock"})
_MAX_MANIFEST = 1 << 20


@dataclass(frozen=True)
class Manifest:
    """A snapshot as stored: its public value and the manifest's fields (``blobs`` maps a
    role, such as ``workspace`` or ``memory``, to an object's digest)."""

    snapshot: Snapshot
    data: Mapping[str, Any]

    @property
    def blobs(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in dict(self.data.get("blobs") or {}).items()}

    @property
    def spec(self) -> dict[str, Any]:
        return dict(self.data.get("spec") or {})

    @property
    def tier_state(self) -> dict[str, Any]:
        """What the tier recorded to restore the memory (its machine, its image layout)."""
        return dict(self.data.get("tier_state") or {})


@dataclass(frozen=True)
class Held:
    """A snapshot and a ref that keeps it: its ``kind`` (``paused``: a paused sandbox, named
    by its id; ``kept``: taken by a caller; ``run``: an agent run's sandbox, ``extra["run"]``
    the run's id; ``boot``: a microVM's boot image), its ``name``, and what its writer added."""

    snapshot: Snapshot
    kind: str
    name: str
    extra: Mapping[str, str]

    @property
    def holder(self) -> str:
        """Who keeps it, in words: ``paused sandbox sbx-...``, ``run <id>``, ``kept``, ``boot image``."""
        if self.kind == "paused":
            return f"paused sandbox {self.name}"
        if self.kind == "run":
            return f"run {self.extra.get('run', self.name)}"
        if self.kind == "boot":
            return "boot image"
        return "kept"

    @property
    def role(self) -> str | None:
        """The role that took it, where a service's ref says (``ROLE_KEY``)."""
        return self.extra.get(ROLE_KEY)


@dataclass(frozen=True)
class SnapshotStore:
    """A snapshot store: ``SnapshotStore.default()`` unless told otherwise."""

    root: Path
    max_bytes: int = DEFAULT_MAX_MB * MiB
    # What audit events and errors call it; its folder when empty. A service names its
    # tenants' stores: their callers are not told where on the host they are.
    name: str = ""
    # Once known, for this value's life: the folder holds a mark (none is written again), and
    # the mark is this store's (``recognised``). Read at every write and collection before.
    _mark_found: bool = field(default=False, init=False, repr=False, compare=False)
    _known_store: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A folder given as a string (as os.fspath and most callers have it) is a path too;
        # anything else is refused here, not a TypeError (or a store of "-1" bytes) later.
        object.__setattr__(self, "root", check_host_path(self.root, argument="root"))
        check_number(self.max_bytes, argument="max_bytes", integer=True, low=0, high=MAX_BYTES, unit="bytes")
        check_text(self.name, argument="name")

    @property
    def label(self) -> str:
        return self.name or str(self.root)

    @classmethod
    def default(cls) -> SnapshotStore:
        """``STOCKADE_SNAPSHOT_DIR`` (else /var/lib/stockade/snapshots as root, else
        ~/.local/share/stockade/snapshots), at most ``STOCKADE_SNAPSHOT_MAX_MB`` MiB."""
        explicit = os.environ.get("STOCKADE_SNAPSHOT_DIR")
        if explicit:
            root = Path(explicit)
        elif os.geteuid() == 0:
            root = Path("/var/lib/stockade/snapshots")
        else:
            root = Path.home() / ".local/share/stockade/snapshots"
        limit = os.environ.get("STOCKADE_SNAPSHOT_MAX_MB", "")
        if limit and not limit.isdigit():
            raise exc.InvalidArgument(
                f"STOCKADE_SNAPSHOT_MAX_MB is {limit!r}",
                argument="STOCKADE_SNAPSHOT_MAX_MB",
                fix=f"give a whole number of MiB, or unset it for {DEFAULT_MAX_MB}",
            )
        return cls(root, (int(limit) if limit else DEFAULT_MAX_MB) * MiB)

    # -- layout -------------------------------------------------------------------------

    def _dir(self, name: str) -> Path:
        # A restore loads what is here into a sandbox, QEMU or runsc: no other user's store.
        path = self.root / name
        if not _trusted.check(path).is_dir():
            root = _trusted.folder(self.root, 0o700)
            os.chmod(root, 0o700)
            path.mkdir(exist_ok=True, mode=0o700)
        # What holds snapshots is a store from its first write on (one an older version made
        # too): a lock or a read alone marks nothing (``snapshots delete`` given a wrong folder)
        if name in ("objects", "snapshots", "refs", "tmp") and not self._mark_found:
            object.__setattr__(self, "_mark_found", os.path.lexists(self.root / MARKER) or self._mark())
        return path

    def _mark(self) -> bool:
        """Write the mark; whether it is there now."""
        marker = self.root / MARKER
        tmp = marker.with_name(f"{MARKER}.{secrets.token_hex(4)}")
        try:
            tmp.write_text(json.dumps({"store": _MARKER_KIND, "format": STORE_FORMAT}) + "\n")
            os.replace(tmp, marker)
        except OSError:  # a store mounted read-only: nothing here collects it either
            tmp.unlink(missing_ok=True)
            return False
        object.__setattr__(self, "_mark_found", True)
        object.__setattr__(self, "_known_store", True)
        return True

    def recognised(self) -> bool:
        """Whether the folder is a snapshot store, which ``collect`` may remove from: it holds
        the store's mark (``MARKER``), or it is a store an older version made, before the
        mark, known by a layout nothing else has (only the store's folders; objects named by
        64 hex digits; manifests that hash to their names), and marked now. Once known, the
        mark is not read again."""
        if not (self._known_store or self._marked()):
            if not _made_before_marks(self.root):
                return False
            self._mark()
        object.__setattr__(self, "_known_store", True)
        return True

    def _marked(self) -> bool:
        try:
            fd = _open_regular(self.root / MARKER)
        except OSError:
            return False
        if fd is None:
            return False
        try:
            data = json.loads(os.read(fd, 4096))
        except (OSError, ValueError):
            return False
        finally:
            os.close(fd)
        return isinstance(data, dict) and (data.get("store"), data.get("format")) == (
            _MARKER_KIND,
            STORE_FORMAT,
        )

    def object_path(self, digest: str) -> Path:
        if not _DIGEST.match(check_text(digest, argument="digest", fix="give an object's SHA-256 in hex")):
            raise exc.SnapshotCorrupt(f"a snapshot names an object {digest[:80]!r}, which is no SHA-256")
        return self.root / "objects" / digest

    def temp_path(self, hint: str = "blob") -> Path:
        """A fresh path to write an object to, before ``add_file`` names it by its hash."""
        if not _NAME.match(check_text(hint, argument="hint")):  # a "/" would leave tmp/
            raise exc.InvalidArgument(
                f"hint {_shown(hint)} is no file name",
                argument="hint",
                fix="give letters, digits, '.', '_', '-'",
            )
        return self._dir("tmp") / f"{hint}-{os.getpid()}-{secrets.token_hex(6)}"

    # -- objects ------------------------------------------------------------------------

    def add_bytes(self, data: bytes) -> str:
        check_instance(data, bytes, argument="data", fix="give bytes (str.encode() for text)")
        path = self.temp_path()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        return self.add_file(path, digest=hashlib.sha256(data).hexdigest())

    def add_stream(self, chunks: Iterator[bytes]) -> str:
        path = self.temp_path()
        digest = hashlib.sha256()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as fh:
                for chunk in chunks:
                    digest.update(chunk)
                    fh.write(chunk)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return self.add_file(path, digest=digest.hexdigest())

    def add_file(self, path: Path, *, digest: str | None = None) -> str:
        """Move ``path`` (a file of this store's ``tmp``) into the objects, named by its hash."""
        path = check_host_path(path, argument="path")
        if digest is not None:
            self.object_path(digest)  # a SHA-256 in hex, or refused
        digest = digest or _hash_file(path)
        target = self._dir("objects") / digest
        os.chmod(path, 0o400)
        # Ours replaces one already there, which is then known good again: kept, an object
        # damaged since (a bit flipped on disk) was stamped as verified with its new identity,
        # and every snapshot of the same bytes taken after it was refused at its restore. The
        # replacement is new to collection and eviction; readers of the old keep their copy.
        try:
            os.replace(path, target)
        except OSError:  # there, and not ours to touch
            path.unlink()
            return digest
        self._stamp(digest, target)
        return digest

    def check_object(self, digest: str) -> Path:
        """The object's path, once its bytes are known to hash to ``digest``."""
        path = self.object_path(digest)
        with self._open_object(digest) as fh:
            stamp = self.root / "verified" / digest
            with contextlib.suppress(OSError):
                if stamp.read_text() == _identity(os.fstat(fh.fileno())):
                    return path
            hashed = hashlib.sha256()
            _hash_into(fh, hashed)
        if hashed.hexdigest() != digest:
            raise exc.SnapshotCorrupt(
                f"object {digest[:16]} of the snapshot was modified (its bytes no longer hash to its "
                "name); nothing was restored from it"
            )
        self._stamp(digest, path)
        return path

    def _open_object(self, digest: str) -> BinaryIO:
        """The object, opened for reading as a regular file only (``_open_regular``): anything
        else, or none, is ``SnapshotCorrupt``."""
        path = self.object_path(digest)
        try:
            fd = _open_regular(path)
        except FileNotFoundError:
            raise exc.SnapshotCorrupt(
                f"object {digest[:16]} of the snapshot is missing from {self.label}"
            ) from None
        except OSError as error:  # ELOOP: a link
            raise exc.SnapshotCorrupt(
                f"object {digest[:16]} of the snapshot is not a file of the store ({error.strerror}); "
                "nothing was restored from it"
            ) from None
        if fd is None:
            raise exc.SnapshotCorrupt(
                f"object {digest[:16]} of the snapshot is not a regular file; nothing was restored from it"
            )
        return open(fd, "rb", buffering=0)

    def stream_object(self, digest: str, chunk: int) -> Generator[bytes, None, None]:
        """The object's bytes, at most ``chunk`` at a time, hashed on the way: after the last
        one the iterator raises ``SnapshotCorrupt`` (instead of ending) when they do not hash
        to ``digest``. Memory is one chunk whatever the object's size (a restore that read a
        1 GiB object whole took 2 GB of the host's). Opened here, not at the first chunk, so
        a missing object is refused before anything is sent."""
        check_number(chunk, argument="chunk", integer=True, low=1, high=1 << 30, unit="bytes")
        return self._chunks(self._open_object(digest), self.object_path(digest), digest, chunk)

    def _chunks(self, fh: BinaryIO, path: Path, digest: str, chunk: int) -> Generator[bytes, None, None]:
        hashed = hashlib.sha256()
        with fh:
            while data := fh.read(chunk):
                hashed.update(data)
                yield data
            if hashed.hexdigest() != digest:
                raise exc.SnapshotCorrupt(
                    f"object {digest[:16]} of the snapshot was modified (its bytes no longer hash to "
                    "its name); nothing was restored from it"
                )
            with contextlib.suppress(OSError):
                self._stamp(digest, path)

    def _stamp(self, digest: str, path: Path) -> None:
        """Remember that ``path`` hashed to ``digest``: a cache of work done, so that a stamp
        not written (a full disk, a collection racing it) costs a hash later, nothing else."""
        stamp = self._dir("verified") / digest
        tmp = stamp.with_name(f".{digest}-{secrets.token_hex(4)}")
        try:
            tmp.write_text(_identity(path.stat()))
            os.replace(tmp, stamp)
        except OSError:
            tmp.unlink(missing_ok=True)

    # -- manifests ----------------------------------------------------------------------

    def save(
        self,
        *,
        kind: SnapshotKind,
        tier: str,
        source: str,
        spec: Mapping[str, Any],
        blobs: Mapping[str, str],
        tier_state: Mapping[str, Any] | None = None,
        ref: tuple[str, str] | None = None,
    ) -> Snapshot:
        """Write the manifest of a snapshot made of ``blobs`` (already added), keep it under
        ``ref`` (kind, name; an empty name is the snapshot's id), and make room for it. A
        snapshot that does not fit is removed."""
        kind = check_choice(SnapshotKind, kind, argument="kind")
        check_text(tier, argument="tier")
        check_text(source, argument="source")
        _check_mapping(spec, argument="spec")
        for digest in _check_mapping(blobs, argument="blobs").values():
            self.object_path(digest)
        if tier_state is not None:
            _check_mapping(tier_state, argument="tier_state")
        if ref is not None and not (
            isinstance(ref, tuple) and len(ref) == 2 and all(isinstance(part, str) for part in ref)
        ):
            raise exc.InvalidArgument(
                f"ref must be a (kind, name) pair of str, got {_shown(ref)}",
                argument="ref",
                fix='give ("kept", "") for a kept snapshot named by its id',
            )
        size = sum(_disk_size(self.object_path(d)) for d in set(blobs.values()))
        data = {
            "format": FORMAT,
            "kind": kind.value,
            "tier": tier,
            "source": source,
            "taken_at": round(time.time(), 6),
            "size_bytes": size,
            "spec": dict(spec),
            "blobs": dict(blobs),
            "tier_state": dict(tier_state or {}),
        }
        text = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        digest = hashlib.sha256(text).hexdigest()
        target = self._dir("snapshots") / f"{digest}.json"
        tmp = self.temp_path("manifest")
        tmp.write_bytes(text)
        os.chmod(tmp, 0o400)
        os.replace(tmp, target)
        snapshot = _value(digest, data, self.root)
        if ref is not None:
            ref = (ref[0], ref[1] or snapshot.id)
            self.set_ref(ref[0], ref[1], snapshot.id)
        try:
            self._make_room(keep=snapshot.id)
        except exc.SnapshotError:
            self.delete(snapshot.id)
            # Its objects go now, not at the next collection: snapshots refused one after
            # another left gigabytes on the host's disk until then.
            with contextlib.suppress(OSError):
                self.collect(evicted=frozenset(blobs.values()))
            raise
        return snapshot

    def load(self, snapshot: Snapshot | str) -> Manifest:
        """The manifest of a snapshot, its text checked against its hash (``SnapshotCorrupt``)."""
        sid = _snapshot_id(snapshot)
        path = self._manifest_path(sid)
        digest = path.name.removesuffix(".json")
        data = _manifest_fields(path.read_bytes(), digest)
        if data is None:
            raise exc.SnapshotCorrupt(f"the manifest of snapshot {sid} was modified; nothing was restored")
        if data.get("format") != FORMAT:
            raise exc.SnapshotIncompatible(f"snapshot {sid} has format {data.get('format')!r}, not {FORMAT}")
        return Manifest(_value(digest, data, self.root), data)

    def verify(self, snapshot: Snapshot | str) -> Manifest:
        """``load`` and hash every object (``SnapshotCorrupt`` on the first that differs)."""
        manifest = self.load(snapshot)
        for digest in sorted(set(manifest.blobs.values())):
            self.check_object(digest)
        return manifest

    def get(self, snapshot_id: str) -> Snapshot:
        _snapshot_id(snapshot_id)
        return self.load(snapshot_id).snapshot

    def snapshots(self) -> list[Snapshot]:
        """Every snapshot a ref keeps (paused sandboxes, kept snapshots), newest first."""
        found: dict[str, Snapshot] = {}
        for kind in ("paused", "kept"):
            for _, sid in self.refs(kind):
                with contextlib.suppress(exc.SnapshotError, OSError):
                    found[sid] = self.load(sid).snapshot
        return sorted(found.values(), key=lambda s: s.taken_at, reverse=True)

    def held(self, kinds: tuple[str, ...] = ("paused", "kept", "run")) -> list[Held]:
        """Every snapshot the refs of ``kinds`` keep, with what keeps it (a snapshot kept
        twice is listed twice), newest first; the boot images with ``"boot"`` among them."""
        found: list[Held] = []
        for kind in check_strings(kinds, argument="kinds"):
            folder = self.root / "refs" / kind
            if kind not in REF_KINDS or not folder.is_dir():
                continue
            for path in sorted(folder.iterdir()):
                if path.name.startswith("."):
                    continue
                with contextlib.suppress(exc.SnapshotError, OSError, ValueError, KeyError):
                    data = json.loads(path.read_text())
                    snapshot = self.load(str(data["snapshot"])).snapshot
                    extra = {str(k): str(v) for k, v in data.items() if k != "snapshot"}
                    found.append(Held(snapshot, kind, path.name, extra))
        return sorted(found, key=lambda h: h.snapshot.taken_at, reverse=True)

    def delete(self, snapshot: Snapshot | str) -> None:
        """Forget a snapshot: its refs and manifest go now, its objects at the next ``collect``
        unless another snapshot shares them."""
        sid = _snapshot_id(snapshot)
        for kind in REF_KINDS:
            for name, target in self.refs(kind):
                if target == sid:
                    self.drop_ref(kind, name)
        with contextlib.suppress(exc.SnapshotNotFound):
            self._manifest_path(sid).unlink(missing_ok=True)

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

    def _manifest_path(self, sid: str) -> Path:
        hexpart = sid.removeprefix(ID_PREFIX)
        if not sid.startswith(ID_PREFIX) or len(hexpart) != ID_HEX or not _DIGEST.match(hexpart + "0" * 32):
            raise exc.SnapshotNotFound(f"{sid!r} is no snapshot id (snap- and 32 hex digits)")
        matches = list((self.root / "snapshots").glob(f"{hexpart}*.json"))
        if len(matches) != 1:
            raise exc.SnapshotNotFound(f"no snapshot {sid} in {self.label}")
        return matches[0]

    # -- refs ---------------------------------------------------------------------------

    def _ref(self, kind: str, name: str) -> Path:
        _ref_kind(kind)
        if not _NAME.match(check_text(name, argument="name")):
            raise exc.InvalidArgument(f"bad snapshot ref {kind}/{name}", argument="ref")
        return self._dir("refs") / kind / name

    def set_ref(self, kind: str, name: str, snapshot_id: str, **extra: str) -> None:
        path = self._ref(kind, name)
        _snapshot_id(snapshot_id)
        for key, value in extra.items():
            check_text(value, argument=key)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{name}-{secrets.token_hex(4)}")
        tmp.write_text(json.dumps({"snapshot": snapshot_id, **extra}))
        os.replace(tmp, path)

    def ref(self, kind: str, name: str) -> dict[str, str] | None:
        """What the ref holds (``snapshot``, and what its writer added), or None."""
        path = self._ref(kind, name)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # used: the boot image evicted last
        return {str(k): str(v) for k, v in data.items()}

    def drop_ref(self, kind: str, name: str) -> None:
        self._ref(kind, name).unlink(missing_ok=True)

    def refs(self, kind: str) -> list[tuple[str, str]]:
        _ref_kind(kind)
        folder = self.root / "refs" / kind
        out = []
        if folder.is_dir():
            for path in sorted(folder.iterdir()):
                if path.name.startswith("."):
                    continue
                with contextlib.suppress(OSError, ValueError, KeyError):
                    out.append((path.name, str(json.loads(path.read_text())["snapshot"])))
        return out

    @contextlib.contextmanager
    def claim(self, kind: str, name: str) -> Iterator[dict[str, str]]:
        """Take a ref for oneself (a resume): one claimer wins, the others get
        ``SnapshotNotFound``. The ref is gone when the block ends well, back when it raises."""
        path = self._ref(kind, name)
        claimed = path.with_name(f".{name}{CLAIMED}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            try:
                os.rename(path, claimed)
            except FileNotFoundError:
                # a claimer killed mid-resume hid the ref for a day (found from outside): its
                # claim is put back once its process is gone, and taken again
                for dead in path.parent.glob(f".{name}{CLAIMED}*"):
                    if _writer_gone(dead) and not path.exists():
                        with contextlib.suppress(FileNotFoundError):
                            os.rename(dead, path)
                os.rename(path, claimed)
        except FileNotFoundError:
            raise exc.SnapshotNotFound(f"nothing {kind} under {name!r} in {self.label}") from None
        with contextlib.suppress(OSError):
            os.utime(claimed)  # when it was claimed (the ref kept its writing's time)
        try:
            data = json.loads(claimed.read_text())
            yield {str(k): str(v) for k, v in data.items()}
        except BaseException:
            os.rename(claimed, path)
            raise
        claimed.unlink(missing_ok=True)

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

    store: SnapshotStore
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


def _snapshot_id(snapshot: object) -> str:
    """The id of a ``Snapshot`` or the str given; anything else (None, a number) is refused,
    not looked up as its ``str()`` (a ``delete(None)`` did nothing and said nothing)."""
    if isinstance(snapshot, Snapshot):
        return snapshot.id
    return check_text(
        snapshot, argument="snapshot", fix="give a Snapshot or its id (snap- and 32 hex digits)"
    )


def _ref_kind(kind: object) -> str:
    if not isinstance(kind, str) or kind not in REF_KINDS:
        choices = ", ".join(map(repr, REF_KINDS))
        raise exc.InvalidArgument(
            f"a snapshot ref's kind is {_shown(kind)}, not one of {choices}",
            argument="kind",
            fix=f"give one of {choices}",
        )
    return kind


def _check_mapping(value: object, *, argument: str) -> Mapping[Any, Any]:
    return check_instance(value, Mapping, argument=argument, fix="give a dict")  # type: ignore[type-abstract]


def _entries(folder: Path) -> list[Path]:
    """What ``folder`` holds; nothing when it is a link (the store made it a folder: a link
    in its place leads elsewhere, to what is not the store's)."""
    return [] if not _is_folder(folder) else sorted(folder.iterdir())


def _is_folder(path: Path) -> bool:
    """A folder itself, not a link to one."""
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def _remove(path: Path) -> None:
    """A file, link or folder of the store's tmp/: a link is removed, never followed."""
    if _is_folder(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _made_before_marks(root: Path) -> bool:
    """Whether ``root`` is a store an older version made: only the store's own folders, and
    at least one object or manifest; every object named by its SHA-256, every manifest a
    text that hashes to its name and parses as one. A folder that merely holds a tmp/ or an
    objects/ (a project's, a home) is none."""
    try:
        names = set(os.listdir(root))
        if not names <= _STORE_PARTS | {MARKER} or not names & {"objects", "snapshots"}:
            return False
        if not all(_is_folder(root / name) for name in names - {"lock", MARKER}):
            return False
        found = 0
        for path in _entries(root / "objects"):
            if not _DIGEST.fullmatch(path.name) or not stat.S_ISREG(path.lstat().st_mode):
                return False
            found += 1
        for path in _entries(root / "snapshots"):
            if not _MANIFEST_NAME.fullmatch(path.name) or not _is_manifest(path):
                return False
            found += 1
        kinds = {path.name for path in _entries(root / "refs")}
        return found > 0 and kinds <= set(REF_KINDS)
    except OSError:
        return False


def _is_manifest(path: Path) -> bool:
    """Whether ``path`` is a manifest of any format: a regular file of at most
    ``_MAX_MANIFEST`` bytes whose text hashes to its name and names its objects."""
    try:
        fd = _open_regular(path)
        if fd is None:
            return False
        with open(fd, "rb") as fh:
            text = fh.read(_MAX_MANIFEST + 1)
    except OSError:
        return False
    data = _manifest_fields(text, path.name.removesuffix(".json")) if len(text) <= _MAX_MANIFEST else None
    return data is not None and isinstance(data.get("blobs"), dict) and "format" in data


def _manifest_fields(text: bytes, digest: str) -> dict[str, Any] | None:
    """A manifest's fields, when its ``text`` hashes to ``digest`` (its name) and is a JSON
    object; else None."""
    if hashlib.sha256(text).hexdigest() != digest:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _open_regular(path: Path) -> int | None:
    """A descriptor reading ``path`` (blocking) when it is a regular file, None when it is
    anything else: never opened through a link (``OSError``, ELOOP) nor waited on (a FIFO in
    an object's place hung a restore for good, a link to /dev/zero streamed zeros)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        if regular:
            os.set_blocking(fd, True)
    except OSError:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        return None
    return fd


def _value(digest: str, data: Mapping[str, Any], root: Path) -> Snapshot:
    return Snapshot(
        id=ID_PREFIX + digest[:ID_HEX],
        kind=SnapshotKind(str(data.get("kind"))),
        tier=str(data.get("tier")),
        source=str(data.get("source", "")),
        taken_at=float(data.get("taken_at") or 0.0),
        size_bytes=int(data.get("size_bytes") or 0),
        store=str(root),
    )


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        _hash_into(fh, digest)
    return digest.hexdigest()


def _hash_into(fh: BinaryIO, digest: Any) -> None:
    while True:
        chunk = fh.read(CHUNK)
        if not chunk:
            return
        digest.update(chunk)


def _identity(st: os.stat_result) -> str:
    return f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"


def _disk_size(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except FileNotFoundError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except FileNotFoundError:
        return 0.0


def _writer_gone(path: Path) -> bool:
    """A write under ``tmp/`` or a claimed ref whose process (its name says which) is gone
    from this machine."""
    found = _WRITER.search(path.name)
    return found is not None and not Path(f"/proc/{found.group(1)}").exists()
