"""``RunStore``: runs, steps, tool calls, retries and approvals, checkpointed after every step.

    store = open_run_store("sqlite:///.stockade/audit.db")    # or postgresql://...
    recorder = RunRecorder(store)
    agent = Agent(model, checkpointer=store, observers=[recorder])

It is the agent's ``Checkpointer``, stored as append-only rows so that the cost of a save
does not grow with the run: a checkpoint row holds the small part of ``RunState``, and the
conversation and the finished steps are rows of their own, each written once (a save writes
only the messages and steps added since the last one).

Tool calls are also written to a ledger, keyed by their idempotency key, the moment they
return (``RunRecorder``), before the loop's next checkpoint. ``load`` folds the calls the
ledger has and the checkpoint lacks back into the step in progress, so a run killed right
after a side effect resumes without doing it again. What no store can close is the instant
between a tool's side effect and its return; a tool that must be exactly-once there can use
its ``ToolContext`` (run, step, call id) as its own idempotency key.

Every row passes through a ``Redactor`` before it is written, as audit events do: a run
resumed from the store sees ``[REDACTED]`` where a secret was, never the secret.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from stockade import exceptions as exc
from stockade.agent.state import RunState, RunStatus, StepRecord, ToolCallRecord
from stockade.audit.redact import Redactor
from stockade.audit.stores import check_namespace
from stockade.models.messages import Message, ToolResultMessage, Usage
from stockade.runs._db import Database, PostgresDatabase, SQLiteDatabase, Statement
from stockade.runs.seeds import MAX_SEED_BYTES, pack_workspace, unpack_seed

__all__ = ["ApprovalEntry", "RetryEntry", "RunStore", "RunSummary", "RunTrace", "open_run_store"]


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """One line of ``stockade runs list``."""

    run_id: str
    task: str
    model_name: str
    status: RunStatus
    steps: int
    usage: Usage
    cost_usd: float
    elapsed_s: float
    error: str | None
    created_ns: int
    updated_ns: int


@dataclass(frozen=True, kw_only=True)
class RetryEntry:
    """A transient failure that was tried again, and where in the run it happened."""

    step: int
    call_id: str | None
    subject: str
    attempt: int
    delay_s: float
    reason: str
    recorded_ns: int


@dataclass(frozen=True, kw_only=True)
class ApprovalEntry:
    step: int
    request_id: str
    action: str
    rule: str
    reason: str
    decision: str  # approved, denied, pending
    recorded_ns: int


@dataclass(frozen=True, kw_only=True)
class RunTrace:
    """Everything ``stockade runs show`` prints: the state, what happened around it, the diff."""

    summary: RunSummary
    state: RunState
    retries: tuple[RetryEntry, ...]
    approvals: tuple[ApprovalEntry, ...]
    diff: str | None

    def retries_of(self, step: int, call_id: str) -> tuple[RetryEntry, ...]:
        return tuple(r for r in self.retries if r.step == step and r.call_id == call_id)


@dataclass
class _Saved:
    """What this process has already written for one run (the rows need not be written again)."""

    seq: int = 0
    messages: list[Message] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    ledger: set[str] = field(default_factory=set)


def _schema(ns: str, serial: str, blob: str) -> list[str]:
    return [
        f"""CREATE TABLE IF NOT EXISTS {ns}_runs (
            run_id TEXT PRIMARY KEY, task TEXT NOT NULL, model_name TEXT NOT NULL,
            status TEXT NOT NULL, steps INTEGER NOT NULL, input_tokens BIGINT NOT NULL,
            output_tokens BIGINT NOT NULL, requests BIGINT NOT NULL, cost_usd DOUBLE PRECISION NOT NULL,
            elapsed_s DOUBLE PRECISION NOT NULL, error TEXT, diff TEXT,
            created_ns BIGINT NOT NULL, updated_ns BIGINT NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_checkpoints (
            run_id TEXT NOT NULL, seq BIGINT NOT NULL, created_ns BIGINT NOT NULL,
            messages INTEGER NOT NULL, steps INTEGER NOT NULL, body TEXT NOT NULL,
            PRIMARY KEY (run_id, seq))""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_messages (
            run_id TEXT NOT NULL, idx INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, idx))""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_steps (
            run_id TEXT NOT NULL, idx INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, idx))""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_tool_calls (
            idempotency_key TEXT PRIMARY KEY, run_id TEXT NOT NULL, step INTEGER NOT NULL,
            call_id TEXT NOT NULL, tool TEXT NOT NULL, recorded_ns BIGINT NOT NULL, body TEXT NOT NULL)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_tool_calls_run ON {ns}_tool_calls (run_id, step)",
        f"""CREATE TABLE IF NOT EXISTS {ns}_retries (
            id {serial}, run_id TEXT NOT NULL, step INTEGER NOT NULL, call_id TEXT,
            subject TEXT NOT NULL, attempt INTEGER NOT NULL, delay_s DOUBLE PRECISION NOT NULL,
            reason TEXT NOT NULL, recorded_ns BIGINT NOT NULL)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_retries_run ON {ns}_retries (run_id)",
        f"""CREATE TABLE IF NOT EXISTS {ns}_approvals (
            id {serial}, run_id TEXT NOT NULL, step INTEGER NOT NULL, request_id TEXT NOT NULL,
            action TEXT NOT NULL, rule TEXT NOT NULL, reason TEXT NOT NULL, decision TEXT NOT NULL,
            recorded_ns BIGINT NOT NULL)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_approvals_run ON {ns}_approvals (run_id)",
        # starting workspaces, content-addressed: identical seeds are stored once
        f"""CREATE TABLE IF NOT EXISTS {ns}_seeds (
            digest TEXT PRIMARY KEY, bytes BIGINT NOT NULL, data {blob} NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_run_seeds (
            run_id TEXT PRIMARY KEY, digest TEXT NOT NULL, recorded_ns BIGINT NOT NULL)""",
    ]


def _first_change(saved: Sequence[object], now: Sequence[object]) -> int:
    """The index from which ``now`` differs from what was written (identity, not equality).

    The loop only appends, so this is normally ``len(saved)``: when the first and last rows
    written are still in place, the answer comes without walking the run (a save must not
    cost more late in a run than early); otherwise a pointer walk finds the change."""
    n = len(saved)
    if n == 0 or (len(now) >= n and now[0] is saved[0] and now[n - 1] is saved[n - 1]):
        return n
    for i, (a, b) in enumerate(zip(saved, now, strict=False)):
        if a is not b:
            return i
    return min(len(saved), len(now))


class RunStore:
    """Runs in a SQL database (tables ``<namespace>_*``); implements ``Checkpointer``."""

    def __init__(
        self,
        db: Database,
        *,
        namespace: str = "runs",
        redactor: Redactor | None = None,
        max_seed_bytes: int = MAX_SEED_BYTES,
    ) -> None:
        self.db = db
        self.max_seed_bytes = max_seed_bytes
        # Remembering: an observation is written in a message, a step and the ledger, and an
        # agent reads the same files again and again; each long text is redacted once.
        self.redactor = (redactor if redactor is not None else Redactor()).remembering()
        self.ns = check_namespace(namespace)
        self.url = db.url
        self._lock = threading.Lock()
        self._saved: dict[str, _Saved] = {}
        self.db.write([(sql, [()]) for sql in _schema(self.ns, db.serial, db.blob)])

    # -- Checkpointer ---------------------------------------------------------------------

    def save(self, state: RunState) -> None:
        """Append a checkpoint, and the messages and steps added since the last one."""
        ns, run_id, now = self.ns, state.run_id, time.time_ns()
        with self._lock:
            saved = self._saved.get(run_id) or self._recall(run_id)
            msg_from = _first_change(saved.messages, state.messages)
            step_from = _first_change(saved.steps, state.steps)
            new_records = [(s.index, r) for s in state.steps[step_from:] for r in s.tool_calls]
            if state.current is not None:
                new_records.extend((state.current.index, r) for r in state.current.tool_calls)
            ledger = [(i, r) for i, r in new_records if r.idempotency_key not in saved.ledger]
            body = self._json(state, exclude={"messages", "steps"})
            statements: list[Statement] = [
                (
                    f"INSERT INTO {ns}_messages VALUES (?, ?, ?) "
                    "ON CONFLICT (run_id, idx) DO UPDATE SET body = excluded.body",
                    [(run_id, i, self._json(m)) for i, m in enumerate(state.messages[msg_from:], msg_from)],
                ),
                (
                    f"INSERT INTO {ns}_steps VALUES (?, ?, ?) "
                    "ON CONFLICT (run_id, idx) DO UPDATE SET body = excluded.body",
                    [(run_id, i, self._json(s)) for i, s in enumerate(state.steps[step_from:], step_from)],
                ),
                (
                    f"INSERT INTO {ns}_checkpoints VALUES (?, ?, ?, ?, ?, ?)",
                    [(run_id, saved.seq + 1, now, len(state.messages), len(state.steps), body)],
                ),
                (self._ledger_sql(), [self._ledger_row(run_id, i, r, now) for i, r in ledger]),
                (
                    f"""INSERT INTO {ns}_runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, ?, ?)
                    ON CONFLICT (run_id) DO UPDATE SET status = excluded.status, steps = excluded.steps,
                        input_tokens = excluded.input_tokens, output_tokens = excluded.output_tokens,
                        requests = excluded.requests, cost_usd = excluded.cost_usd,
                        elapsed_s = excluded.elapsed_s, error = excluded.error,
                        updated_ns = excluded.updated_ns""",
                    [
                        (
                            run_id,
                            self.redactor.text(state.task),
                            state.model_name,
                            state.status.value,
                            len(state.steps),
                            state.usage.input_tokens,
                            state.usage.output_tokens,
                            state.usage.requests,
                            state.cost_usd,
                            state.elapsed_s,
                            None if state.error is None else self.redactor.text(state.error),
                            now,
                            now,
                        )
                    ],
                ),
            ]
            self.db.write([s for s in statements if s[1]])
            saved.seq += 1
            # Only what was added is copied (the saved lists are the written prefix, extended).
            del saved.messages[msg_from:], saved.steps[step_from:]
            saved.messages.extend(state.messages[msg_from:])
            saved.steps.extend(state.steps[step_from:])
            saved.ledger.update(r.idempotency_key for _, r in ledger)
            self._saved[run_id] = saved

    def load(self, run_id: str) -> RunState | None:
        """The latest checkpoint, with the tool calls that returned after it folded in."""
        ns = self.ns
        rows = self.db.query(
            f"SELECT seq, messages, steps, body FROM {ns}_checkpoints WHERE run_id = ? "
            "ORDER BY seq DESC LIMIT 1",
            (run_id,),
        )
        if not rows:
            return None
        seq, n_messages, n_steps, body = rows[0]
        messages = self.db.query(
            f"SELECT body FROM {ns}_messages WHERE run_id = ? AND idx < ? ORDER BY idx", (run_id, n_messages)
        )
        steps = self.db.query(
            f"SELECT body FROM {ns}_steps WHERE run_id = ? AND idx < ? ORDER BY idx", (run_id, n_steps)
        )
        # Splice the stored JSON rather than parse and re-serialise it.
        document = (
            '{"messages":['
            + ",".join(str(m[0]) for m in messages)
            + '],"steps":['
            + ",".join(str(s[0]) for s in steps)
            + "],"
            + str(body)[1:]
        )
        state = RunState.model_validate_json(document)
        saved = _Saved(seq=_int(seq), messages=list(state.messages), steps=list(state.steps))
        self._fold_ledger(state)
        with self._lock:
            saved.ledger = {r.idempotency_key for s in state.steps for r in s.tool_calls}
            if state.current is not None:
                saved.ledger.update(r.idempotency_key for r in state.current.tool_calls)
            self._saved[run_id] = saved
        return state

    def _recall(self, run_id: str) -> _Saved:
        """A run this process has not written yet: continue its checkpoint numbering."""
        rows = self.db.query(f"SELECT MAX(seq) FROM {self.ns}_checkpoints WHERE run_id = ?", (run_id,))
        return _Saved(seq=_int(rows[0][0]) if rows and rows[0][0] is not None else 0)

    def _fold_ledger(self, state: RunState) -> None:
        current = state.current
        if current is None or state.status.finished:
            return
        recorded = {r.call.id: r for r in self.tool_calls(state.run_id, step=current.index)}
        done = {r.call.id for r in current.tool_calls}
        for call in current.response.tool_calls:
            if call.id in done:
                continue
            record = recorded.get(call.id)
            if record is None:
                break  # the loop runs calls in order: this one runs next
            current = current.model_copy(update={"tool_calls": (*current.tool_calls, record)})
            state.messages.append(
                ToolResultMessage(
                    call_id=call.id,
                    name=record.call.name,
                    content=record.observation,
                    is_error=record.is_error,
                )
            )
            state.consecutive_denials = 0  # the call passed the guards
        state.current = current

    # -- what the recorder writes ------------------------------------------------------------

    def _ledger_sql(self) -> str:
        return f"INSERT INTO {self.ns}_tool_calls VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"

    def _json(self, model: BaseModel, *, exclude: set[str] | None = None) -> str:
        """The model as JSON with every string redacted (keys naming a credential: the whole value)."""
        data = self.redactor.value(model.model_dump(mode="json", exclude=exclude))
        return json.dumps(data, ensure_ascii=False, separators=(",", ":"))

    def _ledger_row(self, run_id: str, step: int, record: ToolCallRecord, now: int) -> tuple[object, ...]:
        return (
            record.idempotency_key,
            run_id,
            step,
            record.call.id,
            record.call.name,
            now,
            self._json(record),
        )

    def record_tool_call(self, run_id: str, step: int, record: ToolCallRecord) -> None:
        """Write one returned call to the ledger now (idempotent: a key is written once)."""
        with self._lock:
            saved = self._saved.setdefault(run_id, _Saved())
            if record.idempotency_key in saved.ledger:
                return
            self.db.write([(self._ledger_sql(), [self._ledger_row(run_id, step, record, time.time_ns())])])
            saved.ledger.add(record.idempotency_key)

    def record_retry(self, run_id: str, entry: RetryEntry) -> None:
        self.db.write(
            [
                (
                    f"INSERT INTO {self.ns}_retries (run_id, step, call_id, subject, attempt, delay_s, "
                    "reason, recorded_ns) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (
                            run_id,
                            entry.step,
                            entry.call_id,
                            entry.subject,
                            entry.attempt,
                            entry.delay_s,
                            entry.reason,
                            entry.recorded_ns,
                        )
                    ],
                )
            ]
        )

    def record_approval(self, run_id: str, entry: ApprovalEntry) -> None:
        self.db.write(
            [
                (
                    f"INSERT INTO {self.ns}_approvals (run_id, step, request_id, action, rule, reason, "
                    "decision, recorded_ns) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (
                            run_id,
                            entry.step,
                            entry.request_id,
                            entry.action,
                            entry.rule,
                            entry.reason,
                            entry.decision,
                            entry.recorded_ns,
                        )
                    ],
                )
            ]
        )

    def record_diff(self, run_id: str, diff: str) -> None:
        """The workspace diff at the end of the run (the one mutable column: the latest end wins)."""
        self.db.write(
            [(f"UPDATE {self.ns}_runs SET diff = ? WHERE run_id = ?", [(self.redactor.text(diff), run_id)])]
        )

    def save_seed(self, run_id: str, workspace: str | Path) -> str:
        """Keep the folder ``workspace`` as the run's starting workspace; returns its digest.

        ``SeedTooLarge`` past ``max_seed_bytes``. A run keeps its first seed (a resumed run
        does not replace where it started)."""
        seed = pack_workspace(workspace, max_bytes=self.max_seed_bytes)
        self.db.write(
            [
                (
                    f"INSERT INTO {self.ns}_seeds VALUES (?, ?, ?) ON CONFLICT (digest) DO NOTHING",
                    [(seed.digest, len(seed.data), seed.data)],
                ),
                (
                    f"INSERT INTO {self.ns}_run_seeds VALUES (?, ?, ?) ON CONFLICT (run_id) DO NOTHING",
                    [(run_id, seed.digest, time.time_ns())],
                ),
            ]
        )
        return seed.digest

    def restore_seed(self, run_id: str, dest: str | Path) -> bool:
        """Unpack the run's starting workspace into ``dest``; ``False`` when none was kept."""
        rows = self.db.query(
            f"SELECT s.data FROM {self.ns}_run_seeds r JOIN {self.ns}_seeds s ON s.digest = r.digest "
            "WHERE r.run_id = ?",
            (run_id,),
        )
        if not rows:
            return False
        data = rows[0][0]
        unpack_seed(bytes(data) if isinstance(data, bytes | bytearray | memoryview) else b"", dest)
        return True

    # -- reading ------------------------------------------------------------------------------

    def runs(self, *, limit: int = 50, status: RunStatus | None = None) -> list[RunSummary]:
        """The most recently updated runs first."""
        where, params = ("WHERE status = ?", [status.value]) if status is not None else ("", [])
        rows = self.db.query(
            f"SELECT {_SUMMARY} FROM {self.ns}_runs {where} ORDER BY updated_ns DESC LIMIT ?",
            [*params, limit],
        )
        return [_summary(r) for r in rows]

    def summary(self, run_id: str) -> RunSummary | None:
        rows = self.db.query(f"SELECT {_SUMMARY} FROM {self.ns}_runs WHERE run_id = ?", (run_id,))
        return _summary(rows[0]) if rows else None

    def find(self, prefix: str) -> list[str]:
        """Run ids starting with ``prefix`` (the CLI accepts a unique prefix)."""
        like = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self.db.query(
            f"SELECT run_id FROM {self.ns}_runs WHERE run_id LIKE ? ESCAPE '\\' ORDER BY run_id LIMIT 10",
            (like,),
        )
        return [str(r[0]) for r in rows]

    def tool_calls(self, run_id: str, *, step: int | None = None) -> list[ToolCallRecord]:
        """The ledger of ``run_id`` (in the order the calls returned)."""
        sql = f"SELECT body FROM {self.ns}_tool_calls WHERE run_id = ?"
        params: list[object] = [run_id]
        if step is not None:
            sql += " AND step = ?"
            params.append(step)
        rows = self.db.query(sql + " ORDER BY recorded_ns, idempotency_key", params)
        return [ToolCallRecord.model_validate_json(str(r[0])) for r in rows]

    def retries(self, run_id: str) -> list[RetryEntry]:
        rows = self.db.query(
            f"SELECT step, call_id, subject, attempt, delay_s, reason, recorded_ns FROM {self.ns}_retries "
            "WHERE run_id = ? ORDER BY id",
            (run_id,),
        )
        return [
            RetryEntry(
                step=_int(r[0]),
                call_id=None if r[1] is None else str(r[1]),
                subject=str(r[2]),
                attempt=_int(r[3]),
                delay_s=_float(r[4]),
                reason=str(r[5]),
                recorded_ns=_int(r[6]),
            )
            for r in rows
        ]

    def approvals(self, run_id: str) -> list[ApprovalEntry]:
        rows = self.db.query(
            f"SELECT step, request_id, action, rule, reason, decision, recorded_ns FROM {self.ns}_approvals "
            "WHERE run_id = ? ORDER BY id",
            (run_id,),
        )
        return [
            ApprovalEntry(
                step=_int(r[0]),
                request_id=str(r[1]),
                action=str(r[2]),
                rule=str(r[3]),
                reason=str(r[4]),
                decision=str(r[5]),
                recorded_ns=_int(r[6]),
            )
            for r in rows
        ]

    def trace(self, run_id: str) -> RunTrace | None:
        summary = self.summary(run_id)
        state = self.load(run_id) if summary is not None else None
        if summary is None or state is None:
            return None
        rows = self.db.query(f"SELECT diff FROM {self.ns}_runs WHERE run_id = ?", (run_id,))
        diff = rows[0][0] if rows else None
        return RunTrace(
            summary=summary,
            state=state,
            retries=tuple(self.retries(run_id)),
            approvals=tuple(self.approvals(run_id)),
            diff=None if diff is None else str(diff),
        )

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_SUMMARY = (
    "run_id, task, model_name, status, steps, input_tokens, output_tokens, requests, cost_usd, "
    "elapsed_s, error, created_ns, updated_ns"
)


def _int(value: object) -> int:
    return int(str(value))


def _float(value: object) -> float:
    return float(str(value))


def _summary(row: tuple[object, ...]) -> RunSummary:
    return RunSummary(
        run_id=str(row[0]),
        task=str(row[1]),
        model_name=str(row[2]),
        status=RunStatus(str(row[3])),
        steps=_int(row[4]),
        usage=Usage(input_tokens=_int(row[5]), output_tokens=_int(row[6]), requests=_int(row[7])),
        cost_usd=_float(row[8]),
        elapsed_s=_float(row[9]),
        error=None if row[10] is None else str(row[10]),
        created_ns=_int(row[11]),
        updated_ns=_int(row[12]),
    )


def open_run_store(url: str, *, namespace: str = "runs", redactor: Redactor | None = None) -> RunStore:
    """A run store from a URL: ``sqlite:///PATH`` (may be the audit database file), a plain
    file path, ``postgresql://...``, or ``memory:``."""
    if url.startswith(("postgresql://", "postgres://")):
        return RunStore(PostgresDatabase(url), namespace=namespace, redactor=redactor)
    if url.startswith("sqlite:///"):
        return RunStore(SQLiteDatabase(url[len("sqlite:///") :]), namespace=namespace, redactor=redactor)
    if url == "memory:":  # tests and one-off tools
        return RunStore(SQLiteDatabase(":memory:"), namespace=namespace, redactor=redactor)
    if "://" in url:
        raise exc.ConfigurationError(f"unknown run store URL {url!r}: use sqlite:///PATH or postgresql://...")
    return RunStore(SQLiteDatabase(url), namespace=namespace, redactor=redactor)
