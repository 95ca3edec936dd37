"""Models for tests and demos: ``ScriptedModel`` replays turns, ``FunctionModel`` calls a function.

    model = ScriptedModel([
        tool_call("run_tests", {"command": "python3 -m pytest -q"}),
        [tool_call("read_file", {"path": "a.py"}), tool_call("read_file", {"path": "b.py"})],
        "Fixed: the median of an even list averages the two middle values.",
    ])

A turn is a tool call, a list of tool calls, a final answer (a string) or a full
``ModelResponse``. The turn to play is chosen from the conversation (the number of
assistant turns so far), not from a counter, so a run resumed in another process with a
fresh ``ScriptedModel`` continues where it stopped.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

from pydantic import JsonValue, TypeAdapter

from stockade._config_file import read_config_bytes
from stockade.exceptions import ConfigurationError
from stockade.models.base import Model, estimate_usage
from stockade.models.messages import AssistantMessage, ModelRequest, ModelResponse, ToolCall

__all__ = ["FunctionModel", "ScriptedModel", "Turn", "estimate_usage", "tool_call"]

Turn = str | ToolCall | Sequence[ToolCall] | ModelResponse


def tool_call(name: str, args: Mapping[str, JsonValue] | None = None, *, id: str = "") -> ToolCall:
    return ToolCall(id=id, name=name, args=dict(args or {}))


def _as_response(turn: Turn, index: int) -> ModelResponse:
    if isinstance(turn, ModelResponse):
        return turn
    if isinstance(turn, str):
        return ModelResponse(text=turn, finish_reason="stop")
    calls = (turn,) if isinstance(turn, ToolCall) else tuple(turn)
    numbered = tuple(
        c if c.id else c.model_copy(update={"id": f"call_{index}_{k}"}) for k, c in enumerate(calls)
    )
    return ModelResponse(tool_calls=numbered, finish_reason="tool_calls")


_FILE_TURNS: TypeAdapter[list[str | ToolCall | list[ToolCall] | ModelResponse]] = TypeAdapter(
    list[str | ToolCall | list[ToolCall] | ModelResponse]
)


class ScriptedModel(Model):
    provider = "scripted"
    """Replays ``turns`` in order; records every request it was sent in ``requests``."""

    def __init__(self, turns: Sequence[Turn], *, name: str = "scripted") -> None:
        self.responses = tuple(_as_response(turn, i) for i, turn in enumerate(turns))
        self.name = name
        self.requests: list[ModelRequest] = []

    @classmethod
    def from_file(cls, path: str | Path) -> ScriptedModel:
        """A JSON list of turns: ``"answer"``, ``{"name": ..., "args": {...}}``, a list of those,
        or ``{"text": ..., "tool_calls": [...]}``."""
        data = read_config_bytes(path, what="the scripted turns file")
        try:
            turns = _FILE_TURNS.validate_json(data)
        except ValueError as err:
            raise ConfigurationError(f"{path} is not a list of scripted turns: {err}") from None
        return cls(turns, name=f"scripted:{Path(path).name}")

    async def request(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        index = sum(1 for m in request.messages if isinstance(m, AssistantMessage))
        if index >= len(self.responses):
            raise ConfigurationError(
                f"ScriptedModel has {len(self.responses)} turns and was asked for turn {index + 1}"
            )
        response = self.responses[index]
        if response.usage.requests == 0:
            response = response.model_copy(update={"usage": estimate_usage(request, response)})
        return response.model_copy(update={"model_name": self.name})


ModelFunction = Callable[[ModelRequest], ModelResponse | Awaitable[ModelResponse]]


class FunctionModel(Model):
    """Answers with ``function(request)`` (sync or async): a model written as a test double."""

    def __init__(self, function: ModelFunction, *, name: str = "function") -> None:
        self.function = function
        self.name = name

    async def request(self, request: ModelRequest) -> ModelResponse:
        result = self.function(request)
        response = await result if inspect.isawaitable(result) else result
        assert isinstance(response, ModelResponse)
        if response.usage.requests == 0:
            response = response.model_copy(update={"usage": estimate_usage(request, response)})
        return response
