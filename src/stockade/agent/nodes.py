"""What stepping a run gives back: one frozen value per node that ran, ``End`` last with
the ``RunResult``.

Apart from the loop that makes them: observers (``RunFinished``) and the service's sessions
read results without driving a run.
"""

from __future__ import annotations

from dataclasses import dataclass

from stockade.agent.state import CheckRecord, RunState, RunStatus, StepRecord, ToolCallRecord
from stockade.models.messages import ModelResponse, Usage

__all__ = ["CallToolsNode", "CheckNode", "End", "ModelRequestNode", "Node", "RunResult"]


@dataclass(frozen=True, kw_only=True)
class RunResult:
    run_id: str
    status: RunStatus
    answer: str
    steps: tuple[StepRecord, ...]
    usage: Usage
    cost_usd: float
    diff: str
    audit_id: str | None
    error: str | None
    state: RunState
    tier: str | None = None  # the isolation tier the run's sandbox used

    @property
    def ok(self) -> bool:
        return self.status == RunStatus.SUCCESS

    @property
    def check(self) -> CheckRecord | None:
        """The last run of the acceptance check, if there was one."""
        return self.state.checks[-1] if self.state.checks else None


@dataclass(frozen=True, kw_only=True)
class ModelRequestNode:
    step: int
    response: ModelResponse
    duration_s: float


@dataclass(frozen=True, kw_only=True)
class CallToolsNode:
    step: int
    records: tuple[ToolCallRecord, ...]


@dataclass(frozen=True, kw_only=True)
class CheckNode:
    record: CheckRecord


@dataclass(frozen=True, kw_only=True)
class End:
    result: RunResult


Node = ModelRequestNode | CallToolsNode | CheckNode | End
