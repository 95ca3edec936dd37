"""``verify``: prove a store's chain intact, or say where and how it is not.

What is checked, event by event, in ``seq`` order: that ``seq`` continues without gap or
repeat (a gap is a deletion), that the signed body carries the same ``seq`` and columns as the
row (renumbering, reordering), that ``prev_hash`` is the hash of the event before (deletion,
insertion, reordering, or an edit whose hash was recomputed), and that ``hash`` is the hash
of the body (an edit). Then the tail, against the head record.

What the head can prove (the anchor for truncation). The store keeps a head record (last seq,
its hash, a MAC over both) updated in the transaction of every batch:

- cutting the tail without touching the head is reported as ``truncated``;
- with a key, a head moved back to an earlier event fails its MAC (``head_forged``), and so
  does a chain copied whole under another namespace (another tenant's trail shown as this
  one's): the MAC names the namespace (a head written before it did is taken until the next
  append writes one that does);
- without a key, anyone who can write the store can recompute the whole chain and the head;
  the plain SHA-256 chain only catches accidents and careless edits. Use a key;
- so the head's word on the algorithm is no proof: given a key, a head that says the chain is
  unkeyed is ``downgraded`` (a keyed chain rewritten without the key, or one never keyed),
  never a hint to verify without the key, which would then find the rewrite intact;
- a head *replayed* from an older copy of the store (rollback), or a store emptied entirely,
  cannot be told from the truth by anything inside the store. The store's own files hold
  such copies: SQLite's write-ahead log and free pages, PostgreSQL's dead rows and WAL keep
  earlier heads, MAC and all, so whoever can write the store can cut a keyed chain back to
  the end of an earlier batch and write that batch's head back. For that, keep the head
  outside (export it to your SIEM, print it in a release log) and pass it as
  ``expected_head``: verification then fails unless the chain reaches it.

Each row's queryable columns (``run_id``, ``kind``, ``step``, ``timestamp_ns``) are checked
against the signed body too, so a query over them (events of a run, of an hour) is as
trustworthy as the chain. A row of a type stockade never writes (a BLOB body, text that is
not UTF-8, a body nested past reading, a head whose fields are not numbers and text) is a
problem found, never a crash of the verification.

A chain can be intact and still miss what happened: events that died in a crashed process's
buffer were never sealed. Given the run store's ledger (``ledger=``, a ``RunStore``), the tool
calls of every run the ledger knows are cross-checked against the chain's ``tool_call`` events
by idempotency key: a call in the ledger and not in the trail is ``not_in_trail``, a
``tool_call`` event the ledger lacks is ``not_in_ledger``, and a second ``tool_call`` event of
one key, or a second ``run_end`` of a run that ended for good (``"status"`` not paused,
interrupted or broken) not marked ``"repeat": true``, is ``duplicate_in_trail`` (a resume
keeps them once: ``AuditObserver``; beside a resume's "outcome unknown" event of a call, the
event of what it returned, written late by the process it was taken from, is no second one). A
call cut by its process's death is ``in_flight``: a problem, as a call lost from the trail
after it returned is, since what the call did in the sandbox (its ``run_code`` or ``command``
event, the execs judged inside) is not in the trail and never will be; its ``tool_call_start``
and ``op_start`` say what was asked. The trail decides: a ``tool_call_start`` that nothing
after it closes (a ``tool_call`` of its key; its run's ``run_end``, which the run's process
writes whenever it stops the run, and a service that gives the run up; its ``run_crash`` or a
later ``run_start``, a resume, which records the call; its ``run_erased``: an erased run is
never resumed) is in flight unless a live process
holds its run now (the ledger's ``live_runs``: a lease the run store signed, with its owner
and expiry, expiring soon enough). The run store's rows can be edited or deleted by whoever
writes its database, so they only prove a run live, never a call closed. A call the run store
saw start and the trail never did (the death came before the log's batch) is found from the
store (its ``calls_in_flight``). Resuming a crashed run records what its trail lost
(``AuditObserver``): the crash, and the call, as returned or of unknown outcome. A run still
running is not in flight, but may show its last calls as ``not_in_trail`` until its next batch
is written.

The keys of sealed runs (``stockade.audit.sealing``) live in a table that is not append-only,
since erasure forgets them; the chain says what it must hold. Each sealed run's key must open
the run's first sealed event (else ``run_key_forged``: replaced), unless the chain records
the run erased (its ``run_erased`` event, written in the transaction that forgot the key);
a key gone with no such event is ``run_key_gone`` (deleted outside stockade: what a reader
sees as ``$erased`` was never erased), and a key kept after its erasure is ``run_key_forged``.

The run store's rows that a resume acts on (checkpoints, messages, steps, the ledger, the calls
started, workspace manifests, seeds) carry a MAC under a key derived from the audit key, when
the store was opened with it (``stockade.runs._mac``); a row whose MAC is wrong or missing is
``store_forged`` (the ledger's ``forged_rows``: a store opened without the key finds none).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from stockade import exceptions as exc
from stockade._checks import check_number, check_text
from stockade.audit.events import GENESIS, STORED, Chain
from stockade.audit.sealing import SEALED, open_attributes
from stockade.audit.stores import AuditStore, Head

__all__ = [
    "ForgedRow",
    "Ledger",
    "LedgerCall",
    "Problem",
    "ProblemKind",
    "RunsLedger",
    "VerifyReport",
    "unrecorded_erasures",
    "verify",
    "verify_run",
]

# The end of a canonical body: sorted keys put these scalars last, after "attributes", so
# the match anchored at the end is the top-level one (quotes inside strings are escaped).
# Reading them this way is about twice as fast as parsing the body; a body it does not fit
# is parsed as JSON, and the hash still covers every byte.
_STRING = r'"(?:[^"\\]|\\.)*"'
_TAIL = re.compile(
    rf'"kind":({_STRING}),"prev_hash":"([^"]*)","run_id":({_STRING}),"seq":(-?\d+),'
    r'"step":(-?\d+),"timestamp_ns":(-?\d+),"v":\d+}\Z'
)


class _Signed(NamedTuple):
    seq: int
    prev: str
    run_id: str
    kind: str
    step: int
    timestamp_ns: int


def _signed_fields(body: str, strings: dict[str, str]) -> _Signed:
    """What ``body`` signs of its row's columns; ``ValueError`` if it is not an event."""
    match = _TAIL.match(body, max(0, body.rfind('"kind":"')))
    if match is None:
        try:
            data = json.loads(body)
            return _Signed(
                data["seq"],
                data["prev_hash"],
                data["run_id"],
                data["kind"],
                data["step"],
                data["timestamp_ns"],
            )
        except (KeyError, TypeError, RecursionError) as error:  # not an event, or nested past reading
            raise ValueError("not an audit event") from error
    kind_token, prev, run_token, seq, step, timestamp_ns = match.groups()
    for token in (kind_token, run_token):
        if token not in strings:
            if len(strings) > 10_000:
                strings.clear()
            strings[token] = json.loads(token)
    return _Signed(int(seq), prev, strings[run_token], strings[kind_token], int(step), int(timestamp_ns))


class ProblemKind(enum.StrEnum):
    EDITED = "edited"  # the body does not hash to the stored hash
    BROKEN_LINK = "broken_link"  # prev_hash is not the hash of the event before
    MISSING = "missing"  # a gap in seq: events were deleted
    OUT_OF_ORDER = "out_of_order"  # seq repeats or goes back, or the body's seq is not the row's
    COLUMN_MISMATCH = "column_mismatch"  # a queryable column differs from the signed body
    UNREADABLE = "unreadable"  # the body is not the canonical JSON of an event
    TRUNCATED = "truncated"  # the head record says the chain went further
    HEAD_FORGED = "head_forged"  # the head record does not match its MAC or the chain's end
    WRONG_KEY = "wrong_key"  # the chain is keyed and no key (or another key) was given
    DOWNGRADED = "downgraded"  # a key was given and the head says the chain is not keyed
    UNEXPECTED_HEAD = "unexpected_head"  # the chain does not reach the head the caller pinned
    NOT_IN_TRAIL = "not_in_trail"  # the run store's ledger has a tool call the trail does not
    NOT_IN_LEDGER = "not_in_ledger"  # a tool_call event of a run the ledger knows, not in its ledger
    DUPLICATE_IN_TRAIL = "duplicate_in_trail"  # a tool_call's key, or a run's final run_end, twice
    IN_FLIGHT = "in_flight"  # a run's process died during a call: what it did is not in the trail
    STORE_FORGED = "store_forged"  # a run store row a resume acts on does not carry its MAC
    NOT_IN_STORE = "not_in_store"  # a run the trail says a run store recorded, gone from it unrecorded
    RUN_KEY_GONE = "run_key_gone"  # a sealed run's key deleted with no run_erased event in the chain
    RUN_KEY_FORGED = "run_key_forged"  # a sealed run's key does not open its events, or outlived its erasure


class LedgerCall(NamedTuple):
    """A tool call as the run store recorded it (denied calls are policy decisions, left out)."""

    run_id: str
    step: int
    idempotency_key: str
    tool: str


class ForgedRow(NamedTuple):
    """A run store row whose MAC is wrong or missing: written by someone without the key."""

    run_id: str
    detail: str


class Ledger(Protocol):
    """What ``verify`` cross-checks the chain with (``RunStore`` is one)."""

    def ledger_calls(self, run_id: str | None = None) -> Iterable[LedgerCall]: ...

    def forged_rows(self, run_id: str | None = None) -> Iterable[ForgedRow]:
        """The rows a resume acts on whose MAC is wrong or missing (none without the key)."""
        ...

    def calls_in_flight(self, run_id: str | None = None) -> Iterable[LedgerCall]:
        """The calls a process died during (started, never returned, its run not live)."""
        ...

    def live_runs(self, run_ids: Collection[str]) -> Collection[str]:
        """Those of ``run_ids`` a live process holds now (by a lease the store signed)."""
        ...

    def stored_runs(self, run_ids: Collection[str]) -> Collection[str]:
        """Those of ``run_ids`` the store has a run row of."""
        ...


@dataclass(frozen=True)
class RunsLedger:
    """A ledger narrowed to some runs: a tenant's, on a service's database, where each tenant's
    trail is a chain of its own and one run store holds every tenant's runs."""

    ledger: Ledger
    runs: frozenset[str]

    def ledger_calls(self, run_id: str | None = None) -> list[LedgerCall]:
        return [call for call in self.ledger.ledger_calls(run_id) if call.run_id in self.runs]

    def calls_in_flight(self, run_id: str | None = None) -> list[LedgerCall]:
        return [call for call in self.ledger.calls_in_flight(run_id) if call.run_id in self.runs]

    def forged_rows(self, run_id: str | None = None) -> list[ForgedRow]:
        return [row for row in self.ledger.forged_rows(run_id) if row.run_id in self.runs]

    def live_runs(self, run_ids: Collection[str]) -> Collection[str]:
        return self.ledger.live_runs(run_ids)  # the trail's runs are the tenant's: not narrowed

    def stored_runs(self, run_ids: Collection[str]) -> Collection[str]:
        return self.ledger.stored_runs(run_ids)


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One finding. ``seq`` is where it shows (0 when it concerns the store as a whole)."""

    seq: int
    kind: ProblemKind
    detail: str
    run_id: str = ""

    def __str__(self) -> str:
        return f"seq {self.seq}: {self.kind.value}: {self.detail}"


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """What ``verify`` found. ``problems`` is empty when the chain is intact."""

    store: str
    run_id: str | None
    algorithm: str
    checked: int
    run_events: int
    last_seq: int
    last_hash: str
    problems: tuple[Problem, ...] = ()
    problems_elsewhere: int = 0
    problems_truncated: bool = False
    head: Head | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def found(self) -> bool:
        """Whether there was anything to verify: events in the store (of ``run_id``, if given).
        An empty trail has no problems, and proves nothing."""
        return self.checked > 0 and (self.run_id is None or self.run_events > 0)

    def raise_for_problems(self) -> None:
        if self.problems:
            raise exc.AuditIntegrityError(f"{self.store}: " + "; ".join(str(p) for p in self.problems[:5]))

    def summary(self) -> str:
        scope = f"run {self.run_id} ({self.run_events} events) in " if self.run_id is not None else ""
        if self.ok and not self.found:
            what = f"no events of run {self.run_id}" if self.checked else "no events at all"
            return f"{scope}{self.checked} events checked: {what}, nothing to verify"
        state = "intact" if self.ok else f"{len(self.problems)} problem(s)"
        return f"{scope}{self.checked} events checked ({self.algorithm}), head seq {self.last_seq}: {state}"


def verify(  # noqa: C901 - one pass over the chain, a branch per way it can be broken
    store: AuditStore,
    *,
    run_id: str | None = None,
    key: bytes | None = None,
    expected_head: Head | tuple[int, str] | None = None,
    max_problems: int = 1000,
    ledger: Ledger | None = None,
) -> VerifyReport:
    """Check the whole chain of ``store`` (one chain per store; ``run_id`` narrows the report).

    With ``run_id``, problems on other runs' events are only counted (``problems_elsewhere``);
    gaps, truncation and head problems are always reported: a deleted event's run is unknown.
    With ``ledger``, the tool calls it holds are cross-checked with the ``tool_call`` events.
    """
    if expected_head is not None:  # a caller's: checked before anything is read
        pinned = (expected_head.seq, expected_head.hash) if isinstance(expected_head, Head) else expected_head
        if not isinstance(pinned, tuple) or len(pinned) != 2:
            raise exc.InvalidArgument("expected_head is a Head or (seq, hash)", argument="expected_head")
        check_number(pinned[0], argument="expected_head", integer=True, low=0, high=2**63 - 1)
        check_text(pinned[1], argument="expected_head")
    chain = Chain(key)
    problems: list[Problem] = []
    elsewhere = 0
    truncated = False
    head = _read_head(store, problems)

    def report(seq: int, kind: ProblemKind, detail: str, run: str = "", signed: str | None = None) -> None:
        """``run``: the run the row's column names; ``signed``: the one its signed body names,
        "" where the body cannot be trusted (edited, unreadable): a problem of either, or of
        an event whose run nobody can tell, is one of ``run_id``'s (an event moved to another
        run by its column, or edited, passed a check of its own run before)."""
        nonlocal elsewhere, truncated
        if run_id is not None and run and run != run_id and signed != "" and (signed or run) != run_id:
            elsewhere += 1
        elif len(problems) < max_problems:
            problems.append(Problem(seq=seq, kind=kind, detail=detail, run_id=run))
        else:
            truncated = True

    algorithm, check_hashes = _algorithm(head, chain, report)

    link = chain.link
    strings: dict[str, str] = {}  # decoded JSON strings (run ids and kinds repeat)
    expected_seq = 1
    prev = GENESIS
    checked = run_events = edited = last_seq = 0
    book = _Book(run_id, ledger is not None)
    at_head: str | None = None  # the stored hash of the event the head record named
    for seq, run, kind, body, stored_hash, step, timestamp_ns in store.rows():
        checked += 1
        if head is not None and seq == head.seq:
            at_head = stored_hash
        if run == run_id:
            run_events += 1
        book.note(seq, run, kind, body, step, report=report)
        try:
            signed = _signed_fields(body, strings)
            signed_run = signed.run_id
        except ValueError:
            report(seq, ProblemKind.UNREADABLE, "the body is not an audit event", run, signed="")
            prev, expected_seq, last_seq = stored_hash, seq + 1, seq
            continue
        if seq > expected_seq:
            gap = f"{expected_seq}" if seq == expected_seq + 1 else f"{expected_seq}..{seq - 1}"
            report(expected_seq, ProblemKind.MISSING, f"events {gap} are missing (deleted)")
        elif seq < expected_seq:
            detail = f"seq {seq} comes after {expected_seq - 1}"
            report(seq, ProblemKind.OUT_OF_ORDER, detail, run, signed_run)
        for problem, detail in _mismatches(
            seq, run, kind, signed, step=step, timestamp_ns=timestamp_ns, prev=prev
        ):
            report(seq, problem, detail, run, signed_run)
        if check_hashes and link(signed.prev, body.encode()) != stored_hash:
            edited += 1
            report(seq, ProblemKind.EDITED, "the event's content does not match its hash", run, signed="")
        else:
            book.intact(seq, run, kind, body)
        # Continue from what is stored, so that one tampered event is one finding, not a cascade.
        prev, expected_seq, last_seq = stored_hash, seq + 1, seq

    if chain.keyed and check_hashes and checked and edited == checked:
        problems[:] = [p for p in problems if p.kind is not ProblemKind.EDITED]
        problems.insert(0, Problem(seq=0, kind=ProblemKind.WRONG_KEY, detail="no event matches this key"))

    if head is not None:
        if head.seq > last_seq:
            detail = f"the chain ends at seq {last_seq} but the head record says {head.seq}"
            report(last_seq + 1, ProblemKind.TRUNCATED, detail)
        elif head.hash != (prev if head.seq == last_seq else at_head) or (
            head.seq < last_seq and not _head_covers(store, last_seq)
        ):
            detail = f"the head record (seq {head.seq}) does not match the chain's end (seq {last_seq})"
            report(head.seq, ProblemKind.HEAD_FORGED, detail)
        if check_hashes and not chain.head_verifies(head.seq, head.hash, store.ns, head.mac):
            detail = "the head record's MAC is wrong (edited, or the chain copied from another namespace)"
            report(head.seq, ProblemKind.HEAD_FORGED, detail)
    elif checked:
        report(0, ProblemKind.HEAD_FORGED, "events exist but the head record is empty")

    book.finish(store, ledger, report)

    if expected_head is not None:
        pin_seq, pin_hash = (
            (expected_head.seq, expected_head.hash) if isinstance(expected_head, Head) else expected_head
        )
        found = _hash_at(store, pin_seq)
        if found != pin_hash:
            where = "absent" if found is None else "a different event"
            report(pin_seq, ProblemKind.UNEXPECTED_HEAD, f"the pinned head (seq {pin_seq}) is {where} here")

    return VerifyReport(
        store=store.url,
        run_id=run_id,
        algorithm=algorithm,
        checked=checked,
        run_events=run_events,
        last_seq=last_seq,
        last_hash=prev,
        problems=tuple(problems),
        problems_elsewhere=elsewhere,
        problems_truncated=truncated,
        head=head,
    )


_Report = Callable[[int, ProblemKind, str, str], None]


class _Book:
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

    def note(self, seq: int, run: str, kind: str, body: str, step: int, *, report: _Report) -> None:
        """A row, whatever its state (by its columns: a row edited is reported besides)."""
        if not self.ledgered:
            return
        open_calls = self.open_calls
        if kind == "note" and _attributes(body).get("action") == "delete":
            self.deleted.add(run)  # a service's deletion (or `runs erase`'s of a run not sealed)
            open_calls.pop(run, None)  # a call cut before it is not in flight: the run is gone
        if kind not in _KEYED or (self.run_id is not None and run != self.run_id):
            return
        if kind == "tool_call_start":
            attributes = _attributes(body)
            call_key = attributes.get("idempotency_key")
            if isinstance(call_key, str):
                self.started.add((run, call_key))
                open_calls.setdefault(run, {})[call_key] = _Start(seq, step, str(attributes.get("tool")))
        elif kind in _CLOSING:  # the run stopped, or was resumed: every call before is closed
            open_calls.pop(run, None)
            if kind == "run_start" and run not in self.recorded and _attributes(body).get(STORED) is True:
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

    def finish(self, store: AuditStore, ledger: Ledger | None, report: _Report) -> None:
        if ledger is not None:
            self._cross_check(ledger, report)
        if self.sealed or self.erased:
            _check_run_keys(store, self.sealed, self.erased, report)

    def _cross_check(self, ledger: Ledger, report: _Report) -> None:
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


_BROKEN = (
    "prev_hash is not the hash of the event before: that event was edited, "
    "or events were removed or inserted between them"
)


def _mismatches(
    seq: int, run: str, kind: str, signed: _Signed, *, step: int, timestamp_ns: int, prev: str | None = None
) -> list[tuple[ProblemKind, str]]:
    """Where a row's columns differ from what its body signs; and, given the hash of the event
    read before it (``prev``), whether its link does."""
    found = []
    if signed.seq != seq:
        detail = f"the row is seq {seq} but its signed body says {signed.seq} (moved or renumbered)"
        found.append((ProblemKind.OUT_OF_ORDER, detail))
    if prev is not None and signed.prev != prev:
        found.append((ProblemKind.BROKEN_LINK, _BROKEN))
    if signed.run_id != run or signed.kind != kind:
        detail = f"columns say {run!r}/{kind!r}, the signed body {signed.run_id!r}/{signed.kind!r}"
        found.append((ProblemKind.COLUMN_MISMATCH, detail))
    if signed.step != step or signed.timestamp_ns != timestamp_ns:
        detail = (
            f"columns say step {step!r} at {timestamp_ns!r}, the signed body step {signed.step} "
            f"at {signed.timestamp_ns}"
        )
        found.append((ProblemKind.COLUMN_MISMATCH, detail))
    return found


def _read_head(store: AuditStore, problems: list[Problem]) -> Head | None:
    """The store's head record; None, and a problem, where it cannot be read as one."""
    try:
        return store.head()
    except exc.AuditIntegrityError as error:
        problems.append(Problem(seq=0, kind=ProblemKind.HEAD_FORGED, detail=str(error)))
        return None


def _algorithm(head: Head | None, chain: Chain, report: _Report) -> tuple[str, bool]:
    """The chain's algorithm (the head's, where there is one) and whether the hashes can be
    checked with the key given: a wrong key is reported once, and no hash is then judged.

    The head's algorithm is the store's word, written by whoever writes the store: given a key,
    a head that says the chain is unkeyed is never taken for the truth (the operator's key is),
    since anyone who can write the store can rewrite the chain unkeyed, head and all."""
    algorithm = head.algorithm if head is not None else chain.algorithm
    check_hashes = head is None or head.algorithm == chain.algorithm
    if not check_hashes and chain.keyed:
        detail = (
            f"a key was given and the chain says it uses {algorithm}, unkeyed: downgraded (rewritten "
            "without the key by someone who can write the store) or never keyed; an unkeyed chain "
            "proves nothing against such a writer"
        )
        report(0, ProblemKind.DOWNGRADED, detail, "")
    elif not check_hashes:
        report(0, ProblemKind.WRONG_KEY, f"the chain uses {algorithm}: pass a key (it is keyed)", "")
    return algorithm, check_hashes


def verify_run(  # noqa: C901 - the run's events, then the links and the head around them
    store: AuditStore,
    run_id: str,
    *,
    key: bytes | None = None,
    ledger: Ledger | None = None,
    max_problems: int = 1000,
) -> VerifyReport:
    """Check one run's events and how each is tied into the chain, reading in proportion to the
    run, not to the trail: the run's rows (by the store's index of runs), the event on either
    side of each of them, and the head. What the run viewer shows with a run.

    Each event of the run is checked as ``verify`` checks it (its hash, its columns against
    its signed body); so are both its links: its ``prev_hash`` is the hash of the event
    stored before it (``seq - 1``) and the event after it names its hash, so an event of the
    run edited, deleted next to one of the run's, or cut from its end is found, and an event
    inserted or removed beside any of them breaks a link checked here. The head is checked as
    ``verify`` checks it (its MAC; the event it names is there, with its hash; nothing past it),
    and with ``ledger`` the run's tool calls are cross-checked with the run store's ledger, so
    a tool call deleted from the trail is ``not_in_trail`` wherever it was.

    What only ``verify`` (the whole chain) finds: an event of the run that is not a tool call
    the ledger holds, deleted from between two events of other runs, renumbering whose gap
    falls between other runs' events; an event moved to another run by its column (the
    run's index no longer lists it); and anything done to other runs' events. Run ``stockade
    audit verify`` (``GET /v1/audit/verify``) for those.
    """
    chain = Chain(key)
    problems: list[Problem] = []
    truncated = False
    head = _read_head(store, problems)

    def report(seq: int, kind: ProblemKind, detail: str, run: str = "") -> None:
        nonlocal truncated
        if len(problems) < max_problems:
            problems.append(Problem(seq=seq, kind=kind, detail=detail, run_id=run))
        else:
            truncated = True

    algorithm, check_hashes = _algorithm(head, chain, report)

    book = _Book(run_id, ledger is not None)
    strings: dict[str, str] = {}
    own: dict[int, tuple[str | None, str]] = {}  # seq -> (signed prev_hash, stored hash) of the run's
    edited = 0
    for seq, run, kind, body, stored_hash, step, timestamp_ns in store.rows(run_id=run_id):
        book.note(seq, run, kind, body, step, report=report)
        try:
            signed = _signed_fields(body, strings)
        except ValueError:
            report(seq, ProblemKind.UNREADABLE, "the body is not an audit event", run)
            own[seq] = (None, stored_hash)
            continue
        own[seq] = (signed.prev, stored_hash)
        for problem, detail in _mismatches(seq, run, kind, signed, step=step, timestamp_ns=timestamp_ns):
            report(seq, problem, detail, run)
        if check_hashes and chain.link(signed.prev, body.encode()) != stored_hash:
            edited += 1
            report(seq, ProblemKind.EDITED, "the event's content does not match its hash", run)
        else:
            book.intact(seq, run, kind, body)
    if chain.keyed and check_hashes and own and edited == len(own):
        problems[:] = [p for p in problems if p.kind is not ProblemKind.EDITED]
        problems.insert(0, Problem(seq=0, kind=ProblemKind.WRONG_KEY, detail="no event matches this key"))

    # The events on either side of the run's, and the one the head names (and the one after it).
    last = head.seq if head is not None else 0
    near = {s - 1 for s in own if s > 1} | {s + 1 for s in own}
    if head is not None:
        near |= {head.seq, head.seq + 1}
    around = {row.seq: row for row in store.rows_at(near - own.keys())}

    def hash_at(seq: int) -> str | None:
        if seq in own:
            return own[seq][1]
        return around[seq].hash if seq in around else None

    for seq, (prev, stored_hash) in own.items():
        if prev is not None:
            before = GENESIS if seq == 1 else hash_at(seq - 1)
            if before is None:
                report(
                    seq - 1, ProblemKind.MISSING, f"event {seq - 1}, before this run's, is missing (deleted)"
                )
            elif before != prev:
                report(seq, ProblemKind.BROKEN_LINK, _BROKEN, run_id)
        if seq + 1 in own:
            continue  # its link back is checked as the run's own
        following = around.get(seq + 1)
        if following is None:
            if seq < last:
                detail = f"event {seq + 1}, after this run's, is missing (deleted)"
                report(seq + 1, ProblemKind.MISSING, detail)
            continue
        try:
            linked = _signed_fields(following.body, strings).prev == stored_hash
        except ValueError:
            linked = False
        if not linked:
            detail = (
                f"the event after this run's event {seq} does not name its hash: this run's event "
                "was edited, or events were removed or inserted after it"
            )
            report(seq + 1, ProblemKind.BROKEN_LINK, detail, run_id)

    if head is not None:
        at = hash_at(head.seq)
        reached = max([*own, *around], default=0)
        if at is None:
            detail = (
                f"the head record says the chain reaches seq {head.seq}, and there is no event {head.seq}"
            )
            report(head.seq, ProblemKind.TRUNCATED, detail)
        elif at != head.hash or (reached > head.seq and not _head_covers(store, reached)):
            detail = f"the head record (seq {head.seq}) does not match the chain's event there"
            report(head.seq, ProblemKind.HEAD_FORGED, detail)
        if check_hashes and not chain.head_verifies(head.seq, head.hash, store.ns, head.mac):
            detail = "the head record's MAC is wrong (edited, or the chain copied from another namespace)"
            report(head.seq, ProblemKind.HEAD_FORGED, detail)
    elif own or around:
        report(0, ProblemKind.HEAD_FORGED, "events exist but the head record is empty")

    book.finish(store, ledger, report)
    return VerifyReport(
        store=store.url,
        run_id=run_id,
        algorithm=algorithm,
        checked=len(own) + len(around),
        run_events=len(own),
        last_seq=last,
        last_hash=head.hash if head is not None else GENESIS,
        problems=tuple(problems),
        problems_truncated=truncated,
        head=head,
    )


def _head_covers(store: AuditStore, last_seq: int) -> bool:
    """Whether the head, read now, covers the events read past the head read first: they were
    appended since by a writer, which moves the head in the transaction that adds events.
    Events past a head that never moves were added around the writers."""
    now = store.head()
    return now is not None and now.seq >= last_seq


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
    attributes = _attributes(body)
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


def unrecorded_erasures(store: AuditStore, run_ids: Iterable[str]) -> set[str]:
    """Those of ``run_ids`` the trail says a run store recorded (a ``run_start`` so marked) and
    records no erasure of (a ``note`` ``action: delete``, a ``run_erased``): gone from their
    store, ``verify`` reports each ``not_in_store`` until its erasure is recorded."""
    found: set[str] = set()
    for run in run_ids:
        recorded = deleted = False
        for row in store.rows(run_id=run):
            if row.kind == "run_start" and _attributes(row.body).get(STORED) is True:
                recorded = True
            elif row.kind == "run_erased" or (
                row.kind == "note" and _attributes(row.body).get("action") == "delete"
            ):
                deleted = True
        if recorded and not deleted:
            found.add(run)
    return found


def _attributes(body: str) -> dict[str, object]:
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
                open_attributes(run, _attributes(body), key)
            except exc.AuditIntegrityError:
                detail = f"the key kept for sealed run {run} does not open its events: replaced"
                report(seq, ProblemKind.RUN_KEY_FORGED, detail, run)


def _hash_at(store: AuditStore, seq: int) -> str | None:
    for row in store.rows(after_seq=seq - 1):
        return row.hash if row.seq == seq else None
    return None
