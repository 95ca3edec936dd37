"""Checkpoints: a run's state after every step, stored as append-only rows.

A checkpoint row holds the small part of ``RunState``; the conversation and the finished
steps are rows of their own, each written once: a save writes only the messages and steps
added since the last one, and the calls of the ledger it has not written yet, so the cost of
a save does not grow with the run.

``load`` folds the calls the ledger has and the checkpoint lacks back into the step in
progress, so a call that returned is never run again; a call that started and did not return
is run again if its tool is idempotent, and otherwise recorded as ``OutcomeUnknown`` (the
model is told, and not run again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from pydantic import TypeAdapter, ValidationError

from stockade import exceptions as exc
from stockade.agent.state import RunState, StepRecord, ToolCallRecord
from stockade.audit.redact import Redactor
from stockade.models.messages import Message, ToolCall, ToolResultMessage
from stockade.runs._db import Database, Statement
from stockade.runs._mac import RowMac, insert, select
from stockade.runs._schema import SIGNED, as_int
from stockade.runs.ledger import CallLedger, redacted_json
from stockade.tools.base import idempotency_key

__all__ = ["OUTCOME_UNKNOWN", "Checkpoints"]

# The error type of a call that started, did not return, and was not run again.
OUTCOME_UNKNOWN = "OutcomeUnknown"
_MESSAGE: TypeAdapter[Message] = TypeAdapter(Message)


@dataclass
class _Saved:
    """What this process has already written for one run (the rows need not be written again)."""

    seq: int = 0
    created_ns: int = 0  # the run's row's (0: no row yet); each save signs the row again with it
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


class Checkpoints:
    """The ``<namespace>_checkpoints``, ``_messages``, ``_steps`` and ``_runs`` rows of a save,
    and what this process has written of each run (so that a save writes only what is new)."""

    def __init__(
        self,
        db: Database,
        ns: str,
        redactor: Redactor,
        ledger: CallLedger,
        mac: RowMac,
        *,
        write: Callable[[str, Sequence[Statement]], None],
        where: str,
    ) -> None:
        self.db = db
        self.ns = ns
        self.redactor = redactor
        self.ledger = ledger
        self.mac = mac
        self._write = write  # fenced by the run's lease
        self._where = where
        self._lock = threading.Lock()
        self._saved: dict[str, _Saved] = {}

    def save(self, state: RunState) -> None:
        """Append a checkpoint, and the messages and steps added since the last one."""
        ns, run_id, now = self.ns, state.run_id, time.time_ns()
        with self._lock:
            saved = self._saved.get(run_id) or self._recall(run_id)
            created = saved.created_ns or self._created(run_id) or now
            msg_from = _first_change(saved.messages, state.messages)
            step_from = _first_change(saved.steps, state.steps)
            new_records = [(s.index, r) for s in state.steps[step_from:] for r in s.tool_calls]
            if state.current is not None:
                new_records.extend((state.current.index, r) for r in state.current.tool_calls)
            ledger = [(i, r) for i, r in new_records if r.idempotency_key not in saved.ledger]
            body = redacted_json(self.redactor, state, exclude={"messages", "steps"})
            statements: list[Statement] = [
                (
                    f"INSERT INTO {ns}_messages VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (run_id, idx) DO UPDATE SET body = excluded.body, mac = excluded.mac",
                    [
                        self.mac.signed("messages", (run_id, i, redacted_json(self.redactor, m)))
                        for i, m in enumerate(state.messages[msg_from:], msg_from)
                    ],
                ),
                (
                    f"INSERT INTO {ns}_steps VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (run_id, idx) DO UPDATE SET body = excluded.body, mac = excluded.mac",
                    [
                        self.mac.signed("steps", (run_id, i, redacted_json(self.redactor, s)))
                        for i, s in enumerate(state.steps[step_from:], step_from)
                    ],
                ),
                (
                    f"INSERT INTO {ns}_checkpoints VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [
                        self.mac.signed(
                            "checkpoints",
                            (run_id, saved.seq + 1, now, len(state.messages), len(state.steps), body),
                        )
                    ],
                ),
                (self.ledger.insert_sql(), [self.ledger.row(run_id, i, r, now) for i, r in ledger]),
                (
                    insert(ns, "runs")
                    + """ ON CONFLICT (run_id) DO UPDATE SET task = excluded.task,
                        model_name = excluded.model_name, status = excluded.status, steps = excluded.steps,
                        input_tokens = excluded.input_tokens, output_tokens = excluded.output_tokens,
                        requests = excluded.requests, cost_usd = excluded.cost_usd,
                        elapsed_s = excluded.elapsed_s, error = excluded.error,
                        updated_ns = excluded.updated_ns, mac = excluded.mac""",
                    [
                        self.mac.signed(
                            "runs",
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
                                created,
                                now,
                            ),
                        )
                    ],
                ),
            ]
            self._write(run_id, [s for s in statements if s[1]])
            saved.seq += 1
            saved.created_ns = created
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
            f"{select(ns, 'checkpoints')} WHERE run_id = ? ORDER BY seq DESC LIMIT 1", (run_id,)
        )
        if not rows:
            return None
        _, seq, _, n_messages, n_steps, body, _ = rows[0]
        # body is the next-to-last column of the rows read with their MAC
        messages = self.db.query(
            f"{select(ns, 'messages')} WHERE run_id = ? AND idx < ? ORDER BY idx", (run_id, n_messages)
        )
        steps = self.db.query(
            f"{select(ns, 'steps')} WHERE run_id = ? AND idx < ? ORDER BY idx", (run_id, n_steps)
        )
        self.mac.check(ns, "checkpoints", rows, store=self._where)
        self.mac.check(ns, "messages", messages, store=self._where)
        self.mac.check(ns, "steps", steps, store=self._where)
        # Splice the stored JSON rather than parse and re-serialise it.
        document = (
            '{"messages":['
            + ",".join(str(m[-2]) for m in messages)
            + '],"steps":['
            + ",".join(str(s[-2]) for s in steps)
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

    def glimpse(self, run_id: str, indices: Collection[int]) -> RunState | None:
        """The latest checkpoint with only the steps of these ``indices`` (and the step in
        progress): what the run viewer shows of one window of a run, read without the rest of
        its steps and messages."""
        ns = self.ns
        rows = self.db.query(
            f"{select(ns, 'checkpoints')} WHERE run_id = ? ORDER BY seq DESC LIMIT 1", (run_id,)
        )
        if not rows:
            return None
        _, seq, _, _, n_steps, body, _ = rows[0]
        # a step's row is at its position: steps are numbered from 1
        wanted = sorted({i - 1 for i in indices if 0 < i <= as_int(n_steps)})
        steps: list[tuple[object, ...]] = []
        for at in range(0, len(wanted), 500):
            part = wanted[at : at + 500]
            steps.extend(
                self.db.query(
                    f"{select(ns, 'steps')} WHERE run_id = ? AND idx IN ({','.join('?' * len(part))}) "
                    "ORDER BY idx",
                    (run_id, *part),
                )
            )
        self.mac.check(ns, "checkpoints", rows, store=self._where)
        self.mac.check(ns, "steps", steps, store=self._where)
        document = '{"messages":[],"steps":[' + ",".join(str(s[-2]) for s in steps) + "]," + str(body)[1:]
        try:
            return RunState.model_validate_json(document)
        except ValidationError as error:
            raise self._corrupt(run_id, as_int(seq), [], steps, error) from None

    def record_tool_call(self, run_id: str, step: int, record: ToolCallRecord) -> None:
        """Write one returned call to the ledger now (idempotent: a key is written once)."""
        with self._lock:
            saved = self._saved.setdefault(run_id, _Saved())
            if record.idempotency_key in saved.ledger:
                return
            self._write(
                run_id, [(self.ledger.insert_sql(), [self.ledger.row(run_id, step, record, time.time_ns())])]
            )
            saved.ledger.add(record.idempotency_key)

    def write_with_call(
        self,
        run_id: str,
        statements: Sequence[Statement],
        call: tuple[int, ToolCallRecord] | None,
        *,
        now: int,
        then: Callable[[], None],
    ) -> None:
        """Write ``statements`` and, in the same transaction, the call (step, record) to the
        ledger (recorded at ``now``) unless it is there; ``then`` runs once written, before
        another save can start (the workspace a call left is recorded with the call, never
        apart from it)."""
        with self._lock:
            saved = self._saved.setdefault(run_id, _Saved())
            todo = list(statements)
            if call is not None and call[1].idempotency_key not in saved.ledger:
                todo.append((self.ledger.insert_sql(), [self.ledger.row(run_id, call[0], call[1], now)]))
            self._write(run_id, [st for st in todo if st[1]])
            if call is not None:
                saved.ledger.add(call[1].idempotency_key)
            then()

    def forget(self, run_id: str) -> None:
        """The run was erased: nothing of it is written any more."""
        with self._lock:
            self._saved.pop(run_id, None)

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
                _MESSAGE.validate_json(str(row[-2]))
            except ValidationError as bad:
                where, error = f"{self.ns}_messages row (run {run_id!r}, idx {index})", bad
                break
        else:
            for index, row in enumerate(steps):
                try:
                    StepRecord.model_validate_json(str(row[-2]))
                except ValidationError as bad:
                    where, error = f"{self.ns}_steps row (run {run_id!r}, idx {index})", bad
                    break
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": str(error)}
        at = ".".join(str(p) for p in first["loc"])
        return exc.RunStoreCorrupt(
            f"run store {self._where}: the {where} cannot be read ({at + ': ' if at else ''}{first['msg']}); "
            "the run cannot be loaded until that row is repaired or the run is removed"
        )

    def _recall(self, run_id: str) -> _Saved:
        """A run this process has not written yet: continue its checkpoint numbering."""
        rows = self.db.query(f"SELECT MAX(seq) FROM {self.ns}_checkpoints WHERE run_id = ?", (run_id,))
        return _Saved(seq=as_int(rows[0][0]) if rows and rows[0][0] is not None else 0)

    def _created(self, run_id: str) -> int:
        """When the run's row was made (0: it has none yet); ``RunStoreCorrupt`` where the row
        was edited, which the next save would otherwise sign."""
        rows = self.db.query(f"{select(self.ns, 'runs')} WHERE run_id = ?", (run_id,))
        self.mac.check(self.ns, "runs", rows, store=self._where)
        return as_int(rows[0][SIGNED["runs"][0].index("created_ns")]) if rows else 0

    def _fold_ledger(self, state: RunState) -> set[str]:
        """Fold the calls that returned, or started and must not run again, into the step in
        progress; returns the keys of the latter (not in the ledger yet)."""
        current = state.current
        if current is None or state.status.finished:
            return set()
        recorded = {r.idempotency_key: r for r in self.ledger.tool_calls(state.run_id, step=current.index)}
        started = self.ledger.started(state.run_id, current.index)
        unknown: set[str] = set()
        calls = current.response.tool_calls
        for index in range(len(current.tool_calls), len(calls)):  # those with a record ran, in order
            call = calls[index]
            key = idempotency_key(state.run_id, current.index, index, call.id)
            # A run in flight across an upgrade: its rows (of this run and step) hold the old key.
            old = f"{state.run_id}:{current.index}:{call.id}"
            record = recorded.get(key) or recorded.get(old)
            if record is None and (started.get(key) is False or started.get(old) is False):
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
