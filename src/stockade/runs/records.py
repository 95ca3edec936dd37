"""What the run store gives back besides a run's state: a run's summary (one line of
``stockade runs list``), the retries and approvals around its steps, everything ``stockade
runs show`` prints, and what a run's workspace costs the store.

Apart from ``store.py``, which writes and reads them, because they are plain frozen values
that the CLI, the viewer and the recorder use without a database.
"""

from __future__ import annotations

from dataclasses import dataclass

from stockade.agent.state import RunState, RunStatus
from stockade.models.messages import Usage

__all__ = ["ApprovalEntry", "RetryEntry", "RunSummary", "RunTrace", "WorkspaceUsage"]


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


@dataclass(frozen=True, kw_only=True)
class WorkspaceUsage:
    """What a run's workspace costs the store: versions recorded, rows, and the bytes of the
    contents it added (compressed; a content another run stored first is not counted)."""

    versions: int
    rows: int
    blob_bytes: int
