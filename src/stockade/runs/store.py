"""``RunStore``: runs, steps, tool calls, retries and approvals, checkpointed after every step.

    store = open_run_store("sqlite:///.stockade/audit.db")    # or postgresql://...
    recorder = RunRecorder(store)
    agent = Agent(model, checkpointer=store, observers=[recorder])

It is the agent's ``Checkpointer``, stored as append-only rows so that the cost of a save
does not grow with the run (``checkpoints``).

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

``RunStore`` is the one API; the work is done by collaborators, one per concern, each in its
module: ``LeaseKeeper`` (``lease_keeper``: leases, and the fence on every write of a leased
run), ``CallLedger`` (``ledger``: calls returned and started), ``Checkpoints``
(``checkpoints``: saves, loads, and what this process has written), ``WorkspaceHistory``
(``workspace_history``: workspaces and seeds) and ``Erasure`` (``erasure``).

``RunStore`` itself is made of parts, each a base class of the next: its database, tables and
collaborators (``_store_parts``) <- what a run records, one run at a time (``_store_records``)
<- what readers read across runs (``_store_reads``) <- ``RunStore``: leases and claims, calls
started, erasure, and opening a store from a URL (here).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

from stockade import exceptions as exc
from stockade._checks import check_id, check_number, check_strings, check_text
from stockade.audit._store_sql import check_namespace
from stockade.audit.redact import Redactor
from stockade.models.messages import ToolCall
from stockade.runs._db import Database, PostgresDatabase, SQLiteDatabase
from stockade.runs._store_parts import check_run_id
from stockade.runs._store_reads import RunReads
from stockade.runs.checkpoints import OUTCOME_UNKNOWN
from stockade.runs.lease import LeaseHolder, RunLease
from stockade.runs.lease_keeper import live_expiry
from stockade.runs.records import ApprovalEntry, RetryEntry, RunSetup, RunSummary, RunTrace, WorkspaceUsage

__all__ = [
    "OUTCOME_UNKNOWN",
    "ApprovalEntry",
    "RetryEntry",
    "RunSetup",
    "RunStore",
    "RunSummary",
    "RunTrace",
    "WorkspaceUsage",
    "holds_run_store",
    "open_run_store",
]


class RunStore(RunReads):
    """Runs in a SQL database (tables ``<namespace>_*``); implements ``Checkpointer``."""

    # -- durability: leases, calls started -------------------------------------------------------

    def claim(self, run_id: str, *, new: bool, wait_s: float | None = None) -> RunLease:
        """Take the run's lease: for a ``new`` run (``RunConflict`` if the store has the id),
        or to resume one (``RunConflict`` if it ended). A live lease of another process:
        wait up to ``wait_s`` (default ``lease_wait_s``), then ``RunLeased``. A lease this
        process took ahead for the run (``claimed_ahead``) is the one given."""
        with self._ahead_lock:
            ahead = self._ahead.pop(run_id, None)
        if ahead is not None and ahead.held:
            return ahead
        if new:  # a new run's id is one the audit trail can keep too (no control character)
            check_id(run_id, argument="run_id")
        check_run_id(run_id)
        if new and self._erased(run_id):
            raise exc.RunConflict(
                f"run {run_id!r} was erased: its id stays taken (its audit events keep it), so a new "
                "run needs an id of its own (leave the id out for a random one)"
            )
        if new and self._exists(run_id):
            raise exc.RunConflict(
                f"the run store already has a run {run_id!r}: a new run needs an id of its own "
                "(leave the id out for a random one), and a stopped run continues with resume"
            )

        def not_ended() -> None:
            summary = self.summary(run_id)
            if summary is not None and summary.status.finished:
                raise exc.RunConflict(
                    f"run {run_id} ended ({summary.status.value}); a run that ended is kept as it is "
                    "and never resumed: start a new run"
                )

        owner, previous = self._leases.take(
            run_id,
            new=new,
            lease_s=self.lease_s,
            wait_s=self.lease_wait_s if wait_s is None else wait_s,
            check=None if new else not_ended,
        )
        if new:
            self._workspaces.start(run_id)
        if new and previous is not None:
            # a start that died before its first checkpoint: what it wrote is no run's
            self._leases.write(
                run_id,
                [
                    (f"DELETE FROM {self.ns}_{table} WHERE run_id = ?", [(run_id,)])
                    for table in ("workspace", "calls_started", "run_seeds", "setups")
                ],
            )
        unsaved_s = 0.0 if new or previous is None else self._unsaved_s(run_id, previous)
        return RunLease(
            self, run_id, owner, ttl_s=self.lease_s, previous=None if new else previous, unsaved_s=unsaved_s
        )

    @contextlib.contextmanager
    def claimed_ahead(self, run_id: str, *, new: bool) -> Iterator[RunLease]:
        """Take the run's lease now (``claim``, not waiting: ``RunLeased``), before what takes
        long to make ready for the run (its sandbox), and give it to the next ``claim`` of the
        run in this process (the agent's). Released on leaving, not by its holder's release:
        what follows the run here, up to saying how it ended, is still the run's."""
        lease = self.claim(run_id, new=new, wait_s=0.0)
        lease.kept = True
        with self._ahead_lock:
            self._ahead[run_id] = lease
        try:
            yield lease
        finally:
            with self._ahead_lock:
                if self._ahead.get(run_id) is lease:
                    del self._ahead[run_id]
            lease.kept = False
            lease.release()  # idempotent: a no-op once the agent's run released it

    def _unsaved_s(self, run_id: str, previous: LeaseHolder) -> float:
        """How long a process that died running the run ran past its last checkpoint: to its
        lease's last renewal (every third of ``lease_s``), its last sign of life. Its node's
        time was only in memory: counted, repeated kills mid-call would outrun ``max_wall_s``."""
        if previous.reason == "released":  # it stopped the run itself, saying where
            return 0.0
        rows = self.db.query(f"SELECT MAX(created_ns) FROM {self.ns}_checkpoints WHERE run_id = ?", (run_id,))
        if not rows or rows[0][0] is None:
            return 0.0
        alive_ns = previous.expires_ns - round(self.lease_s * 1e9)
        return max(0.0, (alive_ns - int(str(rows[0][0]))) / 1e9)

    def _exists(self, run_id: str) -> bool:
        """Whether the store has a run of this id (a start that died before its first
        checkpoint left only a lease: it is no run)."""
        ns = self.ns
        for table in ("runs", "checkpoints", "tool_calls"):
            if self.db.query(f"SELECT 1 FROM {ns}_{table} WHERE run_id = ? LIMIT 1", (run_id,)):
                return True
        return False

    def _erased(self, run_id: str) -> bool:
        return bool(self.db.query(f"SELECT 1 FROM {self.ns}_erased WHERE run_id = ?", (run_id,)))

    def leased(self, run_id: str) -> bool:
        """Whether a live process (this one too) holds the run's lease now."""
        check_run_id(run_id)
        return live_expiry(self.db, self.ns, run_id, time.time_ns()) is not None

    def renew_lease(self, run_id: str, owner: str, ttl_s: float) -> bool:
        """Push the lease's end ``ttl_s`` ahead; False when it is no longer ``owner``'s."""
        check_run_id(run_id)
        return self._leases.renew(run_id, owner, ttl_s)

    def release_lease(self, run_id: str, owner: str) -> None:
        check_run_id(run_id)
        self._leases.release(run_id, owner)

    def forget_lease(self, run_id: str, owner: str) -> None:
        # the workspace's tracker stays: a resume here may find nothing to restore
        check_run_id(run_id)
        self._leases.forget(run_id, owner)

    def call_started(self, run_id: str, step: int, call: ToolCall, key: str, *, idempotent: bool) -> None:
        """Record that ``call`` is about to run (again: its attempts are counted)."""
        check_run_id(run_id)
        self._ledger.call_started(run_id, step, call, key, idempotent=idempotent)

    def call_parked(self, run_id: str, key: str) -> None:
        """The call stopped at an approval before its effect: forget that it started, so a
        resume runs it again (its attempts start over)."""
        check_run_id(run_id)
        self._ledger.call_parked(run_id, key)

    def attempts(self, run_id: str) -> dict[str, int]:
        """How many times each call of the run started: idempotency key -> attempts."""
        check_run_id(run_id)
        return self._ledger.attempts(run_id)

    # -- erasure ------------------------------------------------------------------------------

    def tag_subject(self, run_id: str, subject: str) -> None:
        """Record that the run holds personal data of ``subject`` (erase it with ``runs_of``)."""
        check_run_id(run_id)
        self._erasure.tag_subject(run_id, subject)

    def runs_of(self, *, subject: str | None = None, before_ns: int | None = None) -> list[str]:
        """The runs of a data subject, and/or the runs last updated before ``before_ns``."""
        if subject is not None:
            check_text(subject, argument="subject")
        if before_ns is not None:
            check_number(before_ns, argument="before_ns", integer=True, low=0, high=2**63 - 1, unit="ns")
        return self._erasure.runs_of(subject=subject, before_ns=before_ns)

    def check_erasable(self, run_ids: Sequence[str]) -> None:
        """``RunConflict`` when one of these runs is still running, as ``erase`` would raise:
        asked before the erasure is recorded elsewhere (the audit trail), so that a refused
        erasure records none."""
        runs = list(dict.fromkeys(check_strings(run_ids, argument="run_ids")))
        if runs:
            self.sweep()
            self._erasure.refuse_running(runs)

    def erase(self, run_ids: Sequence[str]) -> int:
        """Remove every row of these runs, and the workspace contents and seeds that no other run
        shares; returns the runs erased. A run still running is refused (``RunConflict``)."""
        # a lone str is refused: read a character at a time it erased nothing, and recorded
        # the erasure of runs named "r", "u", "n"
        runs = list(dict.fromkeys(check_strings(run_ids, argument="run_ids")))
        if not runs:
            return 0
        self.sweep()
        erased = self._erasure.erase(runs)
        for run_id in runs:
            self._checkpoints.forget(run_id)
            self._workspaces.forget(run_id)
        return erased

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_run_store(
    url: str,
    *,
    namespace: str = "runs",
    redactor: Redactor | None = None,
    key: bytes | None = None,
    read_only: bool = False,
) -> RunStore:
    """A run store from a URL: ``sqlite:///PATH`` (may be the audit database file), a plain
    file path, ``postgresql://...``, or ``memory:``. ``key``: the audit trail's HMAC key (the
    rows a resume acts on are MAC'd under a key derived from it, and checked).

    ``read_only``: a reader's (``audit verify``, ``runs list``, the run viewer), that changes
    nothing in what it reads: no table or column is made (a store that lacks one is
    ``RunStoreCorrupt``), a missing SQLite file is a ``RunStoreError`` (never a new empty store),
    nothing is made beside it, PostgreSQL runs ``READ ONLY`` transactions, every write is
    refused, and runs whose process died are shown ``interrupted`` without being marked so."""
    db = _database(url, read_only=read_only)
    try:
        return RunStore(db, namespace=namespace, redactor=redactor, key=key)
    except BaseException:  # a store that lacks tables, read-only: its connection is ours to close
        db.close()
        raise


def holds_run_store(url: str, *, namespace: str = "runs") -> bool:
    """Whether the database at ``url`` holds a run store of ``namespace`` (its ledger's table),
    asked read-only: a reader that only may cross-check with one (``audit verify`` of a
    database that holds a trail and no runs) asks first, as opening the store says what it
    lacks. ``RunStoreError`` where the database cannot be asked."""
    table = f"{check_namespace(namespace)}_tool_calls"
    db = _database(url, read_only=True)
    try:
        return bool(db.columns(table))
    finally:
        db.close()


def _database(url: str, *, read_only: bool) -> Database:
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresDatabase(url, read_only=read_only)
    if url.startswith("sqlite:///"):
        return SQLiteDatabase(url[len("sqlite:///") :], read_only=read_only)
    if url == "memory:":  # tests and one-off tools
        return SQLiteDatabase(":memory:", read_only=read_only)
    if "://" in url:
        raise exc.ConfigurationError(f"unknown run store URL {url!r}: use sqlite:///PATH or postgresql://...")
    return SQLiteDatabase(url, read_only=read_only)
