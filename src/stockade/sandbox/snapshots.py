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

The store is one value made of a part per concern, each in its own module:
``_snapshot_files`` (the folder, its names and its mark), ``_snapshot_refs`` (what keeps a
snapshot), ``_snapshot_content`` (objects and manifests, checked against their hashes) and
``_snapshot_room`` (reservations, eviction and collection); ``SnapshotStore`` adds its
settings and ``save``, which uses them all.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade._checks import _shown, check_choice, check_host_path, check_instance, check_number, check_text
from stockade.sandbox._snapshot_content import FORMAT, Manifest, _value
from stockade.sandbox._snapshot_files import MAX_BYTES, MiB, _disk_size
from stockade.sandbox._snapshot_refs import ROLE_KEY, Held
from stockade.sandbox._snapshot_room import Reservation, SnapshotRoom
from stockade.types import Snapshot, SnapshotKind

__all__ = ["FORMAT", "ROLE_KEY", "Held", "Manifest", "Reservation", "SnapshotStore"]

DEFAULT_MAX_MB = 20 * 1024


@dataclass(frozen=True)
class SnapshotStore(SnapshotRoom):
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

    # -- saving -------------------------------------------------------------------------

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


def _check_mapping(value: object, *, argument: str) -> Mapping[Any, Any]:
    return check_instance(value, Mapping, argument=argument, fix="give a dict")  # type: ignore[type-abstract]
