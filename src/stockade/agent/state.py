"""The serialisable state of one agent run, and the records of what each step did.

``RunState`` is all a run needs to continue: a checkpoint is ``state.model_dump_json()`` and
resuming in another process is ``RunState.model_validate_json(...)`` plus a sandbox. Only
the loop mutates it.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from stockade.models.messages import Message, ModelResponse, ToolCall, Usage

__all__ = [
    "CheckRecord",
    "NodeKind",
    "RunState",
    "RunStatus",
    "StepRecord",
    "ToolCallRecord",
    "args_json",
    "args_measure",
]


def args_json(args: Mapping[str, JsonValue]) -> str:
    """A call's arguments as JSON, in one spelling (keys sorted): what their size and digest
    are of."""
    return json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def args_measure(args: Mapping[str, JsonValue]) -> tuple[int, str]:
    """The size in bytes of a call's arguments as JSON (``args_json``), and their SHA-256."""
    raw = args_json(args).encode()
    return len(raw), "sha256:" + hashlib.sha256(raw).hexdigest()


class RunStatus(enum.StrEnum):
    RUNNING = "running"
    SUCCESS = "success"  # the model gave its final answer (and the acceptance check, if any, passed)
    CHECK_FAILED = "check_failed"  # the model said it was done; the acceptance check said otherwise
    MAX_STEPS = "max_steps"
    BUDGET = "budget"  # wall time, tokens or dollars ran out
    KILLED = "killed"
    DENIED = "denied"  # the policy refused the run, or too many actions in a row
    ERROR = "error"  # the provider, the sandbox or too many malformed calls
    PAUSED = "paused"  # waiting for something outside (an approval); resume the run later
    INTERRUPTED = "interrupted"  # stopped from outside mid-step (Ctrl-C, SIGTERM); resume it later
    BROKEN = "broken"  # its actions failed too many times in a row; a person looks, then resumes it

    @property
    def finished(self) -> bool:
        return self not in (RunStatus.RUNNING, *_RESUMABLE)

    @property
    def resumable(self) -> bool:
        return self in _RESUMABLE


_RESUMABLE = (RunStatus.PAUSED, RunStatus.INTERRUPTED, RunStatus.BROKEN)


class NodeKind(enum.StrEnum):
    """Which node runs next: prompt -> model_request -> call_tools -> model_request ... -> end;
    with an acceptance check, a final answer goes to check, which ends the run or asks again."""

    MODEL_REQUEST = "model_request"
    CALL_TOOLS = "call_tools"
    CHECK = "check"
    END = "end"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ToolCallRecord(_Frozen):
    """One tool call and what came of it.

    ``idempotency_key`` (``tools.idempotency_key``: a digest of the run, the step, the call's
    place in its response and its id) names the side effect, so a run store can tell whether a
    call already ran before a crash. Records stored by earlier versions keep theirs
    (``run_id:step:call_id``).
    """

    call: ToolCall
    idempotency_key: str
    observation: str
    is_error: bool = False
    error_type: str | None = None
    denied: bool = False
    # the action failed: an error, a denial, or a result that says so (code that raised, a
    # command or a test run that failed); what the runtime controls count
    failed: bool = False
    duration_s: float = 0.0
    cut_chars: int = 0
    saved_to: str | None = None
    exit_code: int | None = None  # when the tool ran a process (shell, run_tests)


class CheckRecord(_Frozen):
    """One run of the acceptance check, after the model said it was done at ``step``."""

    command: str
    step: int
    passed: bool
    exit_code: int
    summary: str  # one line: the runner's counts, or the exit code
    observation: str  # what the model was told (bounded)
    duration_s: float = 0.0
    timed_out: bool = False


class StepRecord(_Frozen):
    index: int
    response: ModelResponse
    model_duration_s: float
    tool_calls: tuple[ToolCallRecord, ...] = ()


class RunState(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    run_id: str
    task: str
    system: str
    model_name: str
    status: RunStatus = RunStatus.RUNNING
    next: NodeKind = NodeKind.MODEL_REQUEST
    resume_at: NodeKind | None = None  # where a paused run continues
    messages: list[Message] = Field(default_factory=list)
    steps: list[StepRecord] = Field(default_factory=list)
    # the step in progress: the model's answer, and the tool calls already done
    current: StepRecord | None = None
    usage: Usage = Field(default_factory=Usage)
    cost_usd: float = 0.0
    elapsed_s: float = 0.0
    malformed_calls: int = 0
    consecutive_denials: int = 0
    checks: list[CheckRecord] = Field(default_factory=list)  # every run of the acceptance check
    answer: str = ""
    error: str | None = None
    audit_id: str | None = None  # set by the audit layer
    # the snapshot of the run's sandbox kept when it last paused (or after its last call, when
    # asked): a resume starts from it; None once the run resumed from it or ended
    snapshot: str | None = None
    # what identifies the workspace's diff baseline the run wrote (``sha256:HEX:SIZE``): the
    # file is in the workspace, where code may rewrite it; the diff refuses any other
    baseline: str | None = None
