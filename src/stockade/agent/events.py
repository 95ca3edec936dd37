"""What the loop reports, one frozen value per moment of a run.

Observers are plain callables ``observer(event) -> None`` passed to ``Agent(observers=...)``;
the audit trail, logs, traces and the CLI's progress display subscribe this way, without
touching the loop. An observer may stop the run by raising ``RunStopped`` (status from the
exception: ``BudgetExceeded`` -> "budget", ``RunKilled`` -> "killed") or ``PolicyDenied``
(status "denied"); any other exception ends the run with status "error". Observers are
called one at a time: ``RunResumed`` and ``RunStarted`` from a worker thread (a run store
keeps a copy of the starting workspace then, with the event loop free), the others on the
loop's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stockade.agent.state import CheckRecord, RunState, StepRecord, ToolCallRecord
from stockade.models.messages import ModelRequest, ModelResponse, ToolCall

if TYPE_CHECKING:
    from stockade.agent.nodes import RunResult
    from stockade.tools.base import Tool

__all__ = [
    "AgentEvent",
    "CheckFinished",
    "ModelDenied",
    "ModelRequested",
    "ModelResponded",
    "Observer",
    "RunFinished",
    "RunResumed",
    "RunStarted",
    "StepFinished",
    "ToolCalled",
    "ToolDenied",
    "ToolRejected",
    "ToolReturned",
]


@dataclass(frozen=True, kw_only=True)
class RunStarted:
    run_id: str
    task: str
    model_name: str
    resumed: bool


@dataclass(frozen=True, kw_only=True)
class RunResumed:
    """A run continues from its checkpoint (just before ``RunStarted(resumed=True)``).

    ``recovered``: its last process died while running it (no pause, no interruption) and
    this one took it over. ``state`` is what the run continues from: every step and call it
    has recorded, calls whose outcome is unknown included (``error_type`` "OutcomeUnknown"),
    so that a record kept elsewhere (the audit trail) can be reconciled with it."""

    run_id: str
    previous_status: str
    recovered: bool
    workspace_restored: bool
    state: RunState


@dataclass(frozen=True, kw_only=True)
class ModelRequested:
    run_id: str
    step: int
    request: ModelRequest


@dataclass(frozen=True, kw_only=True)
class ModelResponded:
    run_id: str
    step: int
    response: ModelResponse
    duration_s: float


@dataclass(frozen=True, kw_only=True)
class ModelDenied:
    """The policy refused the model request (e.g. a model outside the registry served it);
    the run ends as "denied" right after this event."""

    run_id: str
    step: int
    model_name: str
    reason: str
    rule: str


@dataclass(frozen=True, kw_only=True)
class ToolCalled:
    """The guards allowed ``call`` (possibly rewritten); ``tool`` runs next."""

    run_id: str
    step: int
    call: ToolCall
    tool: Tool
    idempotency_key: str


@dataclass(frozen=True, kw_only=True)
class ToolDenied:
    run_id: str
    step: int
    call: ToolCall
    reason: str
    rule: str


@dataclass(frozen=True, kw_only=True)
class ToolReturned:
    run_id: str
    step: int
    record: ToolCallRecord
    value: object  # what the tool returned (e.g. a TestReport), before rendering


@dataclass(frozen=True, kw_only=True)
class ToolRejected:
    """The model's call named no tool, or its arguments failed the tool's schema: nothing ran,
    and the model is told why (``record.observation``)."""

    run_id: str
    step: int
    record: ToolCallRecord


@dataclass(frozen=True, kw_only=True)
class CheckFinished:
    """The acceptance check ran after the model said it was done; ``report`` is the runner's
    (a ``TestReport``)."""

    run_id: str
    record: CheckRecord
    report: object


@dataclass(frozen=True, kw_only=True)
class StepFinished:
    run_id: str
    step: StepRecord


@dataclass(frozen=True, kw_only=True)
class RunFinished:
    run_id: str
    result: RunResult


AgentEvent = (
    RunStarted
    | RunResumed
    | ModelRequested
    | ModelResponded
    | ModelDenied
    | ToolCalled
    | ToolDenied
    | ToolRejected
    | ToolReturned
    | CheckFinished
    | StepFinished
    | RunFinished
)
Observer = Callable[[AgentEvent], None]
