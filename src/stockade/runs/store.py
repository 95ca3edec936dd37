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
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from stockade import exceptions as exc
from stockade._checks import check_id, check_number, check_strings, check_text
from stockade.agent.state import RunState, RunStatus, ToolCallRecord
from stockade.audit.ledger import ForgedRow, LedgerCall
from stockade.audit.redact import Redactor
from stockade.audit.stores import check_namespace
from stockade.models.messages import ToolCall
from stockade.policy.schema import Policy
from stockade.runs._db import Database, PostgresDatabase, SQLiteDatabase, Statement, display_url
from stockade.runs._mac import RowMac, insert, select, unauthentic_rows
from stockade.runs._schema import (
    MAC_TABLES,
    as_float,
    as_int,
    schema,
    summary_from_row,
    tables,
)
from stockade.runs.checkpoints import OUTCOME_UNKNOWN, Checkpoints
from stockade.runs.erasure import Erasure
from stockade.runs.lease import LEASE_S, MAX_LEASE_S, LeaseHolder, RunLease
from stockade.runs.lease_keeper import STALE_WHY, LeaseKeeper, live_expiry
from stockade.runs.ledger import CallLedger
from stockade.runs.records import ApprovalEntry, RetryEntry, RunSetup, RunSummary, RunTrace, WorkspaceUsage
from stockade.runs.seeds import MAX_SEED_BYTES
from stockade.runs.workspace import MAX_RUN_BYTES, MAX_WORKSPACE_BYTES, MAX_WORKSPACE_ENTRIES
from stockade.runs.workspace_history import WorkspaceHistory
from stockade.sandbox.facade import Sandbox

if TYPE_CHECKING:
    from stockade.agent.limits import RunLimits

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
        max_run_bytes: int = MAX_RUN_BYTES,
        lease_s: float = LEASE_S,
        lease_wait_s: float = 0.0,
        key: bytes | None = None,
    ) -> None:
        if not 0 < lease_s <= MAX_LEASE_S or lease_wait_s < 0:
            raise exc.ConfigurationError(
                f"RunStore: lease_s must be positive and at most {MAX_LEASE_S:g}, and lease_wait_s >= 0"
            )
        self.db = db
        self.max_seed_bytes = max_seed_bytes
        self.lease_s = lease_s
        self.lease_wait_s = lease_wait_s  # how long ``claim`` waits for a held lease
        # Remembering: an observation is written in a message, a step and the ledger, and an
        # agent reads the same files again and again; each long text is redacted once.
        self.redactor = (redactor if redactor is not None else Redactor()).remembering()
        self.ns = check_namespace(namespace)
        self.url = db.url
        self._where = where = display_url(db)
        # the audit trail's key: the rows a resume acts on are MAC'd under a key derived from it
        self.mac = RowMac(key)
        self._leases = LeaseKeeper(db, self.ns, self.mac)
        self._ahead: dict[str, RunLease] = {}  # leases taken ahead (``claimed_ahead``), by run id
        self._ahead_lock = threading.Lock()
        self._ledger = CallLedger(db, self.ns, self.redactor, self.mac, write=self._leases.write, where=where)
        self._checkpoints = Checkpoints(
            db, self.ns, self.redactor, self._ledger, self.mac, write=self._leases.write, where=where
        )
        self._workspaces = WorkspaceHistory(
            db,
            self.ns,
            self._checkpoints,
            max_bytes=max_workspace_bytes,
            max_entries=max_workspace_entries,
            max_run_bytes=max_run_bytes,
            where=where,
        )
        self._erasure = Erasure(db, self.ns)
        if db.read_only:  # a reader makes nothing: what the store lacks is said, not made
            self._check_schema()
            return
        self.db.create(schema(self.ns, db.serial, db.blob), name=self.ns)
        for table in MAC_TABLES:
            self.db.add_column(f"{self.ns}_{table}", "mac", "TEXT")
        for table in ("blobs", "seeds"):  # shared contents: how many times runs took each
            self.db.add_column(f"{self.ns}_{table}", "uses", "BIGINT NOT NULL DEFAULT 0")

    def _check_schema(self) -> None:
        signed = {f"{self.ns}_{t}" for t in MAC_TABLES}
        missing: list[str] = []
        for table in tables(self.ns):
            have = self.db.columns(table)
            if not have:
                missing.append(table)
            elif table in signed and "mac" not in have:
                missing.append(f"{table}.mac")
        if missing:
            raise exc.RunStoreCorrupt(
                f"run store {self._where} lacks {', '.join(missing)} (made by an earlier stockade, or "
                "damaged); opened read-only, so nothing was added: a writer (a run, a resume) adds "
                "what an earlier stockade did not make"
            )

    # The workspace caps are the workspace history's: set here, they apply to the runs it
    # starts tracking from then on, as they did when they were the store's own.
    @property
    def max_workspace_bytes(self) -> int:
        return self._workspaces.max_bytes

    @max_workspace_bytes.setter
    def max_workspace_bytes(self, value: int) -> None:
        self._workspaces.max_bytes = value

    @property
    def max_workspace_entries(self) -> int:
        return self._workspaces.max_entries

    @max_workspace_entries.setter
    def max_workspace_entries(self, value: int) -> None:
        self._workspaces.max_entries = value

    @property
    def max_run_bytes(self) -> int:
        """What one run's workspace versions may add to the store, all together (compressed)."""
        return self._workspaces.max_run_bytes

    @max_run_bytes.setter
    def max_run_bytes(self, value: int) -> None:
        self._workspaces.max_run_bytes = value

    # -- Checkpointer ---------------------------------------------------------------------

    def save(self, state: RunState) -> None:
        """Append a checkpoint, and the messages and steps added since the last one."""
        _check_run_id(state.run_id)
        self._checkpoints.save(state)

    def load(self, run_id: str) -> RunState | None:
        """The latest checkpoint, with the tool calls that returned after it folded in."""
        _check_run_id(run_id)
        return self._checkpoints.load(run_id)

    def glimpse(self, run_id: str, steps: Collection[int]) -> RunState | None:
        """The latest checkpoint holding only the steps numbered ``steps`` and the one in
        progress (the run viewer's window: read at the cost of those steps alone)."""
        _check_run_id(run_id)
        return self._checkpoints.glimpse(run_id, steps)

    def diff(self, run_id: str) -> str | None:
        """The run's final diff (None before it ended)."""
        _check_run_id(run_id)
        return self._diff(run_id)

    # -- what the recorder writes ------------------------------------------------------------

    def record_tool_call(self, run_id: str, step: int, record: ToolCallRecord) -> None:
        """Write one returned call to the ledger now (idempotent: a key is written once)."""
        _check_run_id(run_id)
        self._checkpoints.record_tool_call(run_id, step, record)

    # -- durability: leases, calls started, workspaces -------------------------------------------

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
        _check_run_id(run_id)
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
        _check_run_id(run_id)
        return live_expiry(self.db, self.ns, run_id, time.time_ns()) is not None

    def renew_lease(self, run_id: str, owner: str, ttl_s: float) -> bool:
        """Push the lease's end ``ttl_s`` ahead; False when it is no longer ``owner``'s."""
        _check_run_id(run_id)
        return self._leases.renew(run_id, owner, ttl_s)

    def release_lease(self, run_id: str, owner: str) -> None:
        _check_run_id(run_id)
        self._leases.release(run_id, owner)

    def forget_lease(self, run_id: str, owner: str) -> None:
        # the workspace's tracker stays: a resume here may find nothing to restore
        _check_run_id(run_id)
        self._leases.forget(run_id, owner)

    def sweep(self) -> list[str]:
        """Mark ``interrupted`` the runs still ``running`` whose lease expired or whose process
        is gone; returns their ids (``runs`` and ``summary`` sweep first)."""
        return self._leases.sweep()

    def call_started(self, run_id: str, step: int, call: ToolCall, key: str, *, idempotent: bool) -> None:
        """Record that ``call`` is about to run (again: its attempts are counted)."""
        _check_run_id(run_id)
        self._ledger.call_started(run_id, step, call, key, idempotent=idempotent)

    def call_parked(self, run_id: str, key: str) -> None:
        """The call stopped at an approval before its effect: forget that it started, so a
        resume runs it again (its attempts start over)."""
        _check_run_id(run_id)
        self._ledger.call_parked(run_id, key)

    def attempts(self, run_id: str) -> dict[str, int]:
        """How many times each call of the run started: idempotency key -> attempts."""
        _check_run_id(run_id)
        return self._ledger.attempts(run_id)

    def record_workspace(
        self, run_id: str, sandbox: Sandbox, *, call: tuple[int, ToolCallRecord] | None = None
    ) -> int:
        """Record what changed in the workspace since the last record, and with it, in the same
        transaction, the call (step, record) that changed it; returns the workspace's version."""
        _check_run_id(run_id)
        return self._workspaces.record(run_id, sandbox, call=call)

    def restore_workspace(self, run_id: str, sandbox: Sandbox) -> bool:
        """Make the workspace of ``sandbox`` the run's last recorded one (whatever it held);
        ``False`` when none was recorded (the sandbox is left as it is)."""
        _check_run_id(run_id)
        return self._workspaces.restore(run_id, sandbox)

    def export_workspace(self, run_id: str, dest: str | Path) -> int:
        """Write the run's last recorded workspace into ``dest``, a new folder on the host (for
        review: a run an anomaly rule killed keeps it here); returns the files written.
        ``ConfigurationError`` when ``dest`` exists or the run recorded no workspace."""
        _check_run_id(run_id)
        return self._workspaces.export(run_id, dest)

    def workspace_unnamed(self, run_id: str) -> list[str]:
        """What ``export_workspace`` leaves out: the paths whose names are not UTF-8."""
        _check_run_id(run_id)
        return self._workspaces.unnamed(run_id)

    def workspace_usage(self, run_id: str) -> WorkspaceUsage:
        _check_run_id(run_id)
        return self._workspaces.usage(run_id)

    def save_seed(
        self, run_id: str, workspace: str | Path, *, hide: Sequence[str] = (), read: Sequence[str] = ("**",)
    ) -> str:
        """Keep the folder ``workspace`` (what ``read`` names, but stockade's own records and
        what ``hide`` names: as the run's sandbox was given it) as the run's starting
        workspace; returns its digest.

        ``SeedTooLarge`` past ``max_seed_bytes``. A run keeps its first seed (a resumed run
        does not replace where it started)."""
        _check_run_id(run_id)
        return self._workspaces.save_seed(
            run_id, workspace, max_bytes=self.max_seed_bytes, hide=hide, read=read
        )

    def restore_seed(self, run_id: str, dest: str | Path) -> bool:
        """Unpack the run's starting workspace into ``dest``; ``False`` when none was kept."""
        _check_run_id(run_id)
        return self._workspaces.restore_seed(run_id, dest)

    def record_setup(self, run_id: str, setup: RunSetup) -> None:
        """Keep what the run ran under (its policy, role, tier, budgets, acceptance check); a
        resumed run keeps its first."""
        _check_run_id(run_id)
        now = time.time_ns()
        row = (
            run_id,
            setup.policy.model_dump_json(),
            setup.role,
            setup.tier,
            setup.policy_file,
            setup.policy_digest,
            now,
        )
        first = "ON CONFLICT (run_id) DO NOTHING"
        writes: list[Statement] = [(insert(self.ns, "setups", first), [self.mac.signed("setups", row)])]
        if setup.limits is not None:
            body = json.dumps(dataclasses.asdict(setup.limits), sort_keys=True)
            writes.append(
                (insert(self.ns, "run_limits", first), [self.mac.signed("run_limits", (run_id, body, now))])
            )
        # kept even when it had none: a run kept without this row says nothing of its check
        check = json.dumps({"command": setup.check, "timeout_s": setup.check_timeout_s}, sort_keys=True)
        writes.append(
            (insert(self.ns, "run_checks", first), [self.mac.signed("run_checks", (run_id, check, now))])
        )
        self.db.write(writes)

    def setup(self, run_id: str) -> RunSetup | None:
        """What the run ran under; ``None`` for a run recorded without it (by a bare ``Agent``,
        or by a stockade that did not keep it)."""
        _check_run_id(run_id)
        rows = self.db.query(f"{select(self.ns, 'setups')} WHERE run_id = ?", (run_id,))
        self.mac.check(self.ns, "setups", rows, store=self._where)
        if not rows:
            return None
        _, policy, role, tier, policy_file, policy_digest, _, _ = rows[0]
        check, check_timeout_s, check_kept = self._check(run_id)
        try:
            kept = Policy.model_validate_json(str(policy))
        except ValueError as error:
            raise exc.RunStoreCorrupt(
                f"{self.ns}_setups row {run_id!r}: its policy does not parse: {error}"
            ) from None
        return RunSetup(
            policy=kept,
            role=None if role is None else str(role),
            tier=None if tier is None else str(tier),
            policy_file=None if policy_file is None else str(policy_file),
            policy_digest=None if policy_digest is None else str(policy_digest),
            limits=self._limits(run_id),
            check=check,
            check_timeout_s=check_timeout_s,
            check_kept=check_kept,
        )

    def _limits(self, run_id: str) -> RunLimits | None:
        """The run's budgets as it recorded them (``RunSetup.limits``); None for a run kept
        without them."""
        from stockade.agent.limits import RunLimits

        rows = self.db.query(f"{select(self.ns, 'run_limits')} WHERE run_id = ?", (run_id,))
        self.mac.check(self.ns, "run_limits", rows, store=self._where)
        if not rows:
            return None
        try:
            kept = json.loads(str(rows[0][1]))
            if not isinstance(kept, dict):
                raise TypeError("not an object")
            return RunLimits(**kept)
        except (ValueError, TypeError, exc.ConfigurationError) as error:
            raise exc.RunStoreCorrupt(f"{self.ns}_run_limits row {run_id!r}: {error}") from None

    def _check(self, run_id: str) -> tuple[str | None, float | None, bool]:
        """The run's acceptance check, its timeout, and whether they were kept (False: a run
        kept without them)."""
        rows = self.db.query(f"{select(self.ns, 'run_checks')} WHERE run_id = ?", (run_id,))
        self.mac.check(self.ns, "run_checks", rows, store=self._where)
        if not rows:
            return None, None, False
        try:
            kept = json.loads(str(rows[0][1]))
            command, timeout = kept["command"], kept["timeout_s"]
            if not (command is None or isinstance(command, str)) or not (
                timeout is None or (isinstance(timeout, (int, float)) and not isinstance(timeout, bool))
            ):
                raise TypeError("not a command and a timeout")
        except (ValueError, TypeError, KeyError) as error:
            raise exc.RunStoreCorrupt(f"{self.ns}_run_checks row {run_id!r}: {error}") from None
        return command, None if timeout is None else float(timeout), True

    # -- erasure ------------------------------------------------------------------------------

    def tag_subject(self, run_id: str, subject: str) -> None:
        """Record that the run holds personal data of ``subject`` (erase it with ``runs_of``)."""
        _check_run_id(run_id)
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

    # -- what the recorder writes between checkpoints -------------------------------------------

    def record_retry(self, run_id: str, entry: RetryEntry) -> None:
        _check_run_id(run_id)
        row = (
            run_id, entry.step, entry.call_id, entry.subject, entry.attempt, entry.delay_s,
            self.redactor.text(entry.reason),  # an error may quote a credential
            entry.recorded_ns,
        )  # fmt: skip
        self._insert_signed("retries", row)

    def record_approval(self, run_id: str, entry: ApprovalEntry) -> None:
        _check_run_id(run_id)
        row = (
            run_id, entry.step, entry.request_id,
            self.redactor.text(entry.action),  # a command may carry a token
            entry.rule, self.redactor.text(entry.reason), entry.decision, entry.recorded_ns,
        )  # fmt: skip
        self._insert_signed("approvals", row)

    def _insert_signed(self, table: str, row: tuple[object, ...]) -> None:
        self.db.write([(insert(self.ns, table), [self.mac.signed(table, row)])])

    def record_diff(self, run_id: str, diff: str) -> None:
        """The workspace diff at the end of the run, signed (the latest end wins; a run that
        ended is never resumed, so its diff stays). The run's row no longer holds one: unsigned,
        it could be edited into a diff that hides a change (found from outside)."""
        _check_run_id(run_id)
        row = self.mac.signed("run_diffs", (run_id, self.redactor.text(diff), time.time_ns()))
        self._leases.write(
            run_id,
            [
                (
                    insert(
                        self.ns,
                        "run_diffs",
                        "ON CONFLICT (run_id) DO UPDATE SET diff = excluded.diff, "
                        "recorded_ns = excluded.recorded_ns, mac = excluded.mac",
                    ),
                    [row],
                ),
                (f"UPDATE {self.ns}_runs SET diff = NULL WHERE run_id = ?", [(run_id,)]),
            ],
        )

    # -- reading ------------------------------------------------------------------------------

    def _stale(self) -> frozenset[str]:
        """The runs whose process died, still ``running`` in the rows: none once swept; opened
        read-only, they are shown ``interrupted`` as a sweep would mark them, and left as they are."""
        if self.db.read_only:
            return frozenset(self._leases.stale())
        self.sweep()
        return frozenset()

    def runs(self, *, limit: int = 50, status: RunStatus | None = None) -> list[RunSummary]:
        """The most recently updated runs first (runs whose process died: ``interrupted``)."""
        stale = self._stale()
        where, params = ("WHERE status = ?", [status.value]) if status is not None else ("", [])
        if stale and status in (RunStatus.RUNNING, RunStatus.INTERRUPTED):
            listed = f"run_id IN ({', '.join('?' * len(stale))})"
            where += f" AND NOT {listed}" if status is RunStatus.RUNNING else f" OR {listed}"
            params += sorted(stale)
        rows = self.db.query(
            f"{select(self.ns, 'runs')} {where} ORDER BY updated_ns DESC LIMIT ?", [*params, limit]
        )
        return [self._summary(row, stale) for row in rows]

    def summary(self, run_id: str) -> RunSummary | None:
        """The run's row (``RunStoreCorrupt`` where it was edited: a resume, the service and the
        viewer act on its status)."""
        _check_run_id(run_id)
        stale = self._stale()
        rows = self.db.query(f"{select(self.ns, 'runs')} WHERE run_id = ?", (run_id,))
        self.mac.check(self.ns, "runs", rows, store=self._where)
        return _swept(summary_from_row(rows[0][:-1]), stale) if rows else None

    def _summary(self, row: tuple[object, ...], stale: frozenset[str]) -> RunSummary:
        """A row read with its MAC as the summary it is (``forged``: the MAC does not match)."""
        forged = self.mac.unauthentic(self.ns, "runs", row) is not None
        return _swept(dataclasses.replace(summary_from_row(row[:-1]), forged=forged), stale)

    def find(self, prefix: str) -> list[str]:
        """Run ids starting with ``prefix``, in its case (the CLI's show, workspace and replay
        accept a unique prefix; ``runs erase`` takes whole ids). An empty prefix names no run:
        it was every run. ``substr`` and not ``LIKE``: SQLite's ``LIKE`` ignores case, so
        ``PROD`` found ``prod-Main`` there and not on PostgreSQL."""
        if not isinstance(prefix, str):  # an int was an AttributeError
            check_text(prefix, argument="prefix", fix="give the start of a run id")
        try:
            prefix.encode("utf-8")
        except UnicodeEncodeError:  # a byte no UTF-8 holds (``$'\xff'``): no run id starts so
            return []
        if not prefix:
            return []
        rows = self.db.query(  # both count characters (code points), as len() does
            f"SELECT run_id FROM {self.ns}_runs WHERE substr(run_id, 1, ?) = ? ORDER BY run_id LIMIT 10",
            (len(prefix), prefix),
        )
        return [str(r[0]) for r in rows]

    def erased_runs(self, run_ids: Collection[str]) -> set[str]:
        """Those of ``run_ids`` this store erased (their ids stay taken)."""
        return self._among("erased", run_ids)

    def _among(self, table: str, run_ids: Collection[str]) -> set[str]:
        """Those of ``run_ids`` with a row in this store's ``table``, asked 500 at a time."""
        runs = [_check_run_id(run_id) for run_id in check_strings(run_ids, argument="run_ids")]
        found: set[str] = set()
        for at in range(0, len(runs), 500):
            part = runs[at : at + 500]
            marks = ",".join("?" * len(part))
            sql = f"SELECT run_id FROM {self.ns}_{table} WHERE run_id IN ({marks})"
            found.update(str(r) for (r,) in self.db.query(sql, part))
        return found

    def tool_calls(
        self, run_id: str, *, step: int | None = None, keys: Collection[str] | None = None
    ) -> list[ToolCallRecord]:
        """The ledger of ``run_id`` (in the order the calls returned); ``keys``: only the
        calls of these idempotency keys."""
        _check_run_id(run_id)
        return self._ledger.tool_calls(run_id, step=step, keys=keys)

    def ledger_calls(self, run_id: str | None = None) -> list[LedgerCall]:
        """The ledger as ``audit verify`` cross-checks it: every call but the denied ones."""
        if run_id is not None:
            _check_run_id(run_id)
        return self._ledger.ledger_calls(run_id)

    def forged_rows(self, run_id: str | None = None) -> list[ForgedRow]:
        """The rows a resume would act on whose MAC is missing or wrong (none without the key),
        as ``audit verify`` reports them."""
        if run_id is not None:
            _check_run_id(run_id)
        return [
            ForgedRow(row.run_id, str(row)) for row in unauthentic_rows(self.db, self.ns, self.mac, run_id)
        ]

    def calls_in_flight(self, run_id: str | None = None) -> list[LedgerCall]:
        """The calls a dead process was running (started, never returned, of a run neither
        ended, nor live, nor stopped by its process), as ``audit verify`` reports them."""
        if run_id is not None:
            _check_run_id(run_id)
        return self._ledger.calls_in_flight(run_id)

    def live_runs(self, run_ids: Collection[str]) -> set[str]:
        """Those of ``run_ids`` a live process holds now, by a lease the store signed (when it
        has the key): ``audit verify`` reports no call of theirs in flight."""
        run_ids = [_check_run_id(run_id) for run_id in check_strings(run_ids, argument="run_ids")]
        return self._leases.live(run_ids)

    def stored_runs(self, run_ids: Collection[str]) -> set[str]:
        """Those of ``run_ids`` this store has a run row of (``audit verify``: a run its trail
        says a store recorded, gone with no erasure recorded, was deleted behind its back)."""
        return self._among("runs", run_ids)

    def retries(self, run_id: str) -> list[RetryEntry]:
        _check_run_id(run_id)
        rows = self.db.query(f"{select(self.ns, 'retries')} WHERE run_id = ? ORDER BY id", (run_id,))
        self.mac.check(self.ns, "retries", rows, store=self._where)
        return [
            RetryEntry(
                step=as_int(r[1]),
                call_id=None if r[2] is None else str(r[2]),
                subject=str(r[3]),
                attempt=as_int(r[4]),
                delay_s=as_float(r[5]),
                reason=str(r[6]),
                recorded_ns=as_int(r[7]),
            )
            for r in rows
        ]

    def approvals(self, run_id: str) -> list[ApprovalEntry]:
        _check_run_id(run_id)
        rows = self.db.query(f"{select(self.ns, 'approvals')} WHERE run_id = ? ORDER BY id", (run_id,))
        self.mac.check(self.ns, "approvals", rows, store=self._where)
        return [
            ApprovalEntry(
                step=as_int(r[1]),
                request_id=str(r[2]),
                action=str(r[3]),
                rule=str(r[4]),
                reason=str(r[5]),
                decision=str(r[6]),
                recorded_ns=as_int(r[7]),
            )
            for r in rows
        ]

    def trace(self, run_id: str) -> RunTrace | None:
        _check_run_id(run_id)
        summary = self.summary(run_id)
        state = self.load(run_id) if summary is not None else None
        if summary is None or state is None:
            return None
        return RunTrace(
            summary=summary,
            state=state,
            retries=tuple(self.retries(run_id)),
            approvals=tuple(self.approvals(run_id)),
            diff=self._diff(run_id),
        )

    def _diff(self, run_id: str) -> str | None:
        """The run's diff: its signed row (``RunStoreCorrupt`` where it was edited), or, for a
        run an earlier stockade recorded, the run row's."""
        rows = self.db.query(f"{select(self.ns, 'run_diffs')} WHERE run_id = ?", (run_id,))
        self.mac.check(self.ns, "run_diffs", rows, store=self._where)
        if rows:
            return str(rows[0][1])
        rows = self.db.query(f"SELECT diff FROM {self.ns}_runs WHERE run_id = ?", (run_id,))
        return None if not rows or rows[0][0] is None else str(rows[0][0])

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check_run_id(run_id: object) -> str:
    """A run id a store can be asked about: text that encodes as UTF-8. An int past 2**63 (an
    OverflowError out of SQLite), a lone surrogate (a UnicodeEncodeError), None or a number
    (looked up as they were, never found) are refused by name instead."""
    if isinstance(run_id, str):
        try:
            run_id.encode()
        except UnicodeEncodeError:
            pass
        else:
            return run_id
    return check_id(run_id, argument="run_id")  # raises: says what is wrong with it


def _swept(summary: RunSummary, stale: frozenset[str]) -> RunSummary:
    if summary.run_id not in stale or summary.status is not RunStatus.RUNNING:
        return summary
    return dataclasses.replace(summary, status=RunStatus.INTERRUPTED, error=STALE_WHY)


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
