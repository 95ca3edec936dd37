"""The steppable agent loop. See ``loop`` for the nodes and the extension points
(observers, guards, tool wrappers, model wrappers, checkpointers)."""

from stockade.agent.checkpoint import Checkpointer, JsonFileCheckpointer, MemoryCheckpointer
from stockade.agent.events import (
    AgentEvent,
    ModelRequested,
    ModelResponded,
    Observer,
    RunFinished,
    RunStarted,
    StepFinished,
    ToolCalled,
    ToolDenied,
    ToolReturned,
)
from stockade.agent.loop import (
    DEFAULT_SYSTEM_PROMPT,
    Agent,
    AgentRun,
    CallToolsNode,
    End,
    Guard,
    GuardContext,
    ModelRequestNode,
    Node,
    RunLimits,
    RunResult,
)
from stockade.agent.state import NodeKind, RunState, RunStatus, StepRecord, ToolCallRecord

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "Agent",
    "AgentEvent",
    "AgentRun",
    "CallToolsNode",
    "Checkpointer",
    "End",
    "Guard",
    "GuardContext",
    "JsonFileCheckpointer",
    "MemoryCheckpointer",
    "ModelRequestNode",
    "ModelRequested",
    "ModelResponded",
    "Node",
    "NodeKind",
    "Observer",
    "RunFinished",
    "RunLimits",
    "RunResult",
    "RunStarted",
    "RunState",
    "RunStatus",
    "StepFinished",
    "StepRecord",
    "ToolCallRecord",
    "ToolCalled",
    "ToolDenied",
    "ToolReturned",
]
