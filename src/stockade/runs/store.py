"""``RunStore``: runs, steps, tool calls, retries and approvals, checkpointed after every step.

    store = open_run_store("sqlite:///.stockade/audit.db")    # or postgresql://...
    recorder = RunRecorder(store)
    agent = Agent(model, checkpointer=store, observers=[recorder])

It is the agent's ``Checkpointer``, stored as append-only rows so that the cost of a save
does not grow with the run: a checkpoint row holds the small part of ``RunState``, and the
conversation and the finished steps are rows of their own, each written once (a save writes
only the messages and steps added since the last one).

It is also what makes a run durable (the loop uses it through ``DurableCheckpointer``):

- **one owner per run**: ``claim`` takes the run's lease (``lease``), refused (``RunLeased``)
  while another live process holds it, and refused (``RunConflict``) for a new run whose id
  the store has, or a run that ended; a lease that expired marks its run ``interrupted``;
- **calls started**: before a tool runs, ``call_started`` records it, with the tool's
  ``idempotent`` flag;
- **the ledger**: the moment a call returns, ``record_workspace`` writes it, keyed by its
  idempotency key, with the workspace as the call left it (``workspace``: what changed,
  content-addressed), in one transaction, before the loop's next checkpoint;
- **resume**: ``load`` folds the calls the ledger has and the checkpoint lacks back into the
  step in progress, so a call that returned is never run again; a call that started and did
  not return is run again if its tool is idempotent, and otherwise recorded as
  ``OutcomeUnknown`` (the model is told, and not run again); ``restore_workspace`` puts the
  workspace of the last recorded call into the resumed run's sandbox.

What no store can close is the instant between a tool's side effect outside the sandbox and
its return: a tool that must be exactly-once there deduplicates with ``ctx.idempotency_key``.

Every row passes through a ``Redactor`` before it is written, as audit events do: a run
resumed from the store sees ``[REDACTED]`` where a secret was, never the secret.

A run's data can be erased (``erase``: the run's rows, and the workspace contents and seeds no
other run shares), by run, by data subject (``tag_subject``, ``runs_of``) or by age: a subject's
right to erasure, a retention period. The audit trail is another store: erasing runs leaves
its chain as it was, so it still verifies.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, TypeAdapter, ValidationError

from stockade import exceptions as exc
from stockade.agent.state import RunState, RunStatus, StepRecord, ToolCallRecord
from stockade.audit.redact import Redactor
from stockade.audit.stores import check_namespace
from stockade.audit.verify import LedgerCall
from stockade.models.messages import Message, ToolCall, ToolResultMessage
from stockade.runs._db import Database, PostgresDatabase, Requirement, SQLiteDatabase, Statement
from stockade.runs._schema import RUN_TABLES, SUMMARY_COLUMNS, as_float, as_int, schema, summary_from_row
from stockade.runs.lease import LEASE_S, LeaseHolder, RunLease, owner_gone, owner_token, wait_time
from stockade.runs.records import ApprovalEntry, RetryEntry, RunSummary, RunTrace, WorkspaceUsage
from stockade.runs.seeds import MAX_SEED_BYTES, pack_workspace, unpack_seed
from stockade.runs.workspace import (
    MAX_WORKSPACE_BYTES,
    MAX_WORKSPACE_ENTRIES,
    Entry,
    WorkspaceTracker,
    decode_entry,
    relative_path,
    restore,
)
from stockade.sandbox.facade import Sandbox

__all__ = [
    "OUTCOME_UNKNOWN",
    "ApprovalEntry",
    "RetryEntry",
    "RunStore",
    "RunSummary",
    "RunTrace",
    "WorkspaceUsage",
    "open_run_store",
]

# The error type of a call that started, did not return, and was not run again.
OUTCOME_UNKNOWN = "OutcomeUnknown"
_MESSAGE: TypeAdapter[Message] = TypeAdapter(Message)


@dataclass
class _Saved:
    """What this process has already written for one run (the rows need not be written again)."""

    seq: int = 0
    messages: list[Message] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    ledger: set[str] = field(default_factory=set)


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
        max_workspace_bytes: int = MAX_WORKSPACE_BYTES,
        max_workspace_entries: int = MAX_WORKSPACE_ENTRIES,
        lease_s: float = LEASE_S,
        lease_wait_s: float = 0.0,
    ) -> None:
        if lease_s <= 0 or lease_wait_s < 0:
            raise exc.ConfigurationError("RunStore: lease_s must be positive and lease_wait_s >= 0")
        self.db = db
        self.max_seed_bytes = max_seed_bytes
        self.max_workspace_bytes = max_workspace_bytes
        self.max_workspace_entries = max_workspace_entries
        self.lease_s = lease_s
        self.lease_wait_s = lease_wait_s  # how long ``claim`` waits for a held lease
        # Remembering: an observation is written in a message, a step and the ledger, and an
        # agent reads the same files again and again; each long text is redacted once.
        self.redactor = (redactor if redactor is not None else Redactor()).remembering()
        self.ns = check_namespace(namespace)
        self.url = db.url
        self._lock = threading.Lock()
        self._saved: dict[str, _Saved] = {}
        self._leases: dict[str, str] = {}  # run id -> our owner token, while we hold its lease
        self._trackers: dict[str, WorkspaceTracker] = {}
        self.db.write([(sql, [()]) for sql in schema(self.ns, db.serial, db.blob)])

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
            self._write(run_id, [s for s in statements if s[1]])
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
        try:
            state = RunState.model_validate_json(document)
        except ValidationError as error:
            raise self._corrupt(run_id, as_int(seq), messages, steps, error) from None
        saved = _Saved(seq=as_int(seq), messages=list(state.messages), steps=list(state.steps))
        unknown = self._fold_ledger(state)
        with self._lock:
            saved.ledger = {r.idempotency_key for s in state.steps for r in s.tool_calls}
            if state.current is not None:
                saved.ledger.update(r.idempotency_key for r in state.current.tool_calls)
            saved.ledger -= unknown  # the next checkpoint writes them to the ledger
            self._saved[run_id] = saved
        return state

    def _corrupt(
        self,
        run_id: str,
        seq: int,
        messages: Sequence[tuple[object, ...]],
        steps: Sequence[tuple[object, ...]],
        error: ValidationError,
    ) -> exc.RunStoreCorrupt:
        """Name the first row of the checkpoint that does not parse."""
        where = f"{self.ns}_checkpoints row (run {run_id!r}, seq {seq})"
        for index, row in enumerate(messages):
            try:
                _MESSAGE.validate_json(str(row[0]))
            except ValidationError as bad:
                where, error = f"{self.ns}_messages row (run {run_id!r}, idx {index})", bad
                break
        else:
            for index, row in enumerate(steps):
                try:
                    StepRecord.model_validate_json(str(row[0]))
                except ValidationError as bad:
                    where, error = f"{self.ns}_steps row (run {run_id!r}, idx {index})", bad
                    break
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": str(error)}
        at = ".".join(str(p) for p in first["loc"])
        return exc.RunStoreCorrupt(
            f"run store {self._where}: the {where} cannot be read ({at + ': ' if at else ''}{first['msg']}); "
            "the run cannot be loaded until that row is repaired or the run is removed"
        )

    @property
    def _where(self) -> str:
        db = self.db
        return db.safe_url if isinstance(db, PostgresDatabase) else db.url

    def _recall(self, run_id: str) -> _Saved:
        """A run this process has not written yet: continue its checkpoint numbering."""
        rows = self.db.query(f"SELECT MAX(seq) FROM {self.ns}_checkpoints WHERE run_id = ?", (run_id,))
        return _Saved(seq=as_int(rows[0][0]) if rows and rows[0][0] is not None else 0)

    def _fold_ledger(self, state: RunState) -> set[str]:
        """Fold the calls that returned, or started and must not run again, into the step in
        progress; returns the keys of the latter (not in the ledger yet)."""
        current = state.current
        if current is None or state.status.finished:
            return set()
        recorded = {r.call.id: r for r in self.tool_calls(state.run_id, step=current.index)}
        started = self._started(state.run_id, current.index)
        done = {r.call.id for r in current.tool_calls}
        unknown: set[str] = set()
        for call in current.response.tool_calls:
            if call.id in done:
                continue
            record = recorded.get(call.id)
            key = f"{state.run_id}:{current.index}:{call.id}"
            if record is None and started.get(key) is False:
                record = _outcome_unknown(call, key)
                unknown.add(key)
            if record is None:
                break  # the loop runs calls in order: this one runs (again) next
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
        return unknown

    def _started(self, run_id: str, step: int) -> dict[str, bool]:
        """The calls of ``step`` that started: idempotency key -> whether their tool is idempotent."""
        rows = self.db.query(
            f"SELECT idempotency_key, idempotent FROM {self.ns}_calls_started WHERE run_id = ? AND step = ?",
            (run_id, step),
        )
        return {str(r[0]): bool(r[1]) for r in rows}

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
            self._write(
                run_id, [(self._ledger_sql(), [self._ledger_row(run_id, step, record, time.time_ns())])]
            )
            saved.ledger.add(record.idempotency_key)

    # -- durability: leases, calls started, workspaces -------------------------------------------

    def _fence(self, run_id: str) -> Requirement | None:
        owner = self._leases.get(run_id)
        if owner is None:
            return None  # no lease taken here (a plain checkpointer's use): nothing to check
        return (f"SELECT 1 FROM {self.ns}_leases WHERE run_id = ? AND owner = ?", (run_id, owner))

    def _write(self, run_id: str, statements: Sequence[Statement]) -> None:
        """One transaction for ``run_id``, only while this process still holds its lease."""
        if not self.db.write(statements, require=self._fence(run_id)):
            raise exc.RunLeased(
                f"run {run_id} is no longer this process's: its lease expired and another process "
                "took the run over; this process must stop running it"
            )

    def claim(self, run_id: str, *, new: bool, wait_s: float | None = None) -> RunLease:  # noqa: C901 - waits through the lease's states
        """Take the run's lease: for a ``new`` run (``RunConflict`` if the store has the id),
        or to resume one (``RunConflict`` if it ended). A live lease of another process:
        wait up to ``wait_s`` (default ``lease_wait_s``), then ``RunLeased``."""
        ns = self.ns
        owner = owner_token()
        deadline = time.monotonic() + (self.lease_wait_s if wait_s is None else wait_s)
        if new and self._exists(run_id):
            raise exc.RunConflict(
                f"the run store already has a run {run_id!r}: a new run needs an id of its own "
                "(leave the id out for a random one), and a stopped run continues with resume"
            )
        while True:
            now = time.time_ns()
            if not new:
                summary = self.summary(run_id)
                if summary is not None and summary.status.finished:
                    raise exc.RunConflict(
                        f"run {run_id} ended ({summary.status.value}); a run that ended is kept as it is "
                        "and never resumed: start a new run"
                    )
            rows = self.db.query(f"SELECT owner, expires_ns FROM {ns}_leases WHERE run_id = ?", (run_id,))
            previous: LeaseHolder | None = None
            take: Statement
            if rows:
                held_by, expires = str(rows[0][0]), as_int(rows[0][1])
                if expires == 0:
                    reason = "released"
                elif expires < now:
                    reason = "expired"
                elif owner_gone(held_by):
                    reason = "owner gone"
                else:
                    if new:
                        raise exc.RunConflict(f"another process is starting a run {run_id!r}")
                    if time.monotonic() < deadline:
                        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
                        continue
                    raise exc.RunLeased(
                        f"run {run_id} is running in another process ({_where_owner(held_by)}); "
                        f"its lease runs {wait_time(expires, now):.1f} s more unless renewed: wait for "
                        "it to stop, or stop it (stockade kill)",
                        retry_after=wait_time(expires, now),
                    )
                previous = LeaseHolder(owner=held_by, expires_ns=expires, reason=reason)
                take = (
                    f"UPDATE {ns}_leases SET owner = ?, expires_ns = ?, acquired_ns = ? "
                    "WHERE run_id = ? AND owner = ? AND expires_ns = ?",
                    [(owner, now + round(self.lease_s * 1e9), now, run_id, held_by, expires)],
                )
            else:
                take = (
                    f"INSERT INTO {ns}_leases VALUES (?, ?, ?, ?) ON CONFLICT (run_id) DO NOTHING",
                    [(run_id, owner, now + round(self.lease_s * 1e9), now)],
                )
            self.db.write([take])
            got = self.db.query(f"SELECT owner FROM {ns}_leases WHERE run_id = ?", (run_id,))
            if got and str(got[0][0]) == owner:
                break
            if new:
                raise exc.RunConflict(f"another process has just started a run {run_id!r}")
            # another claim won the race: look again (it holds the lease now)
        with self._lock:
            self._leases[run_id] = owner
            if new:
                self._trackers[run_id] = self._new_tracker()
        if new and previous is not None:
            # a start that died before its first checkpoint: what it wrote is no run's
            self._write(
                run_id,
                [
                    (f"DELETE FROM {ns}_{table} WHERE run_id = ?", [(run_id,)])
                    for table in ("workspace", "calls_started", "run_seeds")
                ],
            )
        return RunLease(self, run_id, owner, ttl_s=self.lease_s, previous=None if new else previous)

    def _exists(self, run_id: str) -> bool:
        """Whether the store has a run of this id (a start that died before its first
        checkpoint left only a lease: it is no run)."""
        ns = self.ns
        for table in ("runs", "checkpoints", "tool_calls"):
            if self.db.query(f"SELECT 1 FROM {ns}_{table} WHERE run_id = ? LIMIT 1", (run_id,)):
                return True
        return False

    def renew_lease(self, run_id: str, owner: str, ttl_s: float) -> bool:
        """Push the lease's end ``ttl_s`` ahead; False when it is no longer ``owner``'s."""
        expires = time.time_ns() + round(ttl_s * 1e9)
        return self.db.write(
            [
                (
                    f"UPDATE {self.ns}_leases SET expires_ns = ? WHERE run_id = ? AND owner = ?",
                    [(expires, run_id, owner)],
                )
            ],
            require=(f"SELECT 1 FROM {self.ns}_leases WHERE run_id = ? AND owner = ?", (run_id, owner)),
        )

    def release_lease(self, run_id: str, owner: str) -> None:
        self.db.write(
            [
                (
                    f"UPDATE {self.ns}_leases SET expires_ns = 0 WHERE run_id = ? AND owner = ?",
                    [(run_id, owner)],
                )
            ]
        )

    def forget_lease(self, run_id: str, owner: str) -> None:
        with self._lock:
            if self._leases.get(run_id) == owner:
                del self._leases[run_id]  # the tracker stays: a resume here may find nothing to restore

    def sweep(self) -> list[str]:
        """Mark ``interrupted`` the runs still ``running`` whose lease expired or whose process
        is gone; returns their ids (``runs`` and ``summary`` sweep first)."""
        ns, now = self.ns, time.time_ns()
        rows = self.db.query(
            f"SELECT l.run_id, l.owner, l.expires_ns FROM {ns}_leases l JOIN {ns}_runs r "
            "ON r.run_id = l.run_id WHERE r.status = ?",
            (RunStatus.RUNNING.value,),
        )
        stale = [str(r[0]) for r in rows if as_int(r[2]) < now or owner_gone(str(r[1]))]
        if stale:
            why = (
                "the process running it stopped (its lease in the run store expired); "
                "resume it: stockade agent --resume RUN_ID"
            )
            self.db.write(
                [
                    (
                        f"UPDATE {ns}_runs SET status = ?, error = ? WHERE run_id = ? AND status = ?",
                        [(RunStatus.INTERRUPTED.value, why, r, RunStatus.RUNNING.value) for r in stale],
                    )
                ]
            )
        return stale

    def call_started(self, run_id: str, step: int, call: ToolCall, key: str, *, idempotent: bool) -> None:
        """Record that ``call`` is about to run (again: its attempts are counted)."""
        self._write(
            run_id,
            [
                (
                    f"INSERT INTO {self.ns}_calls_started VALUES (?, ?, ?, ?, ?, ?, 1, ?) "
                    "ON CONFLICT (idempotency_key) DO UPDATE SET "
                    f"attempts = {self.ns}_calls_started.attempts + 1, started_ns = excluded.started_ns",
                    [(key, run_id, step, call.id, call.name, int(idempotent), time.time_ns())],
                )
            ],
        )

    def call_parked(self, run_id: str, key: str) -> None:
        """The call stopped at an approval before its effect: forget that it started, so a
        resume runs it again (its attempts start over)."""
        sql = f"DELETE FROM {self.ns}_calls_started WHERE idempotency_key = ? AND run_id = ?"
        self._write(run_id, [(sql, [(key, run_id)])])

    def attempts(self, run_id: str) -> dict[str, int]:
        """How many times each call of the run started: idempotency key -> attempts."""
        rows = self.db.query(
            f"SELECT idempotency_key, attempts FROM {self.ns}_calls_started WHERE run_id = ?", (run_id,)
        )
        return {str(r[0]): as_int(r[1]) for r in rows}

    def _new_tracker(self) -> WorkspaceTracker:
        return WorkspaceTracker(max_bytes=self.max_workspace_bytes, max_entries=self.max_workspace_entries)

    def _tracker(self, run_id: str) -> WorkspaceTracker:
        tracker = self._trackers.get(run_id)
        if tracker is None:  # a run this process did not start or restore: continue from the store
            entries, version = self._stored_workspace(run_id)
            tracker = self._trackers[run_id] = self._new_tracker()
            tracker.entries, tracker.version = entries, version
        return tracker

    def record_workspace(
        self, run_id: str, sandbox: Sandbox, *, call: tuple[int, ToolCallRecord] | None = None
    ) -> int:
        """Record what changed in the workspace since the last record, and with it, in the same
        transaction, the call (step, record) that changed it; returns the workspace's version."""
        tracker = self._tracker(run_id)
        known = self._known_blob
        scan = tracker.scan(sandbox, known=known)
        version = tracker.version + 1 if scan.changed else tracker.version
        now = time.time_ns()
        packed = {digest: zlib.compress(data, 6) for digest, data in scan.blobs.items()}
        added = {
            path: len(packed.get(e.digest, b"")) if e is not None else 0 for path, e in scan.changes.items()
        }
        statements: list[Statement] = [
            (
                f"INSERT INTO {self.ns}_blobs VALUES (?, ?, ?) ON CONFLICT (digest) DO NOTHING",
                [(digest, len(scan.blobs[digest]), data) for digest, data in packed.items()],
            ),
            (
                f"INSERT INTO {self.ns}_workspace VALUES (?, ?, ?, ?, ?)",
                [
                    (run_id, version, path, None if e is None else e.encode(), added[path])
                    for path, e in sorted(scan.changes.items())
                ],
            ),
        ]
        with self._lock:
            saved = self._saved.setdefault(run_id, _Saved())
            ledger = call is not None and call[1].idempotency_key not in saved.ledger
            if call is not None and ledger:
                statements.append((self._ledger_sql(), [self._ledger_row(run_id, call[0], call[1], now)]))
            self._write(run_id, [st for st in statements if st[1]])
            if call is not None:
                saved.ledger.add(call[1].idempotency_key)
            tracker.commit(scan, version)
        return version

    def _known_blob(self, digest: str) -> bool:
        return bool(self.db.query(f"SELECT 1 FROM {self.ns}_blobs WHERE digest = ?", (digest,)))

    def _stored_workspace(self, run_id: str) -> tuple[dict[str, Entry], int]:
        rows = self.db.query(
            f"SELECT version, path, body FROM {self.ns}_workspace WHERE run_id = ? ORDER BY version, path",
            (run_id,),
        )
        entries: dict[str, Entry] = {}
        version = 0
        for row_version, path, body in rows:
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

    def restore_workspace(self, run_id: str, sandbox: Sandbox) -> bool:
        """Make the workspace of ``sandbox`` the run's last recorded one (whatever it held);
        ``False`` when none was recorded (the sandbox is left as it is)."""
        entries, version = self._stored_workspace(run_id)
        if version == 0:
            return False
        # this process recorded it last: if the sandbox still holds it (a pause, resumed in the
        # same session), nothing needs writing
        known = self._trackers.get(run_id)
        if (
            known is not None
            and known.version == version
            and known.entries == entries
            and not known.scan(sandbox, known=self._known_blob).changed
        ):
            return True
        listing = restore(sandbox, entries, self._blob)
        tracker = self._new_tracker()
        tracker.restored(entries, version, listing)
        with self._lock:
            self._trackers[run_id] = tracker
        return True

    def export_workspace(self, run_id: str, dest: str | Path) -> int:
        """Write the run's last recorded workspace into ``dest``, a new folder on the host (for
        review: a run an anomaly rule killed keeps it here); returns the files written.
        ``ConfigurationError`` when ``dest`` exists or the run recorded no workspace."""
        entries, version = self._stored_workspace(run_id)
        if version == 0:
            raise exc.ConfigurationError(f"run {run_id!r} recorded no workspace in {self._where}")
        root = Path(dest)
        try:
            root.mkdir(parents=True)
        except FileExistsError:
            raise exc.ConfigurationError(f"{root} exists: give a new folder") from None
        written = 0
        for path in sorted(p for p in entries if relative_path(p)):  # parents sort before children
            entry, target = entries[path], root / path
            if entry.kind == "dir":
                target.mkdir(mode=0o700, exist_ok=True)
                continue
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # the folder is new and only this writes in it: no link can be there to follow
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, entry.mode & 0o755)
            with os.fdopen(fd, "wb") as out:
                out.write(self._blob(entry.digest))
            written += 1
        return written

    # -- erasure ------------------------------------------------------------------------------

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

    def erase(self, run_ids: Sequence[str]) -> int:
        """Remove every row of these runs, and the workspace contents and seeds that no other run
        shares; returns the runs erased. A run still running is refused (``RunConflict``)."""
        ns, runs = self.ns, list(dict.fromkeys(run_ids))
        if not runs:
            return 0
        self.sweep()
        marks = ",".join("?" * len(runs))
        live = self.db.query(
            f"SELECT run_id FROM {ns}_runs WHERE status = ? AND run_id IN ({marks})",
            [RunStatus.RUNNING.value, *runs],
        )
        if live:
            raise exc.RunConflict(f"run {live[0][0]} is running: stop it before erasing it")
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
        self.db.write(statements)
        self.db.write([st for st in self._unshared(blobs - {""}, seeds) if st[1]])
        with self._lock:
            for run_id in runs:
                self._saved.pop(run_id, None)
                self._trackers.pop(run_id, None)
        return as_int(found[0][0]) if found else 0

    def _unshared(self, blobs: set[str], seeds: set[str]) -> list[Statement]:
        """Deletions of the contents and seeds (of erased runs) that no run refers to any more."""
        ns = self.ns
        gone_blobs = [
            (d,)
            for d in sorted(blobs)
            if not self.db.query(f"SELECT 1 FROM {ns}_workspace WHERE body LIKE ? LIMIT 1", (f'%"{d}"%',))
        ]
        gone_seeds = [
            (d,)
            for d in sorted(seeds)
            if not self.db.query(f"SELECT 1 FROM {ns}_run_seeds WHERE digest = ? LIMIT 1", (d,))
        ]
        return [
            (f"DELETE FROM {ns}_blobs WHERE digest = ?", gone_blobs),
            (f"DELETE FROM {ns}_seeds WHERE digest = ?", gone_seeds),
        ]

    def workspace_usage(self, run_id: str) -> WorkspaceUsage:
        rows = self.db.query(
            "SELECT COUNT(DISTINCT version), COUNT(*), COALESCE(SUM(blob_bytes), 0) "
            f"FROM {self.ns}_workspace WHERE run_id = ?",
            (run_id,),
        )
        versions, count, blob_bytes = rows[0] if rows else (0, 0, 0)
        return WorkspaceUsage(versions=as_int(versions), rows=as_int(count), blob_bytes=as_int(blob_bytes))

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
        """The workspace diff at the end of the run (the one mutable column: the latest end
        wins; a run that ended is never resumed, so its diff stays)."""
        self._write(
            run_id,
            [(f"UPDATE {self.ns}_runs SET diff = ? WHERE run_id = ?", [(self.redactor.text(diff), run_id)])],
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
        """The most recently updated runs first (runs whose process died: ``interrupted``)."""
        self.sweep()
        where, params = ("WHERE status = ?", [status.value]) if status is not None else ("", [])
        rows = self.db.query(
            f"SELECT {SUMMARY_COLUMNS} FROM {self.ns}_runs {where} ORDER BY updated_ns DESC LIMIT ?",
            [*params, limit],
        )
        return [summary_from_row(r) for r in rows]

    def summary(self, run_id: str) -> RunSummary | None:
        self.sweep()
        rows = self.db.query(f"SELECT {SUMMARY_COLUMNS} FROM {self.ns}_runs WHERE run_id = ?", (run_id,))
        return summary_from_row(rows[0]) if rows else None

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
        rows = self.db.query(
            sql.replace("SELECT body", "SELECT idempotency_key, body")
            + " ORDER BY recorded_ns, idempotency_key",
            params,
        )
        records = []
        for key, body in rows:
            try:
                records.append(ToolCallRecord.model_validate_json(str(body)))
            except ValidationError as error:
                raise exc.RunStoreCorrupt(
                    f"run store {self._where}: the {self.ns}_tool_calls row {str(key)!r} cannot be read "
                    f"({error.errors()[0]['msg'] if error.errors() else error})"
                ) from None
        return records

    def ledger_calls(self, run_id: str | None = None) -> list[LedgerCall]:
        """The ledger as ``audit verify`` cross-checks it: every call but the denied ones."""
        sql = f"SELECT run_id, step, idempotency_key, tool, body FROM {self.ns}_tool_calls"
        rows = (
            self.db.query(sql + " WHERE run_id = ?", (run_id,)) if run_id is not None else self.db.query(sql)
        )
        calls = []
        for run, step, key, tool, body in rows:
            try:
                denied = json.loads(str(body)).get("denied") is True
            except (ValueError, AttributeError):
                denied = False  # unreadable: cross-checked all the same
            if not denied:
                calls.append(
                    LedgerCall(run_id=str(run), step=as_int(step), idempotency_key=str(key), tool=str(tool))
                )
        return calls

    def retries(self, run_id: str) -> list[RetryEntry]:
        rows = self.db.query(
            f"SELECT step, call_id, subject, attempt, delay_s, reason, recorded_ns FROM {self.ns}_retries "
            "WHERE run_id = ? ORDER BY id",
            (run_id,),
        )
        return [
            RetryEntry(
                step=as_int(r[0]),
                call_id=None if r[1] is None else str(r[1]),
                subject=str(r[2]),
                attempt=as_int(r[3]),
                delay_s=as_float(r[4]),
                reason=str(r[5]),
                recorded_ns=as_int(r[6]),
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
                step=as_int(r[0]),
                request_id=str(r[1]),
                action=str(r[2]),
                rule=str(r[3]),
                reason=str(r[4]),
                decision=str(r[5]),
                recorded_ns=as_int(r[6]),
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


def _where_owner(owner: str) -> str:
    parts = owner.split("/")
    return f"pid {parts[2]}" if len(parts) == 5 else "unknown owner"


def _outcome_unknown(call: ToolCall, key: str) -> ToolCallRecord:
    return ToolCallRecord(
        call=call,
        idempotency_key=key,
        observation=(
            f"error: {OUTCOME_UNKNOWN}: the run stopped while {call.name} was running (its process "
            f"died or was stopped), and {call.name} is not idempotent, so it was not run again. "
            "Whether its effects happened is unknown: check before doing it again. Changes it made "
            "inside the workspace are not there (the workspace is as the last finished call left it)."
        ),
        is_error=True,
        error_type=OUTCOME_UNKNOWN,
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
