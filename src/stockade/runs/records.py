"""What the run store gives back besides a run's state: a run's summary (one line of
``stockade runs list``), the retries and approvals around its steps, everything ``stockade
runs show`` prints, and what a run's workspace costs the store.

Apart from ``store.py``, which writes and reads them, because they are plain frozen values
that the CLI, the viewer and the recorder use without a database.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stockade.agent.state import RunState, RunStatus
from stockade.models.messages import Usage
from stockade.policy.schema import Policy

if TYPE_CHECKING:
    from stockade.agent.limits import RunLimits

__all__ = ["ApprovalEntry", "RetryEntry", "RunSetup", "RunSummary", "RunTrace", "WorkspaceUsage"]


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
    # the row does not match its MAC (edited outside stockade: `audit verify` names it), so
    # none of the above can be believed; only a store opened with the audit key can tell
    forged: bool = False


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
class RunSetup:
    """What a run ran under, kept with it so that ``stockade replay`` runs it again under the
    same: the policy (the caller's trust merged in), the role and the tier, its budgets and its
    acceptance check; and the policy file it was read from with that file's SHA-256 then, so
    that a replay can say it changed since.
    A policy holds no secret (a credential is named by its source), so it is kept unredacted:
    a redacted rule would be another rule."""

    policy: Policy
    role: str | None
    tier: str | None  # None: not known (a run kept without it): chosen by trust
    policy_file: str | None = None
    policy_digest: str | None = None
    # its budgets (steps, wall time, tokens, dollars...): a replay may take no more; None for
    # a run kept without them
    limits: RunLimits | None = None
    # its acceptance check (``AgentConfig.check``) and that check's timeout: a replay runs it too
    check: str | None = None
    check_timeout_s: float | None = None
    # False: a run kept without them (by a stockade that did not keep its check): whether it
    # had one is not known (``replay.check_unkept`` says what a replay does then)
    check_kept: bool = True


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


@dataclass(frozen=True, kw_only=True)
class WorkspaceUsage:
    """What a run's workspace costs the store: versions recorded, rows, and the bytes of the
    contents it added (compressed; a content another run stored first is not counted)."""

    versions: int
    rows: int
    blob_bytes: int
