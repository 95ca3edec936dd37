"""The steppable agent loop. See ``loop`` for the nodes and the extension points
(observers, guards, tool wrappers, model wrappers, checkpointers). ``stockade.assembly``,
above this package and the control layers it puts around the loop (policy, runtime, audit),
has ``build_agent``: a guarded, limited, audited agent from a policy file in one call."""

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
from stockade.agent.limits import RunLimits
from stockade.agent.loop import Agent
from stockade.agent.nodes import CallToolsNode, CheckNode, End, ModelRequestNode, Node, RunResult
from stockade.agent.run import AgentRun
from stockade.agent.settings import DEFAULT_SYSTEM_PROMPT, Guard, GuardContext
from stockade.agent.state import CheckRecord, NodeKind, RunState, RunStatus, StepRecord, ToolCallRecord

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "Agent",
    "AgentEvent",
    "AgentRun",
    "CallToolsNode",
    "CheckFinished",
    "CheckNode",
    "CheckRecord",
    "Checkpointer",
    "DurableCheckpointer",
    "End",
    "Guard",
    "GuardContext",
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
]
