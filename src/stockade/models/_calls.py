"""A provider's tool call as a ``ToolCall``, whatever it holds: never an exception.

Arguments that are not JSON, not a JSON object, or nested past what can be read (a recursion
limit: the JSON decoder's, pydantic's) make a call marked ``malformed``, without them: the loop
refuses it with an observation (``InvalidToolCall``), audits it and goes on. Raising here ended
the run from inside the adapter, untold to the model, and a resume replayed the same response.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from stockade.models.messages import ToolCall

__all__ = ["decoded_call", "tool_call_of"]


def decoded_call(call_id: str, name: str, arguments: str | None) -> ToolCall:
    """The call whose arguments came as a JSON text (OpenAI-style)."""
    try:
        args = json.loads(arguments or "{}")
    except RecursionError:
        return _malformed(call_id, name, "the arguments are nested too deeply to read")
    except ValueError as err:  # JSONDecodeError, and numbers past the digits Python reads
        return _malformed(call_id, name, f"the arguments are not valid JSON ({err})")
    return tool_call_of(call_id, name, args)


def tool_call_of(call_id: str, name: str, args: object) -> ToolCall:
    """The call whose arguments came decoded (Anthropic-style: ``input``)."""
    if not isinstance(args, dict):
        return _malformed(call_id, name, "the arguments must be a JSON object")
    try:
        return ToolCall(id=call_id, name=name, args=args)
    except (ValidationError, RecursionError):
        return _malformed(
            call_id, name, "the arguments are not JSON values, or are nested too deeply to read"
        )


def _malformed(call_id: str, name: str, why: str) -> ToolCall:
    return ToolCall(id=call_id, name=name, malformed=why)
