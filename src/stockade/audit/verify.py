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

Where it is: the passes over the chain (``verify``, ``verify_run``) and the head are here; a
row against its signed body in ``_signed_rows``; what the events say of runs (the ledger's
cross-check, duplicates, calls in flight, sealed runs' keys) in ``_run_book``; the values
apart, importable without the checks: the ledger's protocol in ``ledger`` (the run store
implements it) and what a verification finds in ``verify_report``.
"""

from __future__ import annotations

from collections.abc import Iterable

from stockade import exceptions as exc
from stockade._checks import check_number, check_text
from stockade.audit._run_book import Book, Report, body_attributes
from stockade.audit._signed_rows import BROKEN, mismatches, signed_fields
from stockade.audit.events import GENESIS, STORED, Chain
from stockade.audit.ledger import ForgedRow, Ledger, LedgerCall, RunsLedger
from stockade.audit.stores import AuditStore, Head
from stockade.audit.verify_report import Problem, ProblemKind, VerifyReport

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
    book = Book(run_id, ledger is not None)
    at_head: str | None = None  # the stored hash of the event the head record named
    for seq, run, kind, body, stored_hash, step, timestamp_ns in store.rows():
        checked += 1
        if head is not None and seq == head.seq:
            at_head = stored_hash
        if run == run_id:
            run_events += 1
        book.note(seq, run, kind, body, step, report=report)
        try:
            signed = signed_fields(body, strings)
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
        for problem, detail in mismatches(
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


def _read_head(store: AuditStore, problems: list[Problem]) -> Head | None:
    """The store's head record; None, and a problem, where it cannot be read as one."""
    try:
        return store.head()
    except exc.AuditIntegrityError as error:
        problems.append(Problem(seq=0, kind=ProblemKind.HEAD_FORGED, detail=str(error)))
        return None


def _algorithm(head: Head | None, chain: Chain, report: Report) -> tuple[str, bool]:
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

    book = Book(run_id, ledger is not None)
    strings: dict[str, str] = {}
    own: dict[int, tuple[str | None, str]] = {}  # seq -> (signed prev_hash, stored hash) of the run's
    edited = 0
    for seq, run, kind, body, stored_hash, step, timestamp_ns in store.rows(run_id=run_id):
        book.note(seq, run, kind, body, step, report=report)
        try:
            signed = signed_fields(body, strings)
        except ValueError:
            report(seq, ProblemKind.UNREADABLE, "the body is not an audit event", run)
            own[seq] = (None, stored_hash)
            continue
        own[seq] = (signed.prev, stored_hash)
        for problem, detail in mismatches(seq, run, kind, signed, step=step, timestamp_ns=timestamp_ns):
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
                report(seq, ProblemKind.BROKEN_LINK, BROKEN, run_id)
        if seq + 1 in own:
            continue  # its link back is checked as the run's own
        following = around.get(seq + 1)
        if following is None:
            if seq < last:
                detail = f"event {seq + 1}, after this run's, is missing (deleted)"
                report(seq + 1, ProblemKind.MISSING, detail)
            continue
        try:
            linked = signed_fields(following.body, strings).prev == stored_hash
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


def unrecorded_erasures(store: AuditStore, run_ids: Iterable[str]) -> set[str]:
    """Those of ``run_ids`` the trail says a run store recorded (a ``run_start`` so marked) and
    records no erasure of (a ``note`` ``action: delete``, a ``run_erased``): gone from their
    store, ``verify`` reports each ``not_in_store`` until its erasure is recorded."""
    found: set[str] = set()
    for run in run_ids:
        recorded = deleted = False
        for row in store.rows(run_id=run):
            if row.kind == "run_start" and body_attributes(row.body).get(STORED) is True:
                recorded = True
            elif row.kind == "run_erased" or (
                row.kind == "note" and body_attributes(row.body).get("action") == "delete"
            ):
                deleted = True
        if recorded and not deleted:
            found.add(run)
    return found


def _hash_at(store: AuditStore, seq: int) -> str | None:
    for row in store.rows(after_seq=seq - 1):
        return row.hash if row.seq == seq else None
    return None
