"""What the chain's events say of runs (``Book``): the tool calls started, returned and cut,
the runs ended, recorded, erased and sealed, checked at the end against the run store's ledger
and the keys of sealed runs.

Apart from the chain's links and hashes (``verify``): these checks read what a row's body
says, not whether it is tied into the chain, and are the same for a whole chain and one run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import NamedTuple

from stockade import exceptions as exc
from stockade.audit.events import STORED
from stockade.audit.ledger import Ledger
from stockade.audit.sealing import SEALED, open_attributes
from stockade.audit.stores import AuditStore
from stockade.audit.verify_report import ProblemKind

Report = Callable[[int, ProblemKind, str, str], None]


class Book:
    """What the chain's events say of runs, noted row by row and checked at the end against
    the run store's ledger and the keys of sealed runs: the same for a whole chain (``verify``)
    and for one run's events (``verify_run``), which are all the rows of that run it needs."""

    def __init__(self, run_id: str | None, ledgered: bool) -> None:
        self.run_id = run_id
        self.ledgered = ledgered
        self.audited: dict[tuple[str, str], int] = {}  # (run, idempotency key) of each tool_call -> its seq
        self.told: set[tuple[str, str, bool]] = set()  # (run, key, whether a resume's "outcome unknown")
        self.ended: dict[str, int] = {}  # run -> the seq of its final run_end
        self.started: set[tuple[str, str]] = set()  # (run, idempotency key) of each tool_call_start
        # run -> idempotency key -> the last tool_call_start that nothing after it closed
        self.open_calls: dict[str, dict[str, _Start]] = {}
        self.sealed: dict[str, tuple[int, str]] = {}  # run -> its first intact sealed event (seq, body)
        self.erased: dict[str, int] = {}  # run -> the seq of its run_erased event
        self.recorded: dict[str, int] = {}  # run -> the seq of its first run_start a run store recorded
        self.deleted: set[str] = set()  # runs whose erasure from the run store the trail records

    def note(self, seq: int, run: str, kind: str, body: str, step: int, *, report: Report) -> None:
        """A row, whatever its state (by its columns: a row edited is reported besides)."""
        if not self.ledgered:
            return
        open_calls = self.open_calls
        if kind == "note" and body_attributes(body).get("action") == "delete":
            self.deleted.add(run)  # a service's deletion (or `runs erase`'s of a run not sealed)
            open_calls.pop(run, None)  # a call cut before it is not in flight: the run is gone
        if kind not in _KEYED or (self.run_id is not None and run != self.run_id):
            return
        if kind == "tool_call_start":
            attributes = body_attributes(body)
            call_key = attributes.get("idempotency_key")
            if isinstance(call_key, str):
                self.started.add((run, call_key))
                open_calls.setdefault(run, {})[call_key] = _Start(seq, step, str(attributes.get("tool")))
        elif kind in _CLOSING:  # the run stopped, or was resumed: every call before is closed
            open_calls.pop(run, None)
            if kind == "run_start" and run not in self.recorded and body_attributes(body).get(STORED) is True:
                self.recorded[run] = seq
        else:
            returned = _once(
                seq, run, kind, body, audited=self.audited, ended=self.ended, told=self.told, report=report
            )
            if kind == "run_end":
                open_calls.pop(run, None)
            elif returned and run in open_calls:
                open_calls[run].pop(returned, None)

    def intact(self, seq: int, run: str, kind: str, body: str) -> None:
        """A row whose body matches its hash: what it says of its run's key can be relied on."""
        if self.run_id is None or run == self.run_id:
            if kind == "run_erased":
                self.erased[run] = seq
            elif _SEALED_MARK in body and run not in self.sealed:
                self.sealed[run] = (seq, body)

    def finish(self, store: AuditStore, ledger: Ledger | None, report: Report) -> None:
        if ledger is not None:
            self._cross_check(ledger, report)
        if self.sealed or self.erased:
            _check_run_keys(store, self.sealed, self.erased, report)

    def _cross_check(self, ledger: Ledger, report: Report) -> None:
        known: set[str] = set()
        for call in ledger.ledger_calls(self.run_id):
            known.add(call.run_id)
            if self.audited.pop((call.run_id, call.idempotency_key), None) is None:
                detail = (
                    f"the run store's ledger has {call.tool} (step {call.step}, "
                    f"{call.idempotency_key}) and the audit trail has no event of it"
                )
                report(0, ProblemKind.NOT_IN_TRAIL, detail, call.run_id)
        for (run, event_key), seq in self.audited.items():
            if run in known:
                detail = f"a tool_call event ({event_key}) that the run store's ledger does not have"
                report(seq, ProblemKind.NOT_IN_LEDGER, detail, run)
        # By the trail, whatever the run store says: a call started and not closed, of a run
        # no live process holds now, was cut (the store's rows can be edited or deleted).
        cut = [run for run, calls in self.open_calls.items() if calls]
        live = set(ledger.live_runs(cut)) if cut else set()
        for run in cut:
            if run in live:
                continue
            for call_key, start in self.open_calls[run].items():
                detail = (
                    f"the process running {run} stopped during {start.tool} (step {start.step}, "
                    f"{call_key}) and nothing ended or resumed the run: the trail has its start "
                    f"(seq {start.seq}), not what it did; resuming the run records its crash and the call"
                )
                report(start.seq, ProblemKind.IN_FLIGHT, detail, run)
        for call in ledger.calls_in_flight(self.run_id):
            if (call.run_id, call.idempotency_key) in self.started or call.run_id in self.ended:
                continue  # the trail has its start (judged above), or the run's end
            detail = (
                f"the process running {call.run_id} died during {call.tool} (step {call.step}, "
                f"{call.idempotency_key}): the trail has no event of it; resuming the run records "
                "its crash and the call"
            )
            report(0, ProblemKind.IN_FLIGHT, detail, call.run_id)
        for row in ledger.forged_rows(self.run_id):
            report(0, ProblemKind.STORE_FORGED, f"run store: {row.detail}", row.run_id)
        # A run the trail says a run store recorded, and no erasure of: its rows must be there
        # (deleting every row of a run left nothing for the checks above to find).
        kept = {
            run: seq
            for run, seq in self.recorded.items()
            if run not in self.deleted and run not in self.erased
        }
        present = set(ledger.stored_runs(list(kept))) if kept else set()
        for run, seq in kept.items():
            if run not in present:
                detail = (
                    f"the run store has no row of run {run}, which the trail says it recorded "
                    f"(run_start, seq {seq}), and the trail records no erasure of it"
                )
                report(seq, ProblemKind.NOT_IN_STORE, detail, run)


_KEYED = frozenset({"tool_call", "run_end", "tool_call_start", "run_start", "run_crash", "run_erased"})
# What closes every call of its run started before it: a later start of the run is a resume,
# which records the crash and each call the trail lacks (``AuditObserver``); so is its crash.
# A ``run_end`` closes them too: the run's process wrote it, stopping (a clean stop, paused,
# interrupted, killed) or ending the run, or a service gave the run up. So does its erasure:
# an erased run is never resumed, and its call would be in flight for good.
_CLOSING = frozenset({"run_start", "run_crash", "run_erased"})


class _Start(NamedTuple):
    seq: int
    step: int
    tool: str


# The statuses of a run that ended for good (RunStatus.finished; the audit layer does not
# import the agent's): a paused, interrupted or broken run's run_end is one per stop.
_FINAL = frozenset({"success", "check_failed", "max_steps", "budget", "killed", "denied", "error"})


def _once(
    seq: int,
    run: str,
    kind: str,
    body: str,
    *,
    audited: dict[tuple[str, str], int],
    ended: dict[str, int],
    told: set[tuple[str, str, bool]],
    report: Callable[[int, ProblemKind, str, str], None],
) -> str | None:
    """Note a tool_call's key or a final run_end, and report a second one; the tool_call's key.
    A call has one event of what it returned and, besides, may have one a resume wrote when
    it found the call's outcome unknown: the process it was taken from, stalled past its
    lease (SIGSTOP, a frozen VM), may still write what the call returned once it wakes (it
    can write nothing to the run store any more), before or after the resume's."""
    attributes = body_attributes(body)
    if kind == "tool_call":
        key = attributes.get("idempotency_key")
        if not isinstance(key, str) or not key:
            return None
        # By run too: a key is unique per call, but one made by an earlier version
        # (``run_id:step:call_id``) may be another run's as well.
        first = audited.setdefault((run, key), seq)
        unknown = attributes.get("outcome") == "unknown" and attributes.get("reconciled") is True
        if (run, key, unknown) in told:
            detail = f"a second tool_call event of {key} (the first is seq {first})"
            report(seq, ProblemKind.DUPLICATE_IN_TRAIL, detail, run)
        told.add((run, key, unknown))
        return key
    if attributes.get("status") not in _FINAL:
        return None
    first = ended.setdefault(run, seq)
    if first != seq and attributes.get("repeat") is not True:
        detail = f"a second run_end of run {run} (the first is seq {first}), not marked as a repeat"
        report(seq, ProblemKind.DUPLICATE_IN_TRAIL, detail, run)
    return None


def body_attributes(body: str) -> dict[str, object]:
    try:
        attributes = json.loads(body).get("attributes", {})
    except (ValueError, AttributeError, RecursionError):
        return {}
    return attributes if isinstance(attributes, dict) else {}


_SEALED_MARK = f'"{SEALED}":'


def _check_run_keys(
    store: AuditStore,
    sealed: dict[str, tuple[int, str]],
    erased: dict[str, int],
    report: Callable[[int, ProblemKind, str, str], None],
) -> None:
    """The keys table is not append-only (erasure forgets keys), so the chain says what it must
    hold: the key of each sealed run opens the run's events, unless the chain records the run
    erased (``run_erased``, written in the transaction that forgot the key)."""
    runs = [*sealed, *erased]
    keys: dict[str, bytes] = {}
    for at in range(0, len(runs), 500):  # a query's parameters are bounded (SQLite: 32,766)
        keys.update(store.run_keys(runs[at : at + 500]))
    for run, at in erased.items():
        if run in keys:
            detail = f"run {run} was erased (seq {at}) but a key of it is kept: put back from a copy"
            report(at, ProblemKind.RUN_KEY_FORGED, detail, run)
    for run, (seq, body) in sealed.items():
        key = keys.get(run)
        if key is None and run not in erased:
            detail = (
                f"the key of sealed run {run} is gone and the chain records no erasure of it (run_erased): "
                "deleted outside stockade, or by a stockade that did not record erasures"
            )
            report(seq, ProblemKind.RUN_KEY_GONE, detail, run)
        elif key is not None and run not in erased:
            try:
                open_attributes(run, body_attributes(body), key)
            except exc.AuditIntegrityError:
                detail = f"the key kept for sealed run {run} does not open its events: replaced"
                report(seq, ProblemKind.RUN_KEY_FORGED, detail, run)
