"""What a snapshot is made of: objects (its bytes) and its manifest, each named by the
SHA-256 of its bytes and checked against it before anything is restored.

A part of ``SnapshotStore``. Hashing a memory image of a few hundred MiB on every start would
cost more than the start, so an object's full hash is stamped (``verified/``) with its inode,
size and times and skipped while they are unchanged; a stamp guards against damage, not
against whoever can write the store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from stockade import exceptions as exc
from stockade._checks import check_host_path, check_instance, check_number, check_strings
from stockade.sandbox._snapshot_files import (
    _DIGEST,
    CHUNK,
    ID_HEX,
    ID_PREFIX,
    REF_KINDS,
    _manifest_fields,
    _open_regular,
    _snapshot_id,
)
from stockade.sandbox._snapshot_refs import Held, SnapshotRefs
from stockade.types import Snapshot, SnapshotKind

FORMAT = 1


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


class SnapshotContent(SnapshotRefs):
    """The store's objects and manifests: added, checked, streamed, loaded, listed, deleted."""

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

    def _manifest_path(self, sid: str) -> Path:
        hexpart = sid.removeprefix(ID_PREFIX)
        if not sid.startswith(ID_PREFIX) or len(hexpart) != ID_HEX or not _DIGEST.match(hexpart + "0" * 32):
            raise exc.SnapshotNotFound(f"{sid!r} is no snapshot id (snap- and 32 hex digits)")
        matches = list((self.root / "snapshots").glob(f"{hexpart}*.json"))
        if len(matches) != 1:
            raise exc.SnapshotNotFound(f"no snapshot {sid} in {self.label}")
        return matches[0]


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
