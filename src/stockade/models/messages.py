"""The conversation vocabulary shared by the loop, the tools and every model adapter.

Everything here is a frozen pydantic model, so a run's whole conversation serialises to JSON
(checkpoints, the run store, replay) and back without loss.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

__all__ = [
    "AssistantMessage",
    "Message",
    "ModelRequest",
    "ModelResponse",
    "ToolCall",
    "ToolDefinition",
    "ToolResultMessage",
    "Usage",
    "UserMessage",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ToolDefinition(_Frozen):
    """What a model is told about one tool: its name, purpose and JSON schema."""

    name: str
    description: str
    parameters: dict[str, JsonValue]


class ToolCall(_Frozen):
    """One structured tool call from the model.

    ``malformed`` is set by an adapter when the provider's arguments were not a JSON object;
    the loop then answers with a corrective observation instead of calling the tool.
    """

    id: str = ""  # the loop numbers calls that arrive without an id
    name: str
    args: dict[str, JsonValue] = Field(default_factory=dict)
    malformed: str | None = None


class Usage(_Frozen):
    input_tokens: int = 0
    output_tokens: int = 0
    requests: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            requests=self.requests + other.requests,
        )


class UserMessage(_Frozen):
    kind: Literal["user"] = "user"
    content: str


class AssistantMessage(_Frozen):
    kind: Literal["assistant"] = "assistant"
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


class ToolResultMessage(_Frozen):
    kind: Literal["tool"] = "tool"
    call_id: str
    name: str
    content: str
    is_error: bool = False


Message = Annotated[UserMessage | AssistantMessage | ToolResultMessage, Field(discriminator="kind")]


class ModelRequest(_Frozen):
    """Everything a model needs for one turn."""

    system: str
    messages: tuple[Message, ...]
    tools: tuple[ToolDefinition, ...] = ()


class ModelResponse(_Frozen):
    """One turn of the model: text, tool calls (possibly several), and what it cost.

    No tool calls means the model has finished and ``text`` is its final answer.
    """

    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Usage = Field(default_factory=Usage)
    model_name: str = ""
    finish_reason: str = ""
