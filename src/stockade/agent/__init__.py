"""The steppable agent loop. See ``loop`` for the nodes and the extension points
(observers, guards, tool wrappers, model wrappers, checkpointers), and ``assembly`` for
``build_agent``: a guarded, limited, audited agent from a policy file in one call."""

from typing import TYPE_CHECKING, Any

from stockade.agent.checkpoint import (
    Checkpointer,
    DurableCheckpointer,
    JsonFileCheckpointer,
    MemoryCheckpointer,
)
from stockade.agent.events import (
    AgentEvent,
    CheckFinished,
    ModelDenied,
    ModelRequested,
    ModelResponded,
    Observer,
    RunFinished,
    RunResumed,
    RunStarted,
    StepFinished,
    ToolCalled,
    ToolDenied,
    ToolRejected,
    ToolReturned,
)
from stockade.agent.loop import (
    DEFAULT_SYSTEM_PROMPT,
    Agent,
    AgentRun,
    CallToolsNode,
    CheckNode,
    End,
    Guard,
    GuardContext,
    ModelRequestNode,
    Node,
    RunLimits,
    RunResult,
)
from stockade.agent.state import CheckRecord, NodeKind, RunState, RunStatus, StepRecord, ToolCallRecord

if TYPE_CHECKING:
    from stockade.agent.assembly import AgentConfig, AgentSession, GuardedAgent, build_agent

# The assembly imports the policy, runtime and audit layers, which import this package's
# loop: it loads on first use, so that importing any of them first cannot form a cycle.
_ASSEMBLY = ("AgentConfig", "AgentSession", "GuardedAgent", "build_agent")


def __getattr__(name: str) -> Any:
    if name in _ASSEMBLY:
        from stockade.agent import assembly

        return getattr(assembly, name)
    raise AttributeError(f"module 'stockade.agent' has no attribute {name!r}")


__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "Agent",
    "AgentConfig",
    "AgentEvent",
    "AgentRun",
    "AgentSession",
    "CallToolsNode",
    "CheckFinished",
    "CheckNode",
    "CheckRecord",
    "Checkpointer",
    "DurableCheckpointer",
    "End",
    "Guard",
    "GuardContext",
    "GuardedAgent",
    "JsonFileCheckpointer",
    "MemoryCheckpointer",
    "ModelDenied",
    "ModelRequestNode",
    "ModelRequested",
    "ModelResponded",
    "Node",
    "NodeKind",
    "Observer",
    "RunFinished",
    "RunLimits",
    "RunResult",
    "RunResumed",
    "RunStarted",
    "RunState",
    "RunStatus",
    "StepFinished",
    "StepRecord",
    "ToolCallRecord",
    "ToolCalled",
    "ToolDenied",
    "ToolRejected",
    "ToolReturned",
    "build_agent",
]
