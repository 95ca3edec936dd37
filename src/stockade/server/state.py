"""What the service keeps in its database, beside the run store and the audit trails.

One database holds everything (``sqlite:///PATH`` embedded, ``postgresql://...`` at scale):
the run store (``runs_*``), each tenant's audit trail (``audit_t_<tenant>_*``) and, here, the
service's own tables (``svc_*``):

- ``svc_runs``: who submitted each run, what it asked for (the spec) and where it is
  (queued, running, paused, ..., as the service knows it; the run store has the details);
- ``svc_workspaces``: uploaded workspaces, packed, by tenant, role and digest (a role's own:
  another role of the tenant neither lists, uses nor deletes them);
- ``svc_artifacts``: a finished run's final workspace, packed;
- ``svc_run_bytes``: what each run keeps in the database (its spec, and its rows in the run
  store as measured each time it stops), counted in its tenant's ``storage_mb``;
- ``svc_sandboxes``: the live sandboxes, the API process that holds each (its ``owner``) and
  what they hold of their tenant's quota;
- ``svc_holds``: the share of their tenant's quota that runs hold while they run (their
  sandbox's CPUs and memory, and one of its sandboxes), so that runs and the API's own
  sandboxes fill one quota;
- ``svc_nodes``: the API processes, each with the address its peers forward requests to and
  its last heartbeat (a sandbox lives in the process that made it: see ``server/routing.py``);
- ``svc_ended``: sandboxes killed (still listed by their process until deleted) or lost with
  their process ("gone"), so that a request for one is answered that, not "not found";
- ``svc_snapshots``: which snapshot store (an id of its folder, and the address of the process
  that wrote there) keeps each tenant's snapshot or paused sandbox, and the role that took it,
  so that a process that does not share that folder tells that role where it is instead of
  "not found";
- ``svc_approvals``: pending requests and decisions (``DatabaseApprovals``);
- ``svc_kills`` / ``svc_live``: kill switches and live runs (``DatabaseKillSource``);
- ``svc_wakes``: when a run nobody holds goes to a worker again (``server/wakes.py``);
- ``svc_keys``: the service's own random keys (the viewer's sessions are signed with one), made
  by the first process that asks, the same for every process;
- ``svc_signouts``: viewer sessions signed out before they expire.

Quotas hold across API processes: a reservation is one transaction that locks its
tenant's row first (``FOR UPDATE`` on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), then
inserts only if the tenant's totals stay within the quota.
"""

from __future__ import annotations

import functools
import json
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from stockade import exceptions as exc
from stockade.audit.redact import Redactor
from stockade.policy.approval import SPENT, ApprovalRequest, Choice, keyed, not_pending, redacted
from stockade.runs._db import Database, PostgresDatabase, SQLiteDatabase, Statement, octets
from stockade.runs._schema import run_bytes_sql
from stockade.runtime.killswitch import LIVE_FOR_S, LiveRun
from stockade.server.tenants import Quotas
from stockade.server.wakes import RESEND_S, START_GRACE_S, wake_statement
from stockade.types import MiB

__all__ = [
    "DatabaseApprovals",
    "DatabaseKillSource",
    "Node",
    "Placement",
    "RunRow",
    "SandboxRow",
    "ServiceStore",
    "database_kill_source",
    "open_database",
]

# The service's view of a run, before the run store has it and after it ended.
QUEUED = "queued"
# Runs that wait for something (a worker, an approval, a person): a kill-all ends them where
# they are, or a worker would start them right after.
WAITING = ("queued", "paused", "interrupted", "broken")
# where a worker may take a run up: a paused or broken one (``HELD``) waits for a person, who
# queues it (the approvals decided, POST /resume) before it is sent on
STARTABLE = ("queued", "interrupted", "running")
HELD = frozenset({"paused", "broken"})
TERMINAL = frozenset({"success", "check_failed", "max_steps", "budget", "killed", "denied", "error"})
ACTIVE = "('queued', 'running', 'interrupted')"  # what a tenant's runs quota counts (SQL)


def open_database(url: str) -> Database:
    """``postgresql://...``, ``sqlite:///PATH`` or a plain path."""
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresDatabase(url)
    if url.startswith("sqlite:///"):
        return SQLiteDatabase(url[len("sqlite:///") :])
    if "://" in url:
        raise exc.InvalidArgument(
            f"unknown database URL {url!r}", argument="database", fix="use sqlite:///PATH or postgresql://..."
        )
    return SQLiteDatabase(url)


def _schema(ns: str, blob: str) -> list[str]:
    return [
        f"""CREATE TABLE IF NOT EXISTS {ns}_runs (
            run_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, role TEXT, spec TEXT NOT NULL,
            status TEXT NOT NULL, error TEXT, labels TEXT NOT NULL, submitted_ns BIGINT NOT NULL,
            started_ns BIGINT, finished_ns BIGINT, attempts INTEGER NOT NULL, worker TEXT, idem_key TEXT)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_runs_tenant ON {ns}_runs (tenant, submitted_ns)",
        # an idempotency key is its role's (a dev token's key blocked an admin's submit, naming a
        # run the admin could not see); the older (tenant, idem_key) index goes: its keys were
        # unique per tenant, so they are per role too
        f"CREATE UNIQUE INDEX IF NOT EXISTS {ns}_runs_idem_role "
        f"ON {ns}_runs (tenant, COALESCE(role, ''), idem_key)",
        f"DROP INDEX IF EXISTS {ns}_runs_idem",
        _workspaces_table(f"{ns}_workspaces", blob),
        f"""CREATE TABLE IF NOT EXISTS {ns}_artifacts (
            run_id TEXT PRIMARY KEY, digest TEXT NOT NULL, bytes BIGINT NOT NULL, data {blob} NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_run_bytes (
            run_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, spec BIGINT NOT NULL, store BIGINT NOT NULL)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_run_bytes_tenant ON {ns}_run_bytes (tenant)",
        # runs submitted before their bytes were counted: their specs count from now on (a spec
        # is JSON in ASCII, so its length is its size). Once, while the table is empty: every
        # process opens this store at its start, and the anti-join read every run each time.
        f"INSERT INTO {ns}_run_bytes SELECT run_id, tenant, LENGTH(spec), 0 FROM {ns}_runs "
        f"WHERE NOT EXISTS (SELECT 1 FROM {ns}_run_bytes) ON CONFLICT (run_id) DO NOTHING",
        f"CREATE TABLE IF NOT EXISTS {ns}_tenants (tenant TEXT PRIMARY KEY)",
        f"""CREATE TABLE IF NOT EXISTS {ns}_sandboxes (
            sandbox_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, owner TEXT NOT NULL, tier TEXT NOT NULL,
            cpus DOUBLE PRECISION NOT NULL, memory_mb BIGINT NOT NULL, created_ns BIGINT NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_holds (
            run_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, worker TEXT NOT NULL,
            cpus DOUBLE PRECISION NOT NULL, memory_mb BIGINT NOT NULL, created_ns BIGINT NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_nodes (
            owner TEXT PRIMARY KEY, url TEXT NOT NULL, hop_key TEXT NOT NULL, beat_ns BIGINT NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_ended (
            sandbox_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, owner TEXT NOT NULL, reason TEXT NOT NULL,
            ended_ns BIGINT NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_snapshots (
            tenant TEXT NOT NULL, name TEXT NOT NULL, store_id TEXT NOT NULL, url TEXT NOT NULL,
            taken_ns BIGINT NOT NULL, role TEXT, PRIMARY KEY (tenant, name))""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_approvals (
            run_id TEXT NOT NULL, request_id TEXT NOT NULL, action TEXT NOT NULL, rule TEXT NOT NULL,
            reason TEXT NOT NULL, status TEXT NOT NULL, decided_by TEXT NOT NULL, updated_ns BIGINT NOT NULL,
            PRIMARY KEY (run_id, request_id))""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_kills (
            run_id TEXT PRIMARY KEY, reason TEXT NOT NULL, created_ns BIGINT NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_live (
            run_id TEXT PRIMARY KEY, info TEXT NOT NULL, beat_ns BIGINT NOT NULL)""",
        # when a run nobody holds goes to a worker again (``server/wakes.py``)
        f"""CREATE TABLE IF NOT EXISTS {ns}_wakes (
            run_id TEXT PRIMARY KEY, wake_ns BIGINT NOT NULL, misses INTEGER NOT NULL)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_wakes_due ON {ns}_wakes (wake_ns)",
        # the attempts of a run that failed (its worker died, a retryable error): capped
        f"CREATE TABLE IF NOT EXISTS {ns}_tries (run_id TEXT PRIMARY KEY, failed INTEGER NOT NULL)",
        # the service's own random keys, shared by every process over the database
        f"CREATE TABLE IF NOT EXISTS {ns}_keys (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
        # viewer sessions signed out before they expire
        f"""CREATE TABLE IF NOT EXISTS {ns}_signouts (
            nonce TEXT PRIMARY KEY, expires_ns BIGINT NOT NULL)""",
    ]


def _workspaces_table(name: str, blob: str) -> str:
    # role: the role of the token that uploaded it ('' for a token without one, and for a row
    # from before workspaces had a role); a key column, so each role keeps its own copy
    return f"""CREATE TABLE IF NOT EXISTS {name} (
        tenant TEXT NOT NULL, digest TEXT NOT NULL, bytes BIGINT NOT NULL, data {blob} NOT NULL,
        created_ns BIGINT NOT NULL, role TEXT NOT NULL DEFAULT '', PRIMARY KEY (tenant, role, digest))"""


def _migrate_workspaces(db: Database, ns: str) -> None:
    """Give a ``<ns>_workspaces`` table made before workspaces had a role its ``role`` column
    and its key (tenant, role, digest); its rows get role '': a token without a role's."""
    table = f"{ns}_workspaces"
    if "role" in db.columns(table):
        return
    if isinstance(db, PostgresDatabase):
        # under the lock ``create`` takes: a second process finds it done, and redoes nothing
        db.write([
            ("SELECT pg_advisory_xact_lock(hashtext(?))", [(f"stockade-{ns}",)]),
            (f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS role TEXT NOT NULL DEFAULT ''", [()]),
            (f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {table}_pkey", [()]),
            (f"ALTER TABLE {table} ADD PRIMARY KEY (tenant, role, digest)", [()]),
        ])  # fmt: skip
        return
    # SQLite cannot change a key: the table is copied; the check is in the same transaction
    db.write(
        [
            (f"DROP TABLE IF EXISTS {table}_old", [()]),
            (f"ALTER TABLE {table} RENAME TO {table}_old", [()]),
            (_workspaces_table(table, db.blob), [()]),
            (
                f"INSERT INTO {table} (tenant, digest, bytes, data, created_ns, role) "
                f"SELECT tenant, digest, bytes, data, created_ns, '' FROM {table}_old",
                [()],
            ),
            (f"DROP TABLE {table}_old", [()]),
        ],
        require=(f"SELECT 1 WHERE 'role' NOT IN (SELECT name FROM pragma_table_info('{table}'))", ()),
    )


def _role_key(role: str | None) -> str:
    """A role as the workspaces table keys it ('': a token without one)."""
    return role or ""


TABLES = ("runs", "workspaces", "artifacts", "run_bytes", "tenants", "sandboxes", "holds", "nodes", "ended",
          "snapshots", "approvals", "kills", "live", "wakes", "tries", "keys", "signouts")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class RunRow:
    run_id: str
    tenant: str
    role: str | None
    spec: dict[str, object]
    status: str
    error: str | None
    labels: dict[str, str]
    submitted_ns: int
    started_ns: int | None
    finished_ns: int | None
    attempts: int
    worker: str | None


@dataclass(frozen=True, kw_only=True)
class SandboxRow:
    sandbox_id: str
    tenant: str
    owner: str
    tier: str
    cpus: float
    memory_mb: int


@dataclass(frozen=True, kw_only=True)
class Node:
    """An API process: where its peers reach it, the key that marks their requests, and when
    it last said it was alive."""

    owner: str
    url: str
    hop_key: str
    beat_ns: int


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a sandbox is: its tenant, the process that holds it (``node`` None when that
    process has no row: it never registered, or was found dead), and ``ended`` when it was
    killed ("killed") or lost with its process ("lost")."""

    sandbox_id: str
    tenant: str
    owner: str
    node: Node | None
    ended: str | None = None


def _int(value: object) -> int:
    return int(str(value))


def _milli(cpus: float) -> int:
    return round(cpus * 1000)


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
        submitted_ns=_int(row[7]),
        started_ns=None if row[8] is None else _int(row[8]),
        finished_ns=None if row[9] is None else _int(row[9]),
        attempts=_int(row[10]),
        worker=None if row[11] is None else str(row[11]),
    )


class ServiceStore:
    """The service's tables in ``db`` (``<ns>_*``). ``runs``: the namespace of the run store
    in the same database, whose rows of a run are measured each time the run stops (counted in
    its tenant's ``storage_mb``); None where nothing runs (the run store's tables may not be)."""

    def __init__(self, db: Database, *, namespace: str = "svc", runs: str | None = None) -> None:
        self.db = db
        self.ns = namespace
        self.db.create(_schema(namespace, db.blob), name=namespace)
        _migrate_workspaces(db, namespace)
        # the role that took a snapshot (NULL: a token without one, or taken before they said)
        self.db.add_column(f"{namespace}_snapshots", "role", "TEXT")
        self._measure = None if runs is None else run_bytes_sql(runs, functools.partial(octets, db))

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
            (tenant, _role_key(role), idem_key),
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
        require: tuple[str, list[object]] | None = None,
    ) -> bool:  # fmt: skip
        """Move a run to ``status`` (only from one of ``only_from`` when given; with ``within``,
        a tenant and its runs quota, only while that tenant has fewer runs queued or running, in
        the same statement); False when it was not in one of them, or the tenant had none to
        spare. ``wake_s``, for a run queued: its wake, that long on, written with it (a run
        sent on from paused or broken had none, and its send may fail or never come).
        ``require``: instead of ``only_from`` and ``within``, a row the move needs (locked)."""
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
        if status != "running" and self._measure is not None:
            # stopped: what it wrote to the run store counts against its tenant's storage_mb
            rows, ids = self._measure
            statements.append(
                (f"UPDATE {self.ns}_run_bytes SET store = {rows} WHERE run_id = ?", [(run_id,) * (ids + 1)])
            )
        return self.db.write(statements, require=require)

    def pause(self, run_id: str, *, error: str | None) -> bool:
        """The run stopped at an approval: "paused" while one of its requests is pending (True).
        Each decided already (while its sandbox was being kept, the pending request listed for
        seconds before the run was paused): "queued" instead, with its wake (False), since the
        decision found it running and sent nothing. The pending requests are locked by the
        check (``FOR UPDATE``): a decision racing it waits for "paused", then sends the run."""
        approvals = f"{self.ns}_approvals"
        if self.set_status(
            run_id, "paused", error=error,
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

    # -- workspaces and artifacts -----------------------------------------------------------

    def _stored(self) -> str:
        """What a tenant keeps in the database (``?``: ``_stored_params``), in bytes: its
        workspaces, its runs' artifacts, its runs' specs and their rows in the run store (as
        last measured: when the run last stopped)."""
        ns = self.ns
        return (
            f"(SELECT COALESCE(SUM(bytes), 0) FROM {ns}_workspaces WHERE tenant = ?) + "
            f"(SELECT COALESCE(SUM(a.bytes), 0) FROM {ns}_artifacts a JOIN {ns}_runs r "
            "ON r.run_id = a.run_id WHERE r.tenant = ?) + "
            f"(SELECT COALESCE(SUM(spec + store), 0) FROM {ns}_run_bytes WHERE tenant = ?)"
        )

    @staticmethod
    def _stored_params(tenant: str) -> tuple[str, str, str]:
        return (tenant, tenant, tenant)

    def has_room(self, tenant: str, max_active: int) -> bool:
        """Whether ``tenant`` has fewer than ``max_active`` runs queued or running (its runs
        quota, as ``add_run`` counts it)."""
        rows = self.db.query(
            f"SELECT COUNT(*) FROM {self.ns}_runs WHERE tenant = ? AND status IN {ACTIVE}", (tenant,)
        )
        return (_int(rows[0][0]) if rows else 0) < max_active

    def stored_bytes(self, tenant: str) -> int:
        rows = self.db.query(f"SELECT {self._stored()}", self._stored_params(tenant))
        return _int(rows[0][0]) if rows else 0

    def run_bytes(self, run_id: str) -> int | None:
        """What a run keeps in the database (its spec, its run store rows as last measured)."""
        rows = self.db.query(f"SELECT spec + store FROM {self.ns}_run_bytes WHERE run_id = ?", (run_id,))
        return _int(rows[0][0]) if rows else None

    def put_workspace(
        self, tenant: str, role: str | None, digest: str, data: bytes, size: int, *, max_bytes: int
    ) -> None:
        """Keep a workspace uploaded by a token of ``role``, if what the tenant keeps stays
        within ``max_bytes`` (one the role has already costs nothing; another role's copy is
        that role's, and this one counts too); ``QuotaExceeded`` otherwise."""
        ns, key = self.ns, _role_key(role)
        if self.workspace_size(tenant, role, digest) is not None:
            return
        self._keep(
            f"INSERT INTO {ns}_workspaces (tenant, role, digest, bytes, data, created_ns) "
            f"SELECT ?, ?, ?, ?, ?, ? WHERE {self._stored()} + ? <= ? "
            "ON CONFLICT (tenant, role, digest) DO NOTHING",
            (tenant, key, digest, size, data, time.time_ns(), *self._stored_params(tenant), size, max_bytes),
            tenant=tenant,
        )
        if self.workspace_size(tenant, role, digest) is None:
            raise self._storage_full(tenant, size, max_bytes, what="this workspace")

    def workspace_size(self, tenant: str, role: str | None, digest: str) -> int | None:
        rows = self.db.query(
            f"SELECT bytes FROM {self.ns}_workspaces WHERE tenant = ? AND role = ? AND digest = ?",
            (tenant, _role_key(role), digest),
        )
        return _int(rows[0][0]) if rows else None

    def workspace(self, tenant: str, role: str | None, digest: str) -> bytes | None:
        """The workspace ``digest`` that a token of ``role`` uploaded (another role's is not
        found)."""
        rows = self.db.query(
            f"SELECT data FROM {self.ns}_workspaces WHERE tenant = ? AND role = ? AND digest = ?",
            (tenant, _role_key(role), digest),
        )
        return _bytes(rows[0][0]) if rows else None

    def workspaces(self, tenant: str, role: str | None) -> list[tuple[str, int, int]]:
        """The workspaces a role's tokens uploaded: (id, bytes, uploaded ns), newest first."""
        rows = self.db.query(
            f"SELECT digest, bytes, created_ns FROM {self.ns}_workspaces WHERE tenant = ? AND role = ? "
            "ORDER BY created_ns DESC",
            (tenant, _role_key(role)),
        )
        return [(str(r[0]), _int(r[1]), _int(r[2])) for r in rows]

    def all_workspaces(self, tenant: str) -> list[tuple[str, str | None, int, int]]:
        """Every role's workspaces of a tenant, for its operator: (id, role or None, bytes,
        uploaded ns), newest first."""
        rows = self.db.query(
            f"SELECT digest, role, bytes, created_ns FROM {self.ns}_workspaces WHERE tenant = ? "
            "ORDER BY created_ns DESC",
            (tenant,),
        )
        return [(str(r[0]), str(r[1]) or None, _int(r[2]), _int(r[3])) for r in rows]

    def delete_workspace(self, tenant: str, role: str | None, digest: str) -> bool:
        table, where = f"{self.ns}_workspaces", "tenant = ? AND role = ? AND digest = ?"
        params = (tenant, _role_key(role), digest)
        return self.db.write(
            [(f"DELETE FROM {table} WHERE {where}", [params])],
            require=(f"SELECT 1 FROM {table} WHERE {where}", params),
        )

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

    def _keep(self, insert: str, params: tuple[object, ...], *, tenant: str) -> None:
        """``insert``, in one transaction that locks the tenant's row first (so two uploads
        never both fit where one does)."""
        ns = self.ns
        self.db.write([(f"INSERT INTO {ns}_tenants VALUES (?) ON CONFLICT (tenant) DO NOTHING", [(tenant,)])])
        self.db.write(
            [(insert, [params])], require=(f"SELECT 1 FROM {ns}_tenants WHERE tenant = ?", (tenant,))
        )

    def _storage_full(self, tenant: str, size: int, max_bytes: int, *, what: str) -> exc.QuotaExceeded:
        used = self.stored_bytes(tenant)
        return exc.QuotaExceeded(
            f"tenant {tenant!r} keeps {used / MiB:.1f} MiB of workspaces, runs and run artifacts of its "
            f"{max_bytes / MiB:g} MiB storage_mb; {what} needs {size / MiB:.1f} MiB more: delete a workspace "
            "(DELETE /v1/workspaces/ID), a run's artifacts (DELETE /v1/runs/ID/artifacts) or a run that "
            "ended (DELETE /v1/runs/ID)",
            quota="storage_mb",
            limit=max_bytes / MiB,
            used=used / MiB,
        )

    def artifacts(self, run_id: str) -> bytes | None:
        rows = self.db.query(f"SELECT data FROM {self.ns}_artifacts WHERE run_id = ?", (run_id,))
        return _bytes(rows[0][0]) if rows else None

    # -- sandboxes: quotas ------------------------------------------------------------------

    def reserve_sandbox(
        self, *, sandbox_id: str, tenant: str, owner: str, tier: str, cpus: float, memory_mb: int,
        quotas: Quotas,
    ) -> None:  # fmt: skip
        """Hold a share of the tenant's quota for a sandbox about to start; ``QuotaExceeded``."""
        self._take(
            f"INSERT INTO {self.ns}_sandboxes SELECT ?, ?, ?, ?, ?, ?, ?",
            (sandbox_id, tenant, owner, tier, cpus, memory_mb, time.time_ns()),
            tenant=tenant, cpus=cpus, memory_mb=memory_mb, quotas=quotas,
        )  # fmt: skip
        if not self.db.query(f"SELECT 1 FROM {self.ns}_sandboxes WHERE sandbox_id = ?", (sandbox_id,)):
            raise self._full(tenant, cpus=cpus, memory_mb=memory_mb, quotas=quotas, what="this sandbox")

    def hold_run(
        self, *, run_id: str, tenant: str, worker: str, cpus: float, memory_mb: int, quotas: Quotas
    ) -> None:
        """Hold the share of the tenant's quota that a run's sandbox takes, until the run leaves
        "running" (``set_status``); ``QuotaExceeded`` when the tenant's sandboxes and running
        runs hold too much for it (the run waits queued). A run held already keeps its share
        (another delivery of a run that runs)."""
        ns = self.ns
        if self.db.query(f"SELECT 1 FROM {ns}_holds WHERE run_id = ?", (run_id,)):
            return
        self._take(
            f"INSERT INTO {ns}_holds SELECT ?, ?, ?, ?, ?, ?",
            (run_id, tenant, worker, cpus, memory_mb, time.time_ns()),
            tenant=tenant, cpus=cpus, memory_mb=memory_mb, quotas=quotas,
            conflict="ON CONFLICT (run_id) DO NOTHING",
        )  # fmt: skip
        if not self.db.query(f"SELECT 1 FROM {ns}_holds WHERE run_id = ?", (run_id,)):
            raise self._full(tenant, cpus=cpus, memory_mb=memory_mb, quotas=quotas, what="this run's sandbox")

    def drop_hold(self, run_id: str) -> None:
        """Free a run's share (one that never turned "running": it was ended meanwhile)."""
        self.db.write([(f"DELETE FROM {self.ns}_holds WHERE run_id = ?", [(run_id,)])])

    def holds(self, tenant: str) -> list[str]:
        """The runs that hold a share of ``tenant``'s quota."""
        rows = self.db.query(
            f"SELECT run_id FROM {self.ns}_holds WHERE tenant = ? ORDER BY run_id", (tenant,)
        )
        return [str(r[0]) for r in rows]

    def _live(self) -> str:
        """What holds a share of a quota: the API's sandboxes and the runs that run."""
        ns = self.ns
        return (
            f"(SELECT tenant, cpus, memory_mb FROM {ns}_sandboxes "
            f"UNION ALL SELECT tenant, cpus, memory_mb FROM {ns}_holds) live WHERE tenant = ?"
        )

    def _take(
        self, insert: str, row: tuple[object, ...], *, tenant: str, cpus: float, memory_mb: int,
        quotas: Quotas, conflict: str = "",
    ) -> None:  # fmt: skip
        """``insert`` ``row``, only if the tenant's totals stay within ``quotas``: one
        transaction that locks the tenant's row first."""
        ns = self.ns
        self.db.write([(f"INSERT INTO {ns}_tenants VALUES (?) ON CONFLICT (tenant) DO NOTHING", [(tenant,)])])
        totals = f"FROM {self._live()}"
        # CPUs are added up in thousandths, as integers: 0.1 + 0.2 is not above a quota of 0.3
        self.db.write(
            [
                (
                    f"{insert} WHERE (SELECT COUNT(*) {totals}) < ? "
                    f"AND (SELECT ROUND(COALESCE(SUM(cpus), 0) * 1000) {totals}) + ? <= ? "
                    f"AND (SELECT COALESCE(SUM(memory_mb), 0) {totals}) + ? <= ? {conflict}",
                    [
                        (
                            *row, tenant, quotas.sandboxes, tenant, _milli(cpus), _milli(quotas.cpus), tenant,
                            memory_mb, quotas.memory_mb,
                        )
                    ],
                )
            ],
            require=(f"SELECT 1 FROM {ns}_tenants WHERE tenant = ?", (tenant,)),
        )  # fmt: skip

    def _full(
        self, tenant: str, *, cpus: float, memory_mb: int, quotas: Quotas, what: str
    ) -> exc.QuotaExceeded:
        """Which of the tenant's quotas has no room for ``cpus`` and ``memory_mb`` more."""
        count, used_cpus, used_memory = self.db.query(
            f"SELECT COUNT(*), COALESCE(SUM(cpus), 0), COALESCE(SUM(memory_mb), 0) FROM {self._live()}",
            (tenant,),
        )[0]
        if _int(count) >= quotas.sandboxes:
            quota, limit, used = "sandboxes", float(quotas.sandboxes), float(_int(count))
        elif _milli(float(str(used_cpus))) + _milli(cpus) > _milli(quotas.cpus):
            quota, limit, used = "cpus", quotas.cpus, _milli(float(str(used_cpus))) / 1000
        else:
            quota, limit, used = "memory_mb", float(quotas.memory_mb), float(str(used_memory))
        return exc.QuotaExceeded(
            f"tenant {tenant!r} holds {used:g} of its {limit:g} {quota} (its sandboxes and running runs); "
            f"{what} would need { {'sandboxes': 1, 'cpus': cpus, 'memory_mb': memory_mb}[quota] } more: "
            "delete a sandbox, wait for a run, or ask for smaller limits",
            quota=quota,
            limit=limit,
            used=used,
        )

    def release_sandbox(self, sandbox_id: str) -> None:
        """Forget a sandbox: its share of the quota is free, and it was never there."""
        self.db.write(
            [
                (f"DELETE FROM {self.ns}_sandboxes WHERE sandbox_id = ?", [(sandbox_id,)]),
                (f"DELETE FROM {self.ns}_ended WHERE sandbox_id = ?", [(sandbox_id,)]),
            ]
        )

    def end_sandbox(self, sandbox_id: str, reason: str) -> None:
        """Free a sandbox's share of the quota, and remember why it ended (``killed``)."""
        ns = self.ns
        self.db.write(
            [
                (
                    f"INSERT INTO {ns}_ended SELECT sandbox_id, tenant, owner, ?, ? FROM {ns}_sandboxes "
                    "WHERE sandbox_id = ? ON CONFLICT (sandbox_id) DO NOTHING",
                    [(reason, time.time_ns(), sandbox_id)],
                ),
                (f"DELETE FROM {ns}_sandboxes WHERE sandbox_id = ?", [(sandbox_id,)]),
            ]
        )

    # -- API processes: where each sandbox is ---------------------------------------------------

    # -- the service's keys and viewer sign-outs --------------------------------------------

    def key(self, name: str) -> bytes:
        """The service's key ``name``: made once, at random, by whichever process asks first."""
        table = f"{self.ns}_keys"
        made = secrets.token_hex(32)
        self.db.write([(f"INSERT INTO {table} VALUES (?, ?) ON CONFLICT (name) DO NOTHING", [(name, made)])])
        rows = self.db.query(f"SELECT value FROM {table} WHERE name = ?", (name,))
        return bytes.fromhex(str(rows[0][0]))

    def sign_out(self, nonce: str, expires_ns: int) -> None:
        """Remember a viewer session as signed out until it would have expired anyway."""
        table = f"{self.ns}_signouts"
        self.db.write(
            [
                (f"DELETE FROM {table} WHERE expires_ns < ?", [(time.time_ns(),)]),
                (f"INSERT INTO {table} VALUES (?, ?) ON CONFLICT (nonce) DO NOTHING", [(nonce, expires_ns)]),
            ]
        )

    def signed_out(self, nonce: str) -> bool:
        return bool(self.db.query(f"SELECT 1 FROM {self.ns}_signouts WHERE nonce = ?", (nonce,)))

    def register_node(self, owner: str, url: str, hop_key: str) -> None:
        self.db.write(
            [
                (
                    f"INSERT INTO {self.ns}_nodes VALUES (?, ?, ?, ?) ON CONFLICT (owner) DO UPDATE "
                    "SET url = excluded.url, hop_key = excluded.hop_key, beat_ns = excluded.beat_ns",
                    [(owner, url, hop_key, time.time_ns())],
                )
            ]
        )

    def beat(self, owner: str) -> bool:
        """Say ``owner`` is alive; False when its row is gone (a peer found it dead)."""
        table = f"{self.ns}_nodes"
        return self.db.write(
            [(f"UPDATE {table} SET beat_ns = ? WHERE owner = ?", [(time.time_ns(), owner)])],
            require=(f"SELECT 1 FROM {table} WHERE owner = ?", (owner,)),
        )

    def nodes(self) -> list[Node]:
        rows = self.db.query(f"SELECT owner, url, hop_key, beat_ns FROM {self.ns}_nodes")
        return [Node(owner=str(r[0]), url=str(r[1]), hop_key=str(r[2]), beat_ns=_int(r[3])) for r in rows]

    def owners(self) -> list[str]:
        """Every process that holds a sandbox, or a killed one, or has a row of its own."""
        ns = self.ns
        rows = self.db.query(
            f"SELECT owner FROM {ns}_sandboxes UNION SELECT owner FROM {ns}_ended WHERE reason = 'killed' "
            f"UNION SELECT owner FROM {ns}_nodes"
        )
        return [str(r[0]) for r in rows]

    def bury(self, owner: str) -> int:
        """``owner`` is dead: its sandboxes are lost (their quota freed, each remembered as
        "lost"), and so is its row. Returns how many sandboxes it held."""
        ns, now = self.ns, time.time_ns()
        held = self.db.query(f"SELECT COUNT(*) FROM {ns}_sandboxes WHERE owner = ?", (owner,))
        self.db.write(
            [
                (
                    f"INSERT INTO {ns}_ended SELECT sandbox_id, tenant, owner, 'lost', ? FROM {ns}_sandboxes "
                    "WHERE owner = ? ON CONFLICT (sandbox_id) DO NOTHING",
                    [(now, owner)],
                ),
                (f"UPDATE {ns}_ended SET reason = 'lost' WHERE owner = ?", [(owner,)]),
                (f"DELETE FROM {ns}_sandboxes WHERE owner = ?", [(owner,)]),
                (f"DELETE FROM {ns}_nodes WHERE owner = ?", [(owner,)]),
            ]
        )
        return _int(held[0][0]) if held else 0

    def forget_node(self, owner: str) -> None:
        """A process stopping cleanly: its row goes (its sandboxes were closed first)."""
        self.db.write(
            [
                (f"DELETE FROM {self.ns}_nodes WHERE owner = ?", [(owner,)]),
                (f"DELETE FROM {self.ns}_ended WHERE owner = ? AND reason = 'killed'", [(owner,)]),
            ]
        )

    def locate(self, sandbox_id: str) -> Placement | None:
        """Where ``sandbox_id`` is, or was; None when the service never had it (or forgot it)."""
        ns = self.ns
        node = "n.owner, n.url, n.hop_key, n.beat_ns"
        for table, reason in ((f"{ns}_sandboxes", "NULL"), (f"{ns}_ended", "s.reason")):
            rows = self.db.query(
                f"SELECT s.tenant, s.owner, {reason}, {node} FROM {table} s "
                f"LEFT JOIN {ns}_nodes n ON n.owner = s.owner WHERE s.sandbox_id = ?",
                (sandbox_id,),
            )
            if rows:
                r = rows[0]
                found = None
                if r[3] is not None:
                    found = Node(owner=str(r[3]), url=str(r[4]), hop_key=str(r[5]), beat_ns=_int(r[6]))
                return Placement(
                    sandbox_id=sandbox_id, tenant=str(r[0]), owner=str(r[1]), node=found,
                    ended=None if r[2] is None else str(r[2]),
                )  # fmt: skip
        return None

    def tenant_owners(self, tenant: str) -> list[str]:
        """The processes that hold a sandbox of ``tenant`` (live or killed)."""
        ns = self.ns
        rows = self.db.query(
            f"SELECT owner FROM {ns}_sandboxes WHERE tenant = ? UNION "
            f"SELECT owner FROM {ns}_ended WHERE tenant = ? AND reason = 'killed'",
            (tenant, tenant),
        )
        return [str(r[0]) for r in rows]

    def purge_ended(self, before_ns: int) -> None:
        """Forget sandboxes lost before ``before_ns``: after that, they are simply not found."""
        self.db.write(
            [(f"DELETE FROM {self.ns}_ended WHERE reason = 'lost' AND ended_ns < ?", [(before_ns,)])]
        )

    def sandboxes(self, *, owner: str | None = None) -> list[SandboxRow]:
        sql = f"SELECT sandbox_id, tenant, owner, tier, cpus, memory_mb FROM {self.ns}_sandboxes"
        rows = self.db.query(sql + " WHERE owner = ?", (owner,)) if owner else self.db.query(sql)
        return [
            SandboxRow(
                sandbox_id=str(r[0]), tenant=str(r[1]), owner=str(r[2]), tier=str(r[3]),
                cpus=float(str(r[4])), memory_mb=_int(r[5]),
            )
            for r in rows
        ]  # fmt: skip

    # -- snapshots: which store keeps them -------------------------------------------------------

    def record_snapshot(self, tenant: str, role: str | None, name: str, store_id: str, url: str) -> None:
        """``name`` (a snapshot id, or a paused sandbox's) of ``tenant``, taken by a token of
        ``role``, is kept in the store ``store_id``, written by the process at ``url``."""
        self.db.write(
            [
                (
                    f"INSERT INTO {self.ns}_snapshots (tenant, name, store_id, url, taken_ns, role) "
                    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, name) "
                    "DO UPDATE SET store_id = excluded.store_id, url = excluded.url, "
                    "taken_ns = excluded.taken_ns, role = excluded.role",
                    [(tenant, name, store_id, url, time.time_ns(), role)],
                )
            ]
        )

    def snapshot_place(self, tenant: str, role: str | None, name: str) -> tuple[str, str] | None:
        """(store id, url) of a tenant's snapshot or paused sandbox that ``role`` took, or None
        (another role's, or a row from before they named a role seen by a role: None too)."""
        sql = f"SELECT store_id, url FROM {self.ns}_snapshots WHERE tenant = ? AND name = ? AND "
        rows = (
            self.db.query(sql + "role IS NULL", (tenant, name))
            if role is None
            else self.db.query(sql + "role = ?", (tenant, name, role))
        )
        return (str(rows[0][0]), str(rows[0][1])) if rows else None

    def forget_snapshot(self, tenant: str, name: str) -> None:
        self.db.write([(f"DELETE FROM {self.ns}_snapshots WHERE tenant = ? AND name = ?", [(tenant, name)])])

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
        return [(_int(r[0]), str(r[1]), str(r[2])) for r in rows]

    def audit_last_seq(self, namespace: str, run_id: str, after_seq: int) -> int | None:
        """The newest ``seq`` of a run's audit events past ``after_seq`` (None: none came):
        what a live page polls, one row read by the run's index however many came."""
        rows = self.db.query(
            f"SELECT MAX(seq) FROM {namespace}_events WHERE run_id = ? AND seq > ?", (run_id, after_seq)
        )
        return None if not rows or rows[0][0] is None else _int(rows[0][0])

    def close(self) -> None:
        self.db.close()


def _bytes(value: object) -> bytes:
    return bytes(value) if isinstance(value, bytes | bytearray | memoryview) else b""


class DatabaseApprovals:
    """``ApprovalBook`` in the service's database: a decision made through the API reaches the
    run on whichever worker resumes it."""

    def __init__(self, store: ServiceStore, *, redactor: Redactor | None = None) -> None:
        self.db = store.db
        self.table = f"{store.ns}_approvals"
        self.redactor = redactor if redactor is not None else Redactor()  # actions, reasons
        self.store = store
        self._key = b""  # the service's key "approvals", read at its first use

    def keyed(self, request: ApprovalRequest) -> ApprovalRequest:
        self._key = self._key or self.store.key("approvals")
        return keyed(request, self.redactor, self._key)

    def submit(self, request: ApprovalRequest) -> None:
        kept = redacted(request, self.redactor)
        self.db.write(
            [
                (
                    # a request whose yes was spent is asked anew (ApprovalBook.submit)
                    f"INSERT INTO {self.table} VALUES (?, ?, ?, ?, ?, 'pending', '', ?) "
                    "ON CONFLICT (run_id, request_id) DO UPDATE SET status = 'pending', decided_by = '', "
                    f"updated_ns = excluded.updated_ns WHERE {self.table}.status = '{SPENT}'",
                    [
                        (
                            request.run_id,
                            request.id,
                            kept["action"],
                            request.rule,
                            kept["reason"],
                            time.time_ns(),
                        )
                    ],
                )
            ]
        )

    def decide(self, run_id: str, request_id: str, choice: Choice, *, by: str = "") -> None:
        where = "WHERE run_id = ? AND request_id = ?"
        if self.db.write(
            [
                (
                    f"UPDATE {self.table} SET status = ?, decided_by = ?, updated_ns = ? {where}",
                    [(choice.value, by, time.time_ns(), run_id, request_id)],
                )
            ],
            require=(f"SELECT 1 FROM {self.table} {where} AND status = 'pending'", (run_id, request_id)),
        ):
            return
        rows = self.db.query(f"SELECT status FROM {self.table} {where}", (run_id, request_id))
        if not rows:
            raise exc.ResourceNotFound(
                f"no approval request {request_id!r} for run {run_id!r}", kind="approval", id=request_id
            )
        raise not_pending(run_id, request_id, str(rows[0][0]))

    def decision(self, request: ApprovalRequest) -> Choice | None:
        rows = self.db.query(
            f"SELECT status FROM {self.table} WHERE run_id = ? AND request_id = ?",
            (request.run_id, request.id),
        )
        status = str(rows[0][0]) if rows else None
        return Choice(status) if status in (Choice.APPROVED, Choice.DENIED) else None

    def spend(self, run_id: str, request_id: str) -> bool:
        where = "WHERE run_id = ? AND request_id = ?"
        return self.db.write(
            [
                (
                    f"UPDATE {self.table} SET status = '{SPENT}', updated_ns = ? {where}",
                    [(time.time_ns(), run_id, request_id)],
                )
            ],
            # locked (FOR UPDATE) until the update: two workers never both apply one yes
            require=(f"SELECT 1 FROM {self.table} {where} AND status = 'approved'", (run_id, request_id)),
        )

    def requests(self, run_id: str, *, offset: int = 0, limit: int | None = None) -> list[dict[str, str]]:
        """The run's requests, oldest first; ``offset`` and ``limit`` page them (the API's)."""
        return self._select(run_id, "", "ORDER BY updated_ns, request_id", offset=offset, limit=limit)

    def pending(self, run_id: str | None = None, *, limit: int | None = None) -> list[dict[str, str]]:
        """The run's pending requests, the latest first; ``limit``: that many at most."""
        if run_id is None:
            return []  # the service asks by run: a tenant sees only its own
        latest = "ORDER BY updated_ns DESC, request_id"
        return self._select(run_id, "AND status = 'pending'", latest, limit=limit)

    def count_pending(self, run_id: str) -> int:
        """How many requests of the run wait, counted where they are kept (not read)."""
        rows = self.db.query(
            f"SELECT COUNT(*) FROM {self.table} WHERE run_id = ? AND status = 'pending'", (run_id,)
        )
        return _int(rows[0][0]) if rows else 0

    def _select(
        self, run_id: str, where: str, order: str, *, offset: int = 0, limit: int | None = None
    ) -> list[dict[str, str]]:
        page = "" if limit is None else f" LIMIT {int(limit)} OFFSET {int(offset)}"
        rows = self.db.query(
            f"SELECT request_id, action, rule, reason, status, decided_by FROM {self.table} WHERE run_id = ? "
            f"{where} {order}{page}",
            (run_id,),
        )
        keys = ("id", "action", "rule", "reason", "status", "by")
        return [{**dict(zip(keys, map(str, r), strict=True)), "run_id": run_id} for r in rows]


class DatabaseKillSource:
    """Kill switches and live marks in the service's database, for every worker.

    A run's ``KillSwitch`` asks ``reason`` ten times a second; one source serves every run of
    its process and reads the (small) table of pulled switches at most every ``poll_s``, so
    a worker costs the database one query per ``poll_s`` however many runs it holds. Live
    marks are written at most every ``beat_s`` per run (they count for ``LIVE_FOR_S``)."""

    def __init__(self, store: ServiceStore, *, poll_s: float = 0.5, beat_s: float = 4.0) -> None:
        self.store = store
        self.db = store.db
        self.kills = f"{store.ns}_kills"
        self.marks = f"{store.ns}_live"
        self.poll_s = poll_s
        self.beat_s = beat_s
        self._lock = threading.Lock()
        self._read_at = 0.0
        self._pulled: dict[str, str] = {}
        self._beats: dict[str, float] = {}

    def reason(self, run_id: str) -> str | None:
        with self._lock:
            if time.monotonic() - self._read_at >= self.poll_s:
                rows = self.db.query(f"SELECT run_id, reason FROM {self.kills}")
                self._pulled = {str(r[0]): str(r[1]) for r in rows}
                self._read_at = time.monotonic()
            return self._pulled.get(run_id)

    def kill(self, run_id: str, reason: str) -> None:
        self.db.write(
            [
                (
                    f"INSERT INTO {self.kills} VALUES (?, ?, ?) "
                    "ON CONFLICT (run_id) DO UPDATE SET reason = excluded.reason",
                    [(run_id, reason or "killed", time.time_ns())],
                )
            ]
        )

    def clear(self, run_id: str) -> None:
        self.db.write([(f"DELETE FROM {self.kills} WHERE run_id = ?", [(run_id,)])])
        with self._lock:
            self._pulled.pop(run_id, None)

    def mark_live(self, run_id: str, info: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._beats.get(run_id, -1e9) < self.beat_s:
                return
            self._beats[run_id] = now
        self.db.write(
            [
                (
                    f"INSERT INTO {self.marks} VALUES (?, ?, ?) ON CONFLICT (run_id) DO UPDATE "
                    "SET info = excluded.info, beat_ns = excluded.beat_ns",
                    [(run_id, info, time.time_ns())],
                )
            ]
        )

    def unmark_live(self, run_id: str) -> None:
        with self._lock:
            self._beats.pop(run_id, None)
        self.db.write([(f"DELETE FROM {self.marks} WHERE run_id = ?", [(run_id,)])])

    def live(self, run_id: str) -> str | None:
        rows = self.db.query(f"SELECT info, beat_ns FROM {self.marks} WHERE run_id = ?", (run_id,))
        if not rows or time.time_ns() - _int(rows[0][1]) > LIVE_FOR_S * 1e9:
            return None
        return str(LiveRun.decode(run_id, str(rows[0][0])))

    def end_waiting(self, reason: str, *, tenant: str | None = None) -> list[LiveRun]:
        """End every run of ``tenant`` (of every tenant, when None) that waits: queued, paused
        for an approval, interrupted or broken. A kill-all pulls the switches of the live runs;
        without this, a worker would take up the queued ones right after. A run a worker took
        meanwhile has its switch pulled instead. Returns them, ``where`` saying what each was."""
        ended = []
        for row in self.store.waiting_runs(tenant):
            if self.store.set_status(row.run_id, "killed", error=reason, only_from=WAITING):
                ended.append(LiveRun(run_id=row.run_id, where=row.status, tenant=row.tenant))
            else:  # taken up meanwhile: its switch stops it
                self.kill(row.run_id, reason)
                ended.append(LiveRun(run_id=row.run_id, where="started meanwhile", tenant=row.tenant))
        # "running" with no fresh mark: its worker died, and the broker will hand the run to
        # another, which resumes it; no live mark lists it, so its switch is pulled here (a
        # kill-all missed it, and the run went on with two more calls)
        known = {run.run_id for run in (*self.live_runs(), *ended)}
        for row in self.store.running_runs(tenant):
            if row.run_id not in known:
                self.kill(row.run_id, reason)
                ended.append(LiveRun(run_id=row.run_id, where="its worker silent", tenant=row.tenant))
        return ended

    def live_runs(self) -> list[LiveRun]:
        """Every run whose mark is fresh, wherever it runs (``kill_all``)."""
        fresh = time.time_ns() - int(LIVE_FOR_S * 1e9)
        rows = self.db.query(
            f"SELECT run_id, info FROM {self.marks} WHERE beat_ns >= ? ORDER BY run_id", (fresh,)
        )
        return [LiveRun.decode(str(r[0]), str(r[1])) for r in rows]


def database_kill_source(url: str) -> DatabaseKillSource:
    """The kill switches of the service whose database is ``url`` (``sqlite:///PATH`` or
    ``postgresql://...``): what ``stockade kill --target URL`` pulls. Its tables are made if
    missing, as the service would."""
    return DatabaseKillSource(ServiceStore(open_database(url)), poll_s=0.0)
