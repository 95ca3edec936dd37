"""``ServiceStore``: the service's tables in one database, made (and migrated) when it opens.

It is composed of one part per concern, each in its own module: runs and what a tenant keeps
(``runs``, ``storage``), quota shares (``quotas``), API processes and placements
(``placement``) and keys (``keys``); callers see one store, as every part shares its
database and namespace.
"""

from __future__ import annotations

import functools

from stockade.runs._db import Database, octets
from stockade.runs._schema import run_bytes_sql
from stockade.server.state.keys import KeyTables
from stockade.server.state.placement import PlacementTables
from stockade.server.state.quotas import QuotaTables
from stockade.server.state.rows import as_int
from stockade.server.state.runs import RunTables
from stockade.server.state.schema import migrate_workspaces, schema


class ServiceStore(RunTables, QuotaTables, PlacementTables, KeyTables):
    """The service's tables in ``db`` (``<ns>_*``). ``runs``: the namespace of the run store
    in the same database, whose rows of a run are measured each time the run stops (counted in
    its tenant's ``storage_mb``); None where nothing runs (the run store's tables may not be)."""

    def __init__(self, db: Database, *, namespace: str = "svc", runs: str | None = None) -> None:
        self.db = db
        self.ns = namespace
        self.db.create(schema(namespace, db.blob), name=namespace)
        migrate_workspaces(db, namespace)
        # the role that took a snapshot (NULL: a token without one, or taken before they said)
        self.db.add_column(f"{namespace}_snapshots", "role", "TEXT")
        self._measure = None if runs is None else run_bytes_sql(runs, functools.partial(octets, db))

    # -- audit (read) ------------------------------------------------------------------------

    def audit_rows(
        self, namespace: str, run_id: str, after_seq: int, limit: int = 500
    ) -> list[tuple[int, str, str]]:
        """A tenant's audit events of one run after ``after_seq``: (seq, kind, body). Read
        here, on the service's connection, rather than by the audit store's reader, which
        opens a connection per call: an event stream polls."""
        rows = self.db.query(
            f"SELECT seq, kind, body FROM {namespace}_events WHERE run_id = ? AND seq > ? "
            "ORDER BY seq LIMIT ?",
            (run_id, after_seq, limit),
        )
        return [(as_int(r[0]), str(r[1]), str(r[2])) for r in rows]

    def audit_last_seq(self, namespace: str, run_id: str, after_seq: int) -> int | None:
        """The newest ``seq`` of a run's audit events past ``after_seq`` (None: none came):
        what a live page polls, one row read by the run's index however many came."""
        rows = self.db.query(
            f"SELECT MAX(seq) FROM {namespace}_events WHERE run_id = ? AND seq > ?", (run_id, after_seq)
        )
        return None if not rows or rows[0][0] is None else as_int(rows[0][0])

    def close(self) -> None:
        self.db.close()
