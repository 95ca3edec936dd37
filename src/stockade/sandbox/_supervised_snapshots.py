"""Snapshots of a supervised sandbox: taken between calls (new calls wait, running ones are
waited for), its files streamed into the store's room, and a fresh sandbox seeded from them.

A part of ``SupervisedInstance`` (``_supervised``): the store's room, the areas' sizes and
a restore under the restoring sandbox's rules are a concern of their own; a tier that keeps
memory overrides ``memory_snapshots`` and ``save_memory``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade.sandbox._requests import VCS_FOLDERS
from stockade.sandbox._snapshot_state import enforcement_state, spec_state
from stockade.sandbox._supervised_life import SupervisedLife
from stockade.sandbox._transfers import TRANSFER_CHUNK
from stockade.sandbox.ops import Area, GetArchive, Pause, TakeSnapshot
from stockade.sandbox.snapshots import Reservation, SnapshotStore
from stockade.types import Snapshot, SnapshotKind

SNAPSHOT_MAX_ENTRIES = 1 << 24

__all__ = ["SNAPSHOT_MAX_ENTRIES", "SupervisedSnapshots"]

log = logging.getLogger(__name__)
RestoreFilter = dict[str, object] | None  # what of a restore the rules let in (``_globs.unpack_filter``)


class SupervisedSnapshots(SupervisedLife):
    """The snapshots of a sandbox (see ``SupervisedInstance``)."""

    # -- snapshots ----------------------------------------------------------------------

    def memory_snapshots(self) -> str | None:
        """None when this sandbox can keep the memory of its processes in a snapshot, else
        why it cannot (a tier that can overrides this and ``save_memory``)."""
        return f"the {self.tier} tier keeps files only in a snapshot (workspace, /tmp, environment)"

    def memory_image_bytes(self) -> int:
        """The most a memory image of this sandbox should take: room held before it is written."""
        return self.spec.limits.memory_mb * (1 << 20)

    def save_memory(self, room: Reservation, *, stop: bool) -> tuple[dict[str, str], dict[str, Any]]:
        """The tier's memory image of the sandbox, as objects of the store, written within
        ``room`` (role -> digest) and what the tier needs to restore it; ``stop``: the sandbox
        need not run on."""
        raise exc.LimitNotEnforceable(self.memory_snapshots() or "no memory snapshots here")

    def _snapshot(self, op: TakeSnapshot | Pause) -> Snapshot:
        """Take a snapshot between calls: new calls wait, running ones are waited for."""
        self._check_open()
        if self.spec.network.credentials:
            raise exc.LimitNotEnforceable(
                "a sandbox with brokered credentials cannot be snapshotted: its credentials stay "
                "on the host and are never written to the snapshot store",
                setting="snapshot",
                fix="snapshot a sandbox made without credentials, and give network= with them to "
                "Sandbox.create(snapshot=...)",
            )
        why = self.memory_snapshots()
        if op.memory and why is not None:
            # memory=None would keep memory where it could: only False asks for files
            fix = "pass memory=False to keep the files only"
            if self.tier not in ("microvm", "gvisor"):
                fix += ", or use the microvm or gvisor tier"
            raise exc.LimitNotEnforceable(
                f"{why}; this snapshot must keep the memory of the processes",
                setting="snapshot memory",
                fix=fix,
            )
        with self._quiet(), op.store.reserve() as room:
            self._check_open()
            memory = op.memory is not False and why is None
            if memory:
                sealed = self.channel.seal_state()  # nothing in flight: the supervisor's counts
                room.expect(self.memory_image_bytes())
                blobs, tier_state = self.save_memory(room, stop=isinstance(op, Pause))
                tier_state = {**tier_state, "enforcement": enforcement_state(self.enforcement)}
                if sealed is not None:
                    # The restored supervisor seals with this key and these counts (its memory
                    # is this one's); the store is the host's alone (0700).
                    key, sent, received, mac = sealed
                    tier_state["seal"] = {"key": key.hex(), "sent": sent, "received": received, "mac": mac}
            else:
                blobs, tier_state = self.save_files(room), {}
            snapshot = op.store.save(
                kind=SnapshotKind.MEMORY if memory else SnapshotKind.FILES,
                tier=self.tier,
                source=self.id,
                spec=spec_state(self.spec),
                blobs=blobs,
                tier_state=tier_state,
                ref=("paused", self.id) if isinstance(op, Pause) else ("kept", ""),
            )
        if isinstance(op, Pause):
            self.close()
        return snapshot

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        with self._gate:
            while self._frozen:
                self._gate.wait()
            self._frozen = True
            try:
                while self._active:
                    self._gate.wait()
            except BaseException:
                self._frozen = False
                self._gate.notify_all()
                raise
        try:
            yield
        finally:
            with self._gate:
                self._frozen = False
                self._gate.notify_all()

    def save_files(self, room: Reservation) -> dict[str, str]:
        """The workspace and /tmp, each a tar object of the store, streamed from the sandbox
        into the ``room`` reserved for them: a chunk that would not fit ends the snapshot
        (``SnapshotStoreFull``) before it is written, and nothing of it stays."""
        digests: dict[str, str] = {}
        with contextlib.ExitStack() as files:
            paths: dict[str, Path] = {}
            for area in ("workspace", "tmp"):
                path, write = files.enter_context(room.open(area))
                digest = hashlib.sha256()

                def sink(_: int, chunk: bytes, write: Any = write, digest: Any = digest) -> None:
                    write(chunk)  # the host's cap: the sandbox's own check is only a courtesy
                    digest.update(chunk)

                # Both areas share the room left, and neither may keep more than its own size:
                # a restore writes the files whole (a sparse file's holes too) into a tmpfs of
                # that size. The supervisor refuses a tree whose file contents, by apparent
                # size, pass the cap, as soon as its walk sees the file.
                own = self._area_bytes(area)
                left = room.room()
                cap = min(own, left)
                try:
                    op = GetArchive(
                        area=area, max_bytes=cap, max_entries=SNAPSHOT_MAX_ENTRIES, refuse_deep=True
                    )
                    self.files.get_archive(op, sink)
                except exc.FileTooLarge as error:
                    raise self._too_large(
                        area, str(error), store_room=own > left, cap=cap, room=room
                    ) from None
                paths[area], digests[area] = path, digest.hexdigest()
            # Into the objects only once both are whole: a refused /tmp leaves no workspace behind.
            return {area: room.store.add_file(paths[area], digest=digests[area]) for area in paths}

    def _too_large(
        self, area: Area, said: str, *, store_room: bool, cap: int, room: Reservation
    ) -> exc.SnapshotError:
        """What a snapshot refused by the supervisor's cap on ``area``'s archive raises:
        ``store_room``, whether that cap was the store's room left (else the area's own size).
        Only a refusal of bytes the store has no room for is the store's; too many entries is
        no room's fault (``PathTooLong``, ``TreeTooDeep`` are no ``FileTooLarge`` at all)."""
        # The supervisor's words are a download's ("cannot download '/workspace': ...; pass a
        # larger max_bytes"): only what it found is said.
        found = said.split(": ", 1)[-1].split("; pass a larger", 1)[0]
        if "max_bytes" not in found:
            return exc.SnapshotIncompatible(
                f"cannot snapshot sandbox {self.id}: its {area} is past what a snapshot takes: {found}"
            )
        if not store_room:
            return exc.SnapshotIncompatible(
                f"cannot snapshot sandbox {self.id}: its {area}'s files are larger than "
                f"the {area} itself ({self._area_setting(area)}), so no restore could put "
                f"them back: {found} (a sparse file counts whole: a snapshot keeps its "
                "holes as bytes); remove or shrink that file and snapshot again"
            )
        return exc.SnapshotStoreFull(
            f"the sandbox's {area} does not fit the snapshot store (room for {cap // (1 << 20)} "
            f"MiB of its {room.store.max_bytes // (1 << 20)} MiB; STOCKADE_SNAPSHOT_MAX_MB "
            f"raises it): {found}"
        )

    def _area_bytes(self, area: Area) -> int:
        """The size of the sandbox's tmpfs at ``area``: all its files can ever take."""
        limits = self.spec.limits
        return (limits.workspace_mb if area == "workspace" else limits.tmp_size_mb) << 20

    def _area_setting(self, area: Area) -> str:
        limits = self.spec.limits
        return f"disk_mb={limits.workspace_mb}" if area == "workspace" else f"tmp_mb={limits.tmp_size_mb}"

    def _area_files(self, area: Area) -> str:
        limits = self.spec.limits
        if area == "workspace":
            return f"inodes={limits.workspace_inodes}"
        return f"{limits.scratch_inodes} files, an eighth of inodes={limits.workspace_inodes}"

    def reseed(self, resumed: dict[str, Any] | None = None) -> None:
        """First thing in a sandbox restored from a memory snapshot: the interpreter's next run
        draws new seeds for the generators in its memory (Python reseeds them at a fork; a
        restore is none), so forks of one snapshot do not repeat each other's numbers.
        ``resumed``: what of its configuration the snapshot was made without (a microVM's ready
        image): ``env``, its whole environment; ``egress``, its relay (in the same request)."""
        self.files.request("reseed", dict(resumed or {}))

    def seed(self, snapshot: Snapshot) -> None:
        """Put a snapshot's files (workspace, /tmp) into this fresh sandbox, streamed a chunk
        at a time and hashed on the way: the host's memory stays a few MiB whatever the
        objects' size, and an object is moved into place inside only once it hashed to its
        name. Any failure leaves the sandbox to be closed (``start``): never handed out.

        The workspace comes back under this sandbox's rules, not the snapshot's: what they
        hide or do not let the run read stays out, as it stays out of a folder uploaded (a
        policy that hides more since the snapshot was taken hides it from the restore too)."""
        store = SnapshotStore(Path(snapshot.store))
        manifest = store.load(snapshot)
        missing = [a for a in ("workspace", "tmp") if a not in manifest.blobs]
        if missing:
            raise exc.SnapshotIncompatible(
                f"snapshot {snapshot.id} keeps the {snapshot.tier} tier's memory, not files: "
                f"restore it on the {snapshot.tier} tier"
            )
        from stockade._globs import unpack_filter

        rules = self.spec.rules
        keep = unpack_filter(rules.hide, rules.read, {".git", *VCS_FOLDERS}) if rules else None
        self._restore_area(snapshot, store, "workspace", manifest.blobs["workspace"], keep)
        self._restore_area(snapshot, store, "tmp", manifest.blobs["tmp"], None)

    def _restore_area(
        self, snapshot: Snapshot, store: SnapshotStore, area: Area, digest: str, keep: RestoreFilter
    ) -> None:
        chunks = store.stream_object(digest, TRANSFER_CHUNK)
        try:
            # closed here: a refusal's traceback keeps the suspended stream, its file open, alive
            with contextlib.closing(chunks):
                skipped = self.files.put_stream(area, chunks, keep=keep)
        except exc.SnapshotCorrupt:
            raise
        except exc.StockadeError as error:
            # What the sandbox refused may be a corrupt object's doing (a header claiming a
            # huge file): the object is checked (its verified stamp, else hashed) first.
            store.check_object(digest)
            if not isinstance(error, exc.WorkspaceFull):
                raise
            found = str(error).removeprefix("put_archive '': ")
            if " entries " in found:  # unpack.py: its files outnumber what the place can hold
                what, room, fields = "holds more files than", self._area_files(area), "inodes"
            else:
                what, room, fields = "is larger than", self._area_setting(area), "disk_mb or tmp_mb"
            raise exc.SnapshotIncompatible(
                f"snapshot {snapshot.id} does not fit this sandbox: its {area} {what} the "
                f"sandbox's ({room}): {found}; create it with Limits that hold the snapshot's files "
                f"(memory_mb, and {fields})"
            ) from None
        if skipped:  # what a download leaves out too: no workspace content, never restored
            named = ", ".join(f"{e.path!r} ({e.kind})" for e in skipped[:10])
            more = f" and {len(skipped) - 10} more" if len(skipped) > 10 else ""
            log.warning("snapshot %s: its %s came back without %s%s", snapshot.id, area, named, more)
