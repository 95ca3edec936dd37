"""The run store's tables: their SQL (one schema for SQLite and PostgreSQL, every table
named ``<namespace>_*``), which of them hold a run's rows, and how a row of ``_runs`` becomes
a ``RunSummary``.

Apart from ``store.py`` and its collaborators, which say what is written when, so that the
layout of the data can be read in one place.
"""

from __future__ import annotations

from collections.abc import Callable

from stockade.agent.state import RunStatus
from stockade.models.messages import Usage
from stockade.runs.records import RunSummary


def schema(ns: str, serial: str, blob: str) -> list[str]:
    return [
        f"""CREATE TABLE IF NOT EXISTS {ns}_runs (
            run_id TEXT PRIMARY KEY, task TEXT NOT NULL, model_name TEXT NOT NULL,
            status TEXT NOT NULL, steps INTEGER NOT NULL, input_tokens BIGINT NOT NULL,
            output_tokens BIGINT NOT NULL, requests BIGINT NOT NULL, cost_usd DOUBLE PRECISION NOT NULL,
            elapsed_s DOUBLE PRECISION NOT NULL, error TEXT, diff TEXT,
            created_ns BIGINT NOT NULL, updated_ns BIGINT NOT NULL, mac TEXT)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_checkpoints (
            run_id TEXT NOT NULL, seq BIGINT NOT NULL, created_ns BIGINT NOT NULL,
            messages INTEGER NOT NULL, steps INTEGER NOT NULL, body TEXT NOT NULL, mac TEXT,
            PRIMARY KEY (run_id, seq))""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_messages (
            run_id TEXT NOT NULL, idx INTEGER NOT NULL, body TEXT NOT NULL, mac TEXT,
            PRIMARY KEY (run_id, idx))""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_steps (
            run_id TEXT NOT NULL, idx INTEGER NOT NULL, body TEXT NOT NULL, mac TEXT,
            PRIMARY KEY (run_id, idx))""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_tool_calls (
            idempotency_key TEXT PRIMARY KEY, run_id TEXT NOT NULL, step INTEGER NOT NULL,
            call_id TEXT NOT NULL, tool TEXT NOT NULL, recorded_ns BIGINT NOT NULL, body TEXT NOT NULL,
            mac TEXT)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_tool_calls_run ON {ns}_tool_calls (run_id, step)",
        f"""CREATE TABLE IF NOT EXISTS {ns}_retries (
            id {serial}, run_id TEXT NOT NULL, step INTEGER NOT NULL, call_id TEXT,
            subject TEXT NOT NULL, attempt INTEGER NOT NULL, delay_s DOUBLE PRECISION NOT NULL,
            reason TEXT NOT NULL, recorded_ns BIGINT NOT NULL, mac TEXT)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_retries_run ON {ns}_retries (run_id)",
        f"""CREATE TABLE IF NOT EXISTS {ns}_approvals (
            id {serial}, run_id TEXT NOT NULL, step INTEGER NOT NULL, request_id TEXT NOT NULL,
            action TEXT NOT NULL, rule TEXT NOT NULL, reason TEXT NOT NULL, decision TEXT NOT NULL,
            recorded_ns BIGINT NOT NULL, mac TEXT)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_approvals_run ON {ns}_approvals (run_id)",
        # starting workspaces, content-addressed: identical seeds are stored once; uses: how
        # many times a run took it (an erasure deletes one no run took since it looked: ``erasure``)
        f"""CREATE TABLE IF NOT EXISTS {ns}_seeds (
            digest TEXT PRIMARY KEY, bytes BIGINT NOT NULL, data {blob} NOT NULL,
            uses BIGINT NOT NULL DEFAULT 0)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_run_seeds (
            run_id TEXT PRIMARY KEY, digest TEXT NOT NULL, recorded_ns BIGINT NOT NULL, mac TEXT)""",
        # what a run ran under (``RunSetup``): a replay runs under the same
        f"""CREATE TABLE IF NOT EXISTS {ns}_setups (
            run_id TEXT PRIMARY KEY, policy TEXT NOT NULL, role TEXT, tier TEXT,
            policy_file TEXT, policy_digest TEXT, recorded_ns BIGINT NOT NULL, mac TEXT)""",
        # the run's own budgets (``RunLimits``, as JSON): a replay runs under the same
        f"""CREATE TABLE IF NOT EXISTS {ns}_run_limits (
            run_id TEXT PRIMARY KEY, body TEXT NOT NULL, recorded_ns BIGINT NOT NULL, mac TEXT)""",
        # the run's acceptance check and its timeout (as JSON; a null command: it had none)
        f"""CREATE TABLE IF NOT EXISTS {ns}_run_checks (
            run_id TEXT PRIMARY KEY, body TEXT NOT NULL, recorded_ns BIGINT NOT NULL, mac TEXT)""",
        # the workspace diff at the run's end: what a reviewer reads, signed
        f"""CREATE TABLE IF NOT EXISTS {ns}_run_diffs (
            run_id TEXT PRIMARY KEY, diff TEXT NOT NULL, recorded_ns BIGINT NOT NULL, mac TEXT)""",
        # one owner per run (expires_ns 0: released)
        f"""CREATE TABLE IF NOT EXISTS {ns}_leases (
            run_id TEXT PRIMARY KEY, owner TEXT NOT NULL, expires_ns BIGINT NOT NULL,
            acquired_ns BIGINT NOT NULL, mac TEXT)""",
        # tool calls about to run (the ledger says which returned)
        f"""CREATE TABLE IF NOT EXISTS {ns}_calls_started (
            idempotency_key TEXT PRIMARY KEY, run_id TEXT NOT NULL, step INTEGER NOT NULL,
            call_id TEXT NOT NULL, tool TEXT NOT NULL, idempotent INTEGER NOT NULL,
            attempts INTEGER NOT NULL, started_ns BIGINT NOT NULL, mac TEXT)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_calls_started_run ON {ns}_calls_started (run_id, step)",
        # workspaces step by step: file contents by SHA-256 (zlib), and per version the paths
        # that changed (body NULL: removed)
        f"""CREATE TABLE IF NOT EXISTS {ns}_blobs (
            digest TEXT PRIMARY KEY, bytes BIGINT NOT NULL, data {blob} NOT NULL,
            uses BIGINT NOT NULL DEFAULT 0)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_workspace (
            run_id TEXT NOT NULL, version BIGINT NOT NULL, path TEXT NOT NULL, body TEXT,
            blob_bytes BIGINT NOT NULL, mac TEXT, PRIMARY KEY (run_id, version, path))""",
        # whose personal data a run holds (a data subject), so that it can be erased
        f"""CREATE TABLE IF NOT EXISTS {ns}_subjects (
            run_id TEXT NOT NULL, subject TEXT NOT NULL, PRIMARY KEY (run_id, subject))""",
        f"CREATE INDEX IF NOT EXISTS {ns}_subjects_subject ON {ns}_subjects (subject)",
        # the ids of erased runs (nothing else of them): an id is never given to a new run, whose
        # events would share the old ones' id in the audit trail
        f"""CREATE TABLE IF NOT EXISTS {ns}_erased (
            run_id TEXT PRIMARY KEY, erased_ns BIGINT NOT NULL)""",
    ]


def tables(ns: str) -> list[str]:
    """The names of the tables ``schema`` makes."""
    return [sql.split()[5] for sql in schema(ns, "", "") if sql.startswith("CREATE TABLE")]


# The tables whose rows a resume acts on: each row carries a MAC (``_mac``) in its last column,
# ``mac``, added to a database made before it had one.
# SIGNED: each table's columns its MAC covers, in order, and how many of them name the row.
_RUN_COLUMNS = (
    "run_id", "task", "model_name", "status", "steps", "input_tokens", "output_tokens", "requests",
    "cost_usd", "elapsed_s", "error", "created_ns", "updated_ns",
)  # fmt: skip
SIGNED: dict[str, tuple[tuple[str, ...], int]] = {
    # what `runs list`, the viewer and the service show of a run (the service takes a
    # redelivered run's status from it): a failed run edited into another status, any cost
    "runs": (_RUN_COLUMNS, 1),
    "checkpoints": (("run_id", "seq", "created_ns", "messages", "steps", "body"), 2),
    "messages": (("run_id", "idx", "body"), 2),
    "steps": (("run_id", "idx", "body"), 2),
    "tool_calls": (("idempotency_key", "run_id", "step", "call_id", "tool", "recorded_ns", "body"), 2),
    # attempts and started_ns change as the call starts again; what it is does not
    "calls_started": (("idempotency_key", "run_id", "step", "call_id", "tool", "idempotent"), 2),
    # who holds the run and until when: what `audit verify` takes as proof that a run is live
    # (one edited to look live, or released, hid its crashed call from it; found from outside)
    "leases": (("run_id", "owner", "expires_ns"), 1),
    "workspace": (("run_id", "version", "path", "body", "blob_bytes"), 3),
    "run_seeds": (("run_id", "digest", "recorded_ns"), 1),
    # what a replay runs under: a policy loosened in the database would loosen the replay
    "setups": (("run_id", "policy", "role", "tier", "policy_file", "policy_digest", "recorded_ns"), 1),
    "run_limits": (("run_id", "body", "recorded_ns"), 1),
    # a check edited away would make a failed run replay as a success
    "run_checks": (("run_id", "body", "recorded_ns"), 1),
    # the diff `runs show`, the viewer and the API give: one edited hid a change from its reader
    "run_diffs": (("run_id", "diff", "recorded_ns"), 1),
    # what `runs show` says was approved or tried again: a denial edited into an approval, a
    # retry made up (found from outside)
    "approvals": (("run_id", "step", "request_id", "action", "rule", "reason", "decision", "recorded_ns"), 3),
    "retries": (("run_id", "step", "call_id", "subject", "attempt", "delay_s", "reason", "recorded_ns"), 3),
}
MAC_TABLES = tuple(SIGNED)


# The tables holding rows of a run (``erase`` empties them of it); blobs and seeds are shared.
RUN_TABLES = (
    "runs", "checkpoints", "messages", "steps", "tool_calls", "retries", "approvals", "run_seeds",
    "setups", "run_limits", "run_checks", "run_diffs", "leases", "calls_started", "workspace", "subjects",
)  # fmt: skip


def run_bytes_sql(ns: str, octets: Callable[[str], str]) -> tuple[str, int]:
    """One SQL expression: the bytes a run's own rows take, and how many ``?`` it holds (each
    the run's id). Text by its size (``octets``: the database's SQL for it); its workspace's
    file contents by what it added to ``_blobs`` (``blob_bytes``: compressed, and nothing for
    a content the store had already). Seeds are not counted: a seed is a workspace its
    tenant uploaded, kept once however many runs start from it."""

    def total(table: str, *columns: str) -> str:
        size = " + ".join(f"COALESCE({octets(c)}, 0)" for c in columns)
        return f"(SELECT COALESCE(SUM({size}), 0) FROM {ns}_{table} WHERE run_id = ?)"

    parts = [
        total("runs", "task", "error", "diff"),
        total("checkpoints", "body"),
        total("messages", "body"),
        total("steps", "body"),
        total("tool_calls", "body"),
        total("retries", "reason"),
        total("approvals", "action", "reason"),
        total("setups", "policy"),
        total("run_limits", "body"),
        total("run_checks", "body"),
        total("run_diffs", "diff"),
        total("workspace", "path", "body"),
        f"(SELECT COALESCE(SUM(blob_bytes), 0) FROM {ns}_workspace WHERE run_id = ?)",
    ]
    return "(" + " + ".join(parts) + ")", len(parts)


def as_int(value: object) -> int:
    return int(str(value))


def as_float(value: object) -> float:
    return float(str(value))


def summary_from_row(row: tuple[object, ...]) -> RunSummary:
    """A ``_runs`` row's signed columns (``SIGNED["runs"]``, in order) as its summary."""
    return RunSummary(
        run_id=str(row[0]),
        task=str(row[1]),
        model_name=str(row[2]),
        status=RunStatus(str(row[3])),
        steps=as_int(row[4]),
        usage=Usage(input_tokens=as_int(row[5]), output_tokens=as_int(row[6]), requests=as_int(row[7])),
        cost_usd=as_float(row[8]),
        elapsed_s=as_float(row[9]),
        error=None if row[10] is None else str(row[10]),
        created_ns=as_int(row[11]),
        updated_ns=as_int(row[12]),
    )
