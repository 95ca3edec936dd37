"""Erasing runs: by run, by data subject (``tag_subject``, ``runs_of``) or by age.

A subject's right to erasure, a retention period: ``erase`` removes every row of the runs,
and the workspace contents and seeds that no other run shares. The audit trail is another
store: erasing runs leaves its chain as it was, so it still verifies.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from stockade import exceptions as exc
from stockade.agent.state import RunStatus
from stockade.runs._db import Database, Statement
from stockade.runs._schema import RUN_TABLES, as_int
from stockade.runs.workspace import decode_entry

__all__ = ["Erasure"]


class Erasure:
    """The ``<namespace>_subjects`` table, and the deletion of runs' rows."""

    def __init__(self, db: Database, ns: str) -> None:
        self.db = db
        self.ns = ns

    def tag_subject(self, run_id: str, subject: str) -> None:
        """Record that the run holds personal data of ``subject`` (erase it with ``runs_of``)."""
        if not subject:
            raise exc.ConfigurationError("a data subject needs a name or an id")
        self.db.write(
            [
                (
                    f"INSERT INTO {self.ns}_subjects VALUES (?, ?) ON CONFLICT (run_id, subject) DO NOTHING",
                    [(run_id, subject)],
                )
            ]
        )

    def runs_of(self, *, subject: str | None = None, before_ns: int | None = None) -> list[str]:
        """The runs of a data subject, and/or the runs last updated before ``before_ns``."""
        if subject is None and before_ns is None:
            raise exc.ConfigurationError("say whose runs (subject) or up to when (before_ns)")
        sql = f"SELECT r.run_id FROM {self.ns}_runs r WHERE 1 = 1"
        params: list[object] = []
        if subject is not None:
            sql += f" AND r.run_id IN (SELECT run_id FROM {self.ns}_subjects WHERE subject = ?)"
            params.append(subject)
        if before_ns is not None:
            sql += " AND r.updated_ns < ?"
            params.append(before_ns)
        return [str(row[0]) for row in self.db.query(sql + " ORDER BY r.run_id", params)]

    def erase(self, runs: Sequence[str]) -> int:
        """Remove every row of ``runs`` (distinct ids, none empty), and the workspace contents
        and seeds that no other run shares; returns the runs erased. A run still running is
        refused (``RunConflict``): sweep the runs whose owner is gone first."""
        ns = self.ns
        marks = ",".join("?" * len(runs))
        self.refuse_running(runs)
        blobs = {
            decode_entry(str(body)).digest
            for (body,) in self.db.query(
                f"SELECT body FROM {ns}_workspace WHERE body IS NOT NULL AND run_id IN ({marks})", runs
            )
        }
        seeds = {
            str(d)
            for (d,) in self.db.query(f"SELECT digest FROM {ns}_run_seeds WHERE run_id IN ({marks})", runs)
        }
        found = self.db.query(f"SELECT COUNT(*) FROM {ns}_runs WHERE run_id IN ({marks})", runs)
        statements: list[Statement] = [
            (f"DELETE FROM {ns}_{table} WHERE run_id IN ({marks})", [runs]) for table in RUN_TABLES
        ]
        now = time.time_ns()
        keep_ids = f"INSERT INTO {ns}_erased VALUES (?, ?) ON CONFLICT (run_id) DO NOTHING"
        statements.append((keep_ids, [(r, now) for r in runs]))
        self.db.write(statements)
        self.db.write([st for st in self._unshared(blobs - {""}, seeds) if st[1]])
        return as_int(found[0][0]) if found else 0

    def refuse_running(self, runs: Sequence[str]) -> None:
        """``RunConflict`` when one of ``runs`` is still running (sweep the dead ones first)."""
        marks = ",".join("?" * len(runs))
        live = self.db.query(
            f"SELECT run_id FROM {self.ns}_runs WHERE status = ? AND run_id IN ({marks})",
            [RunStatus.RUNNING.value, *runs],
        )
        if live:
            raise exc.RunConflict(f"run {live[0][0]} is running: stop it before erasing it")

    def _unshared(self, blobs: set[str], seeds: set[str]) -> list[Statement]:
        """Deletions of the contents and seeds (of erased runs) that no run refers to any more.

        Another run may take one meanwhile (the same file, the same starting folder): it counts
        the take (``uses``) in the transaction that refers to it, and each deletion holds only
        while the count is what was read here and no row refers to it, checked by the DELETE
        itself. A take that comes after the deletion finds the content gone, and stores it
        again (``WorkspaceHistory._bring_back``; a seed is written with its data each time)."""
        ns = self.ns

        def uses(table: str, digests: set[str]) -> list[tuple[str, int]]:
            return [
                (str(d), as_int(n))
                for digest in sorted(digests)
                for d, n in self.db.query(
                    f"SELECT digest, uses FROM {ns}_{table} WHERE digest = ?", (digest,)
                )
            ]

        return [
            (
                f"DELETE FROM {ns}_blobs WHERE digest = ? AND uses = ? "
                f"AND NOT EXISTS (SELECT 1 FROM {ns}_workspace WHERE body LIKE ?)",
                [(d, n, f'%"{d}"%') for d, n in uses("blobs", blobs)],
            ),
            (
                f"DELETE FROM {ns}_seeds WHERE digest = ? AND uses = ? "
                f"AND NOT EXISTS (SELECT 1 FROM {ns}_run_seeds WHERE digest = ?)",
                [(d, n, d) for d, n in uses("seeds", seeds)],
            ),
        ]
