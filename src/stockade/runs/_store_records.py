"""What a run records, one run at a time: its checkpoints and ledger (through ``Checkpoints``),
its workspaces and seeds (through ``WorkspaceHistory``), what it ran under (``RunSetup``), and
the rows the recorder writes between checkpoints (retries, approvals, the final diff), each
written signed and read back checked against its MAC.

A base of ``RunStore`` (``store``), above its parts (``_store_parts``): the readers
(``_store_reads``) build a run's trace from these records.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from stockade import exceptions as exc
from stockade.agent.state import RunState, ToolCallRecord
from stockade.policy.engine import PolicyEngine
from stockade.policy.schema import Policy
from stockade.runs._db import Statement
from stockade.runs._mac import insert, select
from stockade.runs._schema import as_float, as_int
from stockade.runs._store_parts import StoreParts, check_run_id
from stockade.runs.handback import Exported, SeedFiles
from stockade.runs.records import ApprovalEntry, RetryEntry, RunSetup, WorkspaceUsage
from stockade.sandbox.facade import Sandbox

if TYPE_CHECKING:
    from stockade.agent.limits import RunLimits

__all__ = ["RunRecords"]


class RunRecords(StoreParts):
    """A run's records, written and read back by run id (see ``RunStore``)."""

    # -- Checkpointer ---------------------------------------------------------------------

    def save(self, state: RunState) -> None:
        """Append a checkpoint, and the messages and steps added since the last one."""
        check_run_id(state.run_id)
        self._checkpoints.save(state)

    def load(self, run_id: str) -> RunState | None:
        """The latest checkpoint, with the tool calls that returned after it folded in."""
        check_run_id(run_id)
        return self._checkpoints.load(run_id)

    def glimpse(self, run_id: str, steps: Collection[int]) -> RunState | None:
        """The latest checkpoint holding only the steps numbered ``steps`` and the one in
        progress (the run viewer's window: read at the cost of those steps alone)."""
        check_run_id(run_id)
        return self._checkpoints.glimpse(run_id, steps)

    def diff(self, run_id: str) -> str | None:
        """The run's final diff (None before it ended)."""
        check_run_id(run_id)
        return self._diff(run_id)

    # -- what the recorder writes ------------------------------------------------------------

    def record_tool_call(self, run_id: str, step: int, record: ToolCallRecord) -> None:
        """Write one returned call to the ledger now (idempotent: a key is written once)."""
        check_run_id(run_id)
        self._checkpoints.record_tool_call(run_id, step, record)

    # -- workspaces and seeds --------------------------------------------------------------------

    def record_workspace(
        self, run_id: str, sandbox: Sandbox, *, call: tuple[int, ToolCallRecord] | None = None
    ) -> int:
        """Record what changed in the workspace since the last record, and with it, in the same
        transaction, the call (step, record) that changed it; returns the workspace's version."""
        check_run_id(run_id)
        return self._workspaces.record(run_id, sandbox, call=call)

    def restore_workspace(self, run_id: str, sandbox: Sandbox) -> bool:
        """Make the workspace of ``sandbox`` the run's last recorded one (whatever it held);
        ``False`` when none was recorded (the sandbox is left as it is)."""
        check_run_id(run_id)
        return self._workspaces.restore(run_id, sandbox)

    def export_workspace(self, run_id: str, dest: str | Path) -> Exported:
        """Write the run's last recorded workspace into ``dest``, a new folder on the host (for
        review: a run an anomaly rule killed keeps it here), but what a copy on the host leaves
        out (``runs.handback``: judged by the policy the run ran under, when it was kept);
        returns what was written and left out. ``ConfigurationError`` when ``dest`` exists or
        the run recorded no workspace."""
        check_run_id(run_id)
        return self._workspaces.export(run_id, dest, keep=self.hands_back(run_id))

    def hands_back(self, run_id: str) -> Callable[[str], bool] | None:
        """Which changed paths the policy the run ran under lets come back to the host (its
        ``hands_back``); None for a run kept without its policy (``setup``)."""
        setup = self.setup(run_id)
        return None if setup is None else PolicyEngine(setup.policy, role=setup.role).hands_back

    def seed_files(self, run_id: str) -> SeedFiles:
        """The files the run started with, and what their repositories' config names as commands."""
        check_run_id(run_id)
        return self._workspaces.seed_files(run_id)

    def workspace_unnamed(self, run_id: str) -> list[str]:
        """What ``export_workspace`` leaves out: the paths whose names are not UTF-8."""
        check_run_id(run_id)
        return self._workspaces.unnamed(run_id)

    def workspace_usage(self, run_id: str) -> WorkspaceUsage:
        check_run_id(run_id)
        return self._workspaces.usage(run_id)

    def save_seed(
        self, run_id: str, workspace: str | Path, *, hide: Sequence[str] = (), read: Sequence[str] = ("**",)
    ) -> str:
        """Keep the folder ``workspace`` (what ``read`` names, but stockade's own records and
        what ``hide`` names: as the run's sandbox was given it) as the run's starting
        workspace; returns its digest.

        ``SeedTooLarge`` past ``max_seed_bytes``. A run keeps its first seed (a resumed run
        does not replace where it started)."""
        check_run_id(run_id)
        return self._workspaces.save_seed(
            run_id, workspace, max_bytes=self.max_seed_bytes, hide=hide, read=read
        )

    def restore_seed(self, run_id: str, dest: str | Path) -> bool:
        """Unpack the run's starting workspace into ``dest``; ``False`` when none was kept."""
        check_run_id(run_id)
        return self._workspaces.restore_seed(run_id, dest)

    # -- what the run ran under ------------------------------------------------------------------

    def record_setup(self, run_id: str, setup: RunSetup) -> None:
        """Keep what the run ran under (its policy, role, tier, budgets, acceptance check); a
        resumed run keeps its first."""
        check_run_id(run_id)
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
        check_run_id(run_id)
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

    # -- what the recorder writes between checkpoints -------------------------------------------

    def record_retry(self, run_id: str, entry: RetryEntry) -> None:
        check_run_id(run_id)
        row = (
            run_id, entry.step, entry.call_id, entry.subject, entry.attempt, entry.delay_s,
            self.redactor.text(entry.reason),  # an error may quote a credential
            entry.recorded_ns,
        )  # fmt: skip
        self._insert_signed("retries", row)

    def record_approval(self, run_id: str, entry: ApprovalEntry) -> None:
        check_run_id(run_id)
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
        check_run_id(run_id)
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

    # -- reading back --------------------------------------------------------------------------

    def retries(self, run_id: str) -> list[RetryEntry]:
        check_run_id(run_id)
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
        check_run_id(run_id)
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

    def _diff(self, run_id: str) -> str | None:
        """The run's diff: its signed row (``RunStoreCorrupt`` where it was edited), or, for a
        run an earlier stockade recorded, the run row's."""
        rows = self.db.query(f"{select(self.ns, 'run_diffs')} WHERE run_id = ?", (run_id,))
        self.mac.check(self.ns, "run_diffs", rows, store=self._where)
        if rows:
            return str(rows[0][1])
        rows = self.db.query(f"SELECT diff FROM {self.ns}_runs WHERE run_id = ?", (run_id,))
        return None if not rows or rows[0][0] is None else str(rows[0][0])
