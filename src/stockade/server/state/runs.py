"""The service's runs: who submitted each, what it asked for and where it is (``<ns>_runs``),
its quota of active runs, its failed attempts, its artifacts, and forgetting it.

A part of ``ServiceStore``, built on what a tenant keeps (``storage``): a run's spec and
artifacts count against its ``storage_mb``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from stockade import exceptions as exc
from stockade.runs._db import Statement
from stockade.server.state.rows import (
    ACTIVE,
    QUEUED,
    TERMINAL,
    WAITING,
    RunRow,
    as_bytes,
    as_int,
    role_key,
)
from stockade.server.state.storage import StorageTables
from stockade.server.wakes import RESEND_S, START_GRACE_S, wake_statement

_RUN_COLUMNS = (
    "run_id, tenant, role, spec, status, error, labels, submitted_ns, started_ns, finished_ns, attempts, "
    "worker"
)


def _run(row: tuple[object, ...]) -> RunRow:
    return RunRow(
        run_id=str(row[0]),
        tenant=str(row[1]),
        role=None if row[2] is None else str(row[2]),
        spec=json.loads(str(row[3])),
        status=str(row[4]),
        error=None if row[5] is None else str(row[5]),
        labels=json.loads(str(row[6])),
        submitted_ns=as_int(row[7]),
        started_ns=None if row[8] is None else as_int(row[8]),
        finished_ns=None if row[9] is None else as_int(row[9]),
        attempts=as_int(row[10]),
        worker=None if row[11] is None else str(row[11]),
    )


class RunTables(StorageTables):
    """The tables of runs (``<ns>_runs``, ``<ns>_tries``, ``<ns>_artifacts``); a run's status
    also frees its quota share (``<ns>_holds``) and sets its wake (``<ns>_wakes``)."""

    # (the run store's rows of a run in SQL, and how many ``?`` it holds), None where nothing runs
    _measure: tuple[str, int] | None

    # -- runs ---------------------------------------------------------------------------

    def add_run(
        self, *, run_id: str, tenant: str, role: str | None, spec: dict[str, object], labels: dict[str, str],
        max_active: int, idem_key: str | None = None, max_bytes: int | None = None,
    ) -> bool:  # fmt: skip
        """Record a submitted run, if the tenant has fewer than ``max_active`` runs queued or
        running; False when it has (nothing written). ``RunConflict`` when the id is taken.
        Its spec counts against the tenant's storage: ``QuotaExceeded`` when it would take what
        the tenant keeps past ``max_bytes`` (None: not checked; the API always gives it)."""
        ns, now = self.ns, time.time_ns()
        if self.run(run_id) is not None:
            raise exc.RunConflict(f"a run {run_id!r} exists already")
        active = ACTIVE
        text = json.dumps(spec)  # ASCII: its length is its size
        size, cap = len(text), max_bytes if max_bytes is not None else 2**62
        statements = [
            (f"INSERT INTO {ns}_tenants VALUES (?) ON CONFLICT (tenant) DO NOTHING", [(tenant,)]),
        ]
        self.db.write(statements)
        self.db.write(
            [
                (
                    f"INSERT INTO {ns}_runs ({_RUN_COLUMNS}, idem_key) "
                    "SELECT ?, ?, ?, ?, ?, NULL, ?, ?, NULL, NULL, 0, NULL, ? "
                    f"WHERE (SELECT COUNT(*) FROM {ns}_runs WHERE tenant = ? AND status IN {active}) < ? "
                    f"AND {self._stored()} + ? <= ? ON CONFLICT DO NOTHING",
                    [
                        (
                            run_id, tenant, role, text, QUEUED, json.dumps(labels), now, idem_key,
                            tenant, max_active, *self._stored_params(tenant), size, cap,
                        )
                    ],
                ),
                (
                    f"INSERT INTO {ns}_run_bytes SELECT ?, ?, ?, 0 "
                    f"WHERE EXISTS (SELECT 1 FROM {ns}_runs WHERE run_id = ?) "
                    "ON CONFLICT (run_id) DO NOTHING",
                    [(run_id, tenant, size, run_id)],
                ),
                # its wake, with it: a run whose message was never sent (the process died
                # between this commit and the send) is sent by a waker all the same
                (
                    f"INSERT INTO {ns}_wakes SELECT ?, ?, 0 "
                    f"WHERE EXISTS (SELECT 1 FROM {ns}_runs WHERE run_id = ?) "
                    "ON CONFLICT (run_id) DO NOTHING",
                    [(run_id, now + int(RESEND_S * 1e9), run_id)],
                ),
            ],
            require=(f"SELECT 1 FROM {ns}_tenants WHERE tenant = ?", (tenant,)),
        )  # fmt: skip
        row = self.run(run_id)
        if row is None:
            if idem_key is not None and self.run_by_key(tenant, role, idem_key) is not None:
                raise exc.RunConflict(
                    f"a run with idempotency key {idem_key!r} was submitted at the same time"
                )
            if self.stored_bytes(tenant) + size > cap:
                raise self._storage_full(tenant, size, cap, what="this run's spec")
            return False
        return True

    def withdraw_run(self, run_id: str) -> bool:
        """Remove a run just added that never started (its message could not be sent): as if
        it had not been submitted; False when it started meanwhile (nothing removed)."""
        ns = self.ns
        return self.db.write(
            [
                (f"DELETE FROM {ns}_{table} WHERE run_id = ?", [(run_id,)])
                for table in ("run_bytes", "wakes", "tries", "runs")
            ],
            require=(
                f"SELECT 1 FROM {ns}_runs WHERE run_id = ? AND status = ? AND attempts = 0",
                (run_id, QUEUED),
            ),
        )

    def queued_count(self, tenant: str) -> int:
        """How many of the tenant's runs are queued (waiting for room, a window, a worker)."""
        rows = self.db.query(
            f"SELECT COUNT(*) FROM {self.ns}_runs WHERE tenant = ? AND status = ?", (tenant, QUEUED)
        )
        return int(str(rows[0][0])) if rows else 0

    def count_failed(self, run_id: str) -> int:
        """One more failed attempt of the run (its worker died, a retryable error): how many now."""
        table = f"{self.ns}_tries"
        self.db.write(
            [
                (
                    f"INSERT INTO {table} VALUES (?, 1) "
                    f"ON CONFLICT (run_id) DO UPDATE SET failed = {table}.failed + 1",
                    [(run_id,)],
                )
            ]
        )
        rows = self.db.query(f"SELECT failed FROM {table} WHERE run_id = ?", (run_id,))
        return int(str(rows[0][0])) if rows else 0

    def run_by_key(self, tenant: str, role: str | None, idem_key: str) -> RunRow | None:
        """The run the tenant's ``role`` submitted with ``idem_key`` (each role's keys are its own)."""
        rows = self.db.query(
            f"SELECT {_RUN_COLUMNS} FROM {self.ns}_runs "
            "WHERE tenant = ? AND COALESCE(role, '') = ? AND idem_key = ?",
            (tenant, role_key(role), idem_key),
        )
        return _run(rows[0]) if rows else None

    def run(self, run_id: str) -> RunRow | None:
        rows = self.db.query(f"SELECT {_RUN_COLUMNS} FROM {self.ns}_runs WHERE run_id = ?", (run_id,))
        return _run(rows[0]) if rows else None

    def run_head(self, run_id: str) -> RunRow | None:
        """The run without its spec (``spec`` empty): what a run waiting for its turn looks at
        each time it asks, without reading and parsing a spec of up to the request cap again."""
        columns = _RUN_COLUMNS.replace("spec,", "'{}',", 1)
        rows = self.db.query(f"SELECT {columns} FROM {self.ns}_runs WHERE run_id = ?", (run_id,))
        return _run(rows[0]) if rows else None

    def run_spec(self, run_id: str) -> dict[str, object] | None:
        rows = self.db.query(f"SELECT spec FROM {self.ns}_runs WHERE run_id = ?", (run_id,))
        return json.loads(str(rows[0][0])) if rows else None

    def runs(
        self, tenant: str, *, status: str | None = None, label: tuple[str, str] | None = None,
        limit: int = 50, before_ns: int | None = None, roles: tuple[str | None] | None = None,
    ) -> list[RunRow]:  # fmt: skip
        """The tenant's runs, newest first; ``roles``: only those submitted under that role
        (``(None,)``: by a token without one), else every role's."""
        sql = f"SELECT {_RUN_COLUMNS} FROM {self.ns}_runs WHERE tenant = ?"
        params: list[object] = [tenant]
        if roles is not None:
            (role,) = roles
            sql += " AND role IS NULL" if role is None else " AND role = ?"
            params += [] if role is None else [role]
        if status is not None:
            sql += " AND status = ?"
            params.append(status)
        if before_ns is not None:
            sql += " AND submitted_ns < ?"
            params.append(before_ns)
        # labels are filtered here: a JSON column has no portable index
        rows = self.db.query(
            sql + " ORDER BY submitted_ns DESC LIMIT ?", [*params, limit * (20 if label else 1)]
        )
        found = [_run(r) for r in rows]
        if label is not None:
            found = [r for r in found if r.labels.get(label[0]) == label[1]]
        return found[:limit]

    def set_status(
        self, run_id: str, status: str, *, error: str | None = None, worker: str | None = None,
        started: bool = False, only_from: Sequence[str] | None = None,
        within: tuple[str, int] | None = None, wake_s: float | None = None,
        require: tuple[str, list[object]] | None = None, killed_if_pulled: bool = False,
    ) -> bool:  # fmt: skip
        """Move a run to ``status`` (only from one of ``only_from`` when given; with ``within``,
        a tenant and its runs quota, only while that tenant has fewer runs queued or running, in
        the same statement); False when it was not in one of them, or the tenant had none to
        spare. ``wake_s``, for a run queued: its wake, that long on, written with it (a run
        sent on from paused or broken had none, and its send may fail or never come).
        ``require``: instead of ``only_from`` and ``within``, a row the move needs (locked).
        ``killed_if_pulled``: where its worker leaves the run (ended, paused), "killed" instead
        when its kill switch is pulled (``DatabaseKillSource.pull``, which locks the row too):
        a kill answered while the run ran ends it killed, however late in its run it came. A
        run that ends takes its switch with it."""
        now = time.time_ns()
        sets = ["status = ?", "error = ?"]
        params: list[object] = [status, error]
        if worker is not None:
            sets.append("worker = ?")
            params.append(worker)
        if started:
            sets += ["started_ns = COALESCE(started_ns, ?)", "attempts = attempts + 1"]
            params.append(now)
        if status in TERMINAL:
            sets.append("finished_ns = ?")
            params.append(now)
        where = "run_id = ?"
        params.append(run_id)
        required = f"SELECT 1 FROM {self.ns}_runs WHERE run_id = ?"
        required_params: list[object] = [run_id]
        if only_from:
            marks = ", ".join("?" for _ in only_from)
            where += f" AND status IN ({marks})"
            params.extend(only_from)
            required += f" AND status IN ({marks})"
            required_params += only_from
        if within is not None:
            # as add_run counts them: a run back in the queue takes a place of its tenant's
            room = f" AND (SELECT COUNT(*) FROM {self.ns}_runs WHERE tenant = ? AND status IN {ACTIVE}) < ?"
            where += room
            params += within
            required += room
            required_params += within
        if require is None and (only_from or within is not None):
            require = (required, required_params)
        statements: list[Statement] = [
            (f"UPDATE {self.ns}_runs SET {', '.join(sets)} WHERE {where}", [params])
        ]
        if status != "running":  # its sandbox is closed (or kept on disk): its share is free
            statements.append((f"DELETE FROM {self.ns}_holds WHERE run_id = ?", [(run_id,)]))
        if status == "running":  # a waker looks whether its process lives (``server/wakes.py``)
            statements.append(wake_statement(self.ns, run_id, now + int(START_GRACE_S * 1e9)))
        elif status != QUEUED:  # paused or ended: nothing to wake (a queued run says when)
            statements.append((f"DELETE FROM {self.ns}_wakes WHERE run_id = ?", [(run_id,)]))
        elif wake_s is not None:
            statements.append(wake_statement(self.ns, run_id, now + int(wake_s * 1e9)))
        statements += self._switch(run_id, status, now, killed_if_pulled=killed_if_pulled)
        if status != "running" and self._measure is not None:
            # stopped: what it wrote to the run store counts against its tenant's storage_mb
            rows, ids = self._measure
            statements.append(
                (f"UPDATE {self.ns}_run_bytes SET store = {rows} WHERE run_id = ?", [(run_id,) * (ids + 1)])
            )
        return self.db.write(statements, require=require)

    def _switch(self, run_id: str, status: str, now: int, *, killed_if_pulled: bool) -> list[Statement]:
        """What a move does to the run's kill switch: ``killed_if_pulled``, the run "killed" for
        the reason it gives; a run that ends (or was left where it waits) takes it with it."""
        switch = f"FROM {self.ns}_kills WHERE run_id = ?"
        statements: list[Statement] = []
        if killed_if_pulled:
            statements.append((
                f"UPDATE {self.ns}_runs SET status = 'killed', error = (SELECT reason {switch}), "
                f"finished_ns = ? WHERE run_id = ? AND EXISTS (SELECT 1 {switch})",
                [(run_id, now, run_id, run_id)],
            ))  # fmt: skip
        if status in TERMINAL or killed_if_pulled:  # acted upon, or too late to matter
            statements.append((f"DELETE {switch}", [(run_id,)]))
        return statements

    def pause(self, run_id: str, *, error: str | None) -> bool:
        """The run stopped at an approval: "paused" while one of its requests is pending (True).
        Each decided already (while its sandbox was being kept, the pending request listed for
        seconds before the run was paused): "queued" instead, with its wake (False), since the
        decision found it running and sent nothing. The pending requests are locked by the
        check (``FOR UPDATE``): a decision racing it waits for "paused", then sends the run."""
        approvals = f"{self.ns}_approvals"
        if self.set_status(
            run_id, "paused", error=error, killed_if_pulled=True,
            require=(f"SELECT 1 FROM {approvals} WHERE run_id = ? AND status = 'pending'", [run_id]),
        ):  # fmt: skip
            return True
        # the run holds its place of the runs quota (it is running): no room to ask for
        self.set_status(run_id, QUEUED, only_from=("running",), wake_s=RESEND_S)
        return False

    def waiting_runs(self, tenant: str | None = None) -> list[RunRow]:
        """The runs of ``tenant`` (of every tenant, when None) that wait to run or to go on."""
        return self._runs_in(WAITING, tenant)

    def running_runs(self, tenant: str | None = None) -> list[RunRow]:
        """The runs of ``tenant`` (of every tenant, when None) the service has as running."""
        return self._runs_in(("running",), tenant)

    def _runs_in(self, statuses: Sequence[str], tenant: str | None) -> list[RunRow]:
        marks = ", ".join("?" for _ in statuses)
        sql = f"SELECT {_RUN_COLUMNS} FROM {self.ns}_runs WHERE status IN ({marks})"
        params: list[object] = list(statuses)
        if tenant is not None:
            sql += " AND tenant = ?"
            params.append(tenant)
        return [_run(r) for r in self.db.query(sql + " ORDER BY submitted_ns", params)]

    def unfinished_runs(self) -> list[RunRow]:
        rows = self.db.query(
            f"SELECT {_RUN_COLUMNS} FROM {self.ns}_runs WHERE status IN ('queued', 'running', 'interrupted') "
            "ORDER BY submitted_ns"
        )
        return [_run(r) for r in rows]

    def ended_runs(self, tenant: str, *, before_ns: int, limit: int) -> list[RunRow]:
        """The tenant's runs that ended before ``before_ns``, oldest first, without their specs."""
        ended = ", ".join("?" for _ in TERMINAL)
        columns = _RUN_COLUMNS.replace("spec,", "'{}',", 1)
        at = "COALESCE(finished_ns, submitted_ns)"  # rows of old versions may lack finished_ns
        rows = self.db.query(
            f"SELECT {columns} FROM {self.ns}_runs WHERE tenant = ? AND status IN ({ended}) "
            f"AND {at} < ? ORDER BY {at} LIMIT ?",
            [tenant, *TERMINAL, before_ns, limit],
        )
        return [_run(r) for r in rows]

    def run_ids(self, tenant: str, *, ended: bool = False) -> frozenset[str]:
        """The ids of the tenant's runs (``ended``: only those that ended, whose ledger and
        trail no longer grow)."""
        sql = f"SELECT run_id FROM {self.ns}_runs WHERE tenant = ?"
        if ended:
            statuses = ", ".join(f"'{status}'" for status in sorted(TERMINAL))
            sql += f" AND status IN ({statuses})"
        return frozenset(str(r[0]) for r in self.db.query(sql, (tenant,)))

    def open_runs(self, tenant: str) -> list[RunRow]:
        """The tenant's runs that have not ended (queued, running, paused, ...)."""
        ended = ", ".join(f"'{status}'" for status in sorted(TERMINAL))
        rows = self.db.query(
            f"SELECT {_RUN_COLUMNS} FROM {self.ns}_runs WHERE tenant = ? AND status NOT IN ({ended})",
            (tenant,),
        )
        return [_run(r) for r in rows]

    def has_room(self, tenant: str, max_active: int) -> bool:
        """Whether ``tenant`` has fewer than ``max_active`` runs queued or running (its runs
        quota, as ``add_run`` counts it)."""
        rows = self.db.query(
            f"SELECT COUNT(*) FROM {self.ns}_runs WHERE tenant = ? AND status IN {ACTIVE}", (tenant,)
        )
        return (as_int(rows[0][0]) if rows else 0) < max_active

    def put_artifacts(self, run_id: str, digest: str, data: bytes, size: int, *, max_bytes: int) -> bool:
        """Keep a finished run's final workspace, if what its tenant keeps stays within
        ``max_bytes``; False when it would not (nothing kept)."""
        ns = self.ns
        row = self.run(run_id)
        if row is None:
            return False
        self.delete_artifacts(run_id)  # a run's own earlier copy does not count against it
        self._keep(
            f"INSERT INTO {ns}_artifacts SELECT ?, ?, ?, ? WHERE {self._stored()} + ? <= ? "
            "ON CONFLICT (run_id) DO NOTHING",
            (run_id, digest, size, data, *self._stored_params(row.tenant), size, max_bytes),
            tenant=row.tenant,
        )
        return self.has_artifacts(run_id)

    def has_artifacts(self, run_id: str) -> bool:
        return bool(self.db.query(f"SELECT 1 FROM {self.ns}_artifacts WHERE run_id = ?", (run_id,)))

    def delete_artifacts(self, run_id: str) -> bool:
        table = f"{self.ns}_artifacts"
        return self.db.write(
            [(f"DELETE FROM {table} WHERE run_id = ?", [(run_id,)])],
            require=(f"SELECT 1 FROM {table} WHERE run_id = ?", (run_id,)),
        )

    def forget_run(self, run_id: str) -> bool:
        """Remove a run that ended and all the service keeps of it (its artifacts, approvals,
        byte count); False when there is no such run, or it has not ended (nothing removed)."""
        ns = self.ns
        ended = ", ".join("?" for _ in TERMINAL)
        statements: list[Statement] = [
            (f"DELETE FROM {ns}_{table} WHERE run_id = ?", [(run_id,)])
            for table in (
                "artifacts",
                "approvals",
                "run_bytes",
                "holds",
                "wakes",
                "tries",
                "kills",
                "live",
                "runs",
            )
        ]
        return self.db.write(
            statements,
            require=(
                f"SELECT 1 FROM {ns}_runs WHERE run_id = ? AND status IN ({ended})",
                [run_id, *TERMINAL],
            ),
        )

    def artifacts(self, run_id: str) -> bytes | None:
        rows = self.db.query(f"SELECT data FROM {self.ns}_artifacts WHERE run_id = ?", (run_id,))
        return as_bytes(rows[0][0]) if rows else None
