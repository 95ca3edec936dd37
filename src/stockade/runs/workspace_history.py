"""The recorded workspaces of the runs: versions of each run's workspace, and its seed.

After a tool call, ``record`` writes what changed in the workspace (rows of
``<namespace>_workspace``, contents in ``<namespace>_blobs``, named by SHA-256 and
compressed) in one transaction with the call's ledger row; ``restore`` puts the last recorded
version into a resumed run's sandbox, ``export`` into a folder on the host. A run's seed is
the folder it started from (``seeds``). See ``workspace`` for how a change is found.

What a run's versions added to ``<namespace>_blobs`` is the sum of its rows' ``blob_bytes``
(each new content counted once, compressed), capped by ``max_run_bytes``: a process that
continues a run (a resume, another worker) takes the count from there, not from memory.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

from stockade import exceptions as exc
from stockade.agent.state import ToolCallRecord
from stockade.runs._db import Database, Statement
from stockade.runs._mac import select
from stockade.runs._schema import as_int
from stockade.runs.checkpoints import Checkpoints
from stockade.runs.handback import Exported, FileState, SeedFiles, withheld
from stockade.runs.records import WorkspaceUsage
from stockade.runs.seeds import pack_workspace, seed_files, unpack_seed
from stockade.runs.workspace import Entry, Scan, WorkspaceTracker, decode_entry, relative_path, restore
from stockade.sandbox.facade import Sandbox
from stockade.sandbox.ops import ReadFile

__all__ = ["WorkspaceHistory"]


class WorkspaceHistory:
    """The ``<namespace>_workspace``, ``_blobs``, ``_seeds`` and ``_run_seeds`` tables, and the
    last recorded state of each run this process records (its ``WorkspaceTracker``)."""

    def __init__(
        self,
        db: Database,
        ns: str,
        checkpoints: Checkpoints,
        *,
        max_bytes: int,
        max_entries: int,
        max_run_bytes: int,
        where: str,
    ) -> None:
        self.db = db
        self.ns = ns
        self.checkpoints = checkpoints  # a call's ledger row is written with its workspace
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.max_run_bytes = max_run_bytes
        self._where = where
        self._lock = threading.Lock()
        self._trackers: dict[str, WorkspaceTracker] = {}

    def start(self, run_id: str) -> None:
        """A new run: its workspace has no recorded state yet."""
        with self._lock:
            self._trackers[run_id] = self._new_tracker()

    def forget(self, run_id: str) -> None:
        with self._lock:
            self._trackers.pop(run_id, None)

    def _new_tracker(self) -> WorkspaceTracker:
        return WorkspaceTracker(
            max_bytes=self.max_bytes, max_entries=self.max_entries, max_run_bytes=self.max_run_bytes
        )

    def _tracker(self, run_id: str) -> WorkspaceTracker:
        tracker = self._trackers.get(run_id)
        if tracker is None:  # a run this process did not start or restore: continue from the store
            entries, version = self._stored(run_id)
            tracker = self._trackers[run_id] = self._new_tracker()
            tracker.entries, tracker.version = entries, version
            tracker.kept_bytes = self.usage(run_id).blob_bytes
        return tracker

    def record(self, run_id: str, sandbox: Sandbox, *, call: tuple[int, ToolCallRecord] | None = None) -> int:
        """Record what changed in the workspace since the last record, and with it, in the same
        transaction, the call (step, record) that changed it; returns the workspace's version."""
        tracker = self._tracker(run_id)
        scan = tracker.scan(sandbox, known=self._known_blob)
        version = tracker.version + 1 if scan.changed else tracker.version
        now = time.time_ns()
        # a new content's bytes on the first path that holds it: the rows sum to what was added
        added: dict[str, int] = {}
        counted: set[str] = set()
        for path, e in sorted(scan.changes.items()):
            digest = "" if e is None else e.digest
            first = digest in scan.blobs and digest not in counted
            added[path] = len(scan.blobs[digest].data) if first else 0
            counted.add(digest)
        # Contents this version takes from the store instead of bringing them: counted as
        # taken in its transaction, so that an erasure that looked before keeps them.
        taken = sorted(
            {
                e.digest
                for e in scan.changes.values()
                if e is not None and e.digest and e.digest not in scan.blobs
            }
        )
        statements: list[Statement] = [
            (
                f"INSERT INTO {self.ns}_blobs (digest, bytes, data, uses) VALUES (?, ?, ?, 1) "
                f"ON CONFLICT (digest) DO UPDATE SET uses = {self.ns}_blobs.uses + 1",
                [(digest, packed.size, packed.data) for digest, packed in scan.blobs.items()],
            ),
            (f"UPDATE {self.ns}_blobs SET uses = uses + 1 WHERE digest = ?", [(d,) for d in taken]),
            (
                f"INSERT INTO {self.ns}_workspace VALUES (?, ?, ?, ?, ?, ?)",
                [
                    self.checkpoints.mac.signed(
                        "workspace", (run_id, version, path, None if e is None else e.encode(), added[path])
                    )
                    for path, e in sorted(scan.changes.items())
                ],
            ),
        ]
        self.checkpoints.write_with_call(
            run_id, statements, call, now=now, then=lambda: tracker.commit(scan, version)
        )
        if taken:
            self._bring_back(sandbox, scan, taken)
        return version

    def _bring_back(self, sandbox: Sandbox, scan: Scan, taken: list[str]) -> None:
        """Store again the contents a version took from the store that an erasure deleted
        before the version was written (it had found no run using them), read from the
        sandbox once more. One rewritten meanwhile is the next version's to record."""
        marks = ",".join("?" * len(taken))
        have = {
            str(d)
            for (d,) in self.db.query(f"SELECT digest FROM {self.ns}_blobs WHERE digest IN ({marks})", taken)
        }
        for digest in sorted(set(taken) - have):
            path, entry = next(
                (p, e) for p, e in scan.changes.items() if e is not None and e.digest == digest
            )
            try:
                data = sandbox.instance.execute(ReadFile(path=path, max_bytes=entry.size + 1))
            except exc.SandboxFileNotFound:
                continue
            if hashlib.sha256(data).hexdigest() == digest:
                self.db.write(
                    [
                        (
                            f"INSERT INTO {self.ns}_blobs (digest, bytes, data, uses) VALUES (?, ?, ?, 1) "
                            f"ON CONFLICT (digest) DO UPDATE SET uses = {self.ns}_blobs.uses + 1",
                            [(digest, len(data), zlib.compress(data, 6))],
                        )
                    ]
                )

    def _known_blob(self, digest: str) -> bool:
        return bool(self.db.query(f"SELECT 1 FROM {self.ns}_blobs WHERE digest = ?", (digest,)))

    def _stored(self, run_id: str) -> tuple[dict[str, Entry], int]:
        rows = self.db.query(
            f"{select(self.ns, 'workspace')} WHERE run_id = ? ORDER BY version, path", (run_id,)
        )
        # a path -> digest row is what a restore writes: a forged one would swap the workspace
        self.checkpoints.mac.check(self.ns, "workspace", rows, store=self._where)
        entries: dict[str, Entry] = {}
        version = 0
        for _, row_version, path, body, *_ in rows:
            version = as_int(row_version)
            if body is None:
                entries.pop(str(path), None)
                continue
            try:
                entries[str(path)] = decode_entry(str(body))
            except (ValueError, TypeError) as error:
                raise exc.RunStoreCorrupt(
                    f"run store {self._where}: the {self.ns}_workspace row (run {run_id!r}, version "
                    f"{version}, path {str(path)!r}) cannot be read: {error}"
                ) from None
        return entries, version

    def _blob(self, digest: str) -> bytes:
        rows = self.db.query(f"SELECT data FROM {self.ns}_blobs WHERE digest = ?", (digest,))
        what = f"run store {self._where}: the {self.ns}_blobs row {digest[:16]}…"
        if not rows:
            raise exc.RunStoreCorrupt(f"{what} is missing: the workspace cannot be restored")
        raw = rows[0][0]
        try:
            data = zlib.decompress(bytes(raw) if isinstance(raw, bytes | bytearray | memoryview) else b"")
        except zlib.error as error:
            raise exc.RunStoreCorrupt(f"{what} cannot be unpacked: {error}") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise exc.RunStoreCorrupt(f"{what} does not hold the content its digest names")
        return data

    def restore(self, run_id: str, sandbox: Sandbox) -> bool:
        """Make the workspace of ``sandbox`` the run's last recorded one (whatever it held);
        ``False`` when none was recorded (the sandbox is left as it is)."""
        entries, version = self._stored(run_id)
        if version == 0:
            return False
        # this process recorded it last: if the sandbox still holds it (a pause, resumed in the
        # same session), nothing needs writing
        known = self._trackers.get(run_id)
        if known is not None and known.version == version and known.entries == entries:
            try:
                if not known.scan(sandbox, known=self._known_blob).changed:
                    return True
            except exc.SeedTooLarge:
                pass  # it changed past a cap since: written back below
        listing = restore(sandbox, entries, self._blob)
        tracker = self._new_tracker()
        tracker.restored(entries, version, listing, kept_bytes=self.usage(run_id).blob_bytes)
        with self._lock:
            self._trackers[run_id] = tracker
        return True

    def export(self, run_id: str, dest: str | Path, *, keep: Callable[[str], bool] | None = None) -> Exported:
        """Write the run's last recorded workspace into ``dest``, a new folder on the host, but
        what a copy on the host leaves out (``runs.handback``: a repository's command files the
        run did not start with, changes ``keep``, the policy's hands_back, refuses); returns what
        was written and left out. ``ConfigurationError`` when ``dest`` exists or the run
        recorded no workspace."""
        entries, version = self._stored(run_id)
        if version == 0:
            raise exc.ConfigurationError(f"run {run_id!r} recorded no workspace in {self._where}")
        files = {
            p: FileState.of_mode(e.digest, e.mode)
            for p, e in entries.items()
            if e.kind == "file" and relative_path(p)
        }
        folders = [p for p, e in entries.items() if e.kind == "dir"]
        left = withheld(files, folders, seed=self.seed_files(run_id), keep=keep)
        skipped = {*left.commands, *left.refused}
        root = Path(dest)
        try:
            root.mkdir(parents=True)
        except FileExistsError:
            raise exc.ConfigurationError(f"{root} exists: give a new folder") from None
        written = 0
        for path in sorted(p for p in entries if relative_path(p)):  # parents sort before children
            entry, target = entries[path], root / path
            if entry.kind == "unnamed" or path in skipped:
                continue  # named by what is returned, never written (nor under another name)
            if entry.kind == "dir":
                target.mkdir(mode=0o700, exist_ok=True)
                continue
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # the folder is new and only this writes in it: no link can be there to follow
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, entry.mode & 0o755)
            with os.fdopen(fd, "wb") as out:
                out.write(self._blob(entry.digest))
            written += 1
        unnamed = tuple(sorted(p for p, e in entries.items() if e.kind == "unnamed"))
        return Exported(files=written, withheld=left, unnamed=unnamed)

    def unnamed(self, run_id: str) -> list[str]:
        """The paths of the run's last recorded workspace whose names are not UTF-8 (shown with
        U+FFFD): listed, never kept, so ``export`` leaves them out."""
        entries, _ = self._stored(run_id)
        return sorted(p for p, e in entries.items() if e.kind == "unnamed")

    def usage(self, run_id: str) -> WorkspaceUsage:
        rows = self.db.query(
            "SELECT COUNT(DISTINCT version), COUNT(*), COALESCE(SUM(blob_bytes), 0) "
            f"FROM {self.ns}_workspace WHERE run_id = ?",
            (run_id,),
        )
        versions, count, blob_bytes = rows[0] if rows else (0, 0, 0)
        return WorkspaceUsage(versions=as_int(versions), rows=as_int(count), blob_bytes=as_int(blob_bytes))

    # -- seeds: the folder a run started from ----------------------------------------------------

    def save_seed(
        self,
        run_id: str,
        workspace: str | Path,
        *,
        max_bytes: int,
        hide: Sequence[str] = (),
        read: Sequence[str] = ("**",),
    ) -> str:
        """Keep the folder ``workspace`` (what ``read`` names, but what ``hide`` names) as the
        run's starting workspace; returns its digest.

        ``SeedTooLarge`` past ``max_bytes``. A run keeps its first seed (a resumed run does
        not replace where it started)."""
        seed = pack_workspace(workspace, max_bytes=max_bytes, hide=hide, read=read)
        self.db.write(
            [
                (  # taken again: an erasure that looked before keeps it, or it is stored anew
                    f"INSERT INTO {self.ns}_seeds (digest, bytes, data, uses) VALUES (?, ?, ?, 1) "
                    f"ON CONFLICT (digest) DO UPDATE SET uses = {self.ns}_seeds.uses + 1",
                    [(seed.digest, len(seed.data), seed.data)],
                ),
                (
                    f"INSERT INTO {self.ns}_run_seeds VALUES (?, ?, ?, ?) ON CONFLICT (run_id) DO NOTHING",
                    [self.checkpoints.mac.signed("run_seeds", (run_id, seed.digest, time.time_ns()))],
                ),
            ]
        )
        return seed.digest

    def _seed_data(self, run_id: str) -> bytes | None:
        """The run's packed starting workspace; None when none was kept."""
        seeds = self.db.query(f"{select(self.ns, 'run_seeds')} WHERE run_id = ?", (run_id,))
        self.checkpoints.mac.check(self.ns, "run_seeds", seeds, store=self._where)
        rows = self.db.query(
            f"SELECT data FROM {self.ns}_seeds WHERE digest = ?", (seeds[0][1],) if seeds else ("",)
        )
        if not rows:
            return None
        raw = rows[0][0]
        data = bytes(raw) if isinstance(raw, bytes | bytearray | memoryview) else b""
        if "sha256:" + hashlib.sha256(data).hexdigest() != seeds[0][1]:  # named by its content
            raise exc.RunStoreCorrupt(
                f"run store {self._where}: the {self.ns}_seeds row {str(seeds[0][1])[:23]}… does not hold "
                "the content its digest names"
            )
        return data

    def restore_seed(self, run_id: str, dest: str | Path) -> bool:
        """Unpack the run's starting workspace into ``dest``; ``False`` when none was kept."""
        data = self._seed_data(run_id)
        if data is None:
            return False
        unpack_seed(data, dest)
        return True

    def seed_files(self, run_id: str) -> SeedFiles:
        """The files the run started with (digest, executable bit) and what their repositories'
        config names as commands; empty when no seed was kept."""
        data = self._seed_data(run_id)
        return SeedFiles() if data is None else seed_files(data)
