"""Anthropic messages with tool use, through the official ``anthropic`` SDK.

Tool results travel as ``tool_result`` blocks in a user turn; consecutive messages of one
role are merged, as the API requires alternating roles. The SDK's own retries are off: a
wrapper retries on the mapped ``ModelError``.
"""

from __future__ import annotations

import os
from typing import Any

try:
    import anthropic
except ModuleNotFoundError as err:  # pragma: no cover - exercised by the import-blocking test
    from stockade.exceptions import ConfigurationError

    raise ConfigurationError(
        "the Anthropic adapter needs the anthropic SDK: pip install 'stockade[anthropic]'"
    ) from err

from stockade.models._calls import tool_call_of
from stockade.models._errors import from_status, reported_usage, unavailable
from stockade.models.base import Model, counted_usage, require_api_key
from stockade.models.messages import (
    AssistantMessage,
    ModelRequest,
    ModelResponse,
    ToolCall,
    ToolResultMessage,
    UserMessage,
)

__all__ = ["AnthropicModel"]


class AnthropicModel(Model):
    provider = "anthropic"
    """``AnthropicModel("claude-sonnet-4-5")``; the key comes from ``ANTHROPIC_API_KEY``."""

    def __init__(
        self,
        name: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_tokens: int = 4096,
        client: anthropic.AsyncAnthropic | None = None,
    ) -> None:
        self.name = name
        self.max_tokens = max_tokens
        if client is None:
            if api_key is None:
                api_key = require_api_key("ANTHROPIC_API_KEY", "anthropic")
            client = anthropic.AsyncAnthropic(
                api_key=api_key,
                base_url=base_url or os.environ.get("ANTHROPIC_BASE_URL"),
                timeout=timeout_s,
                max_retries=0,
            )
        self.client = client

    def credentials(self) -> tuple[str, ...]:
        return tuple(k for k in (self.client.api_key, self.client.auth_token) if k)

    async def request(self, request: ModelRequest) -> ModelResponse:
        tools = [
            {"name": t.name, "description": t.description, "input_schema": t.parameters}
            for t in request.tools
        ]
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        if request.system:
            extra["system"] = request.system
        try:
            message = await self.client.messages.create(
                model=self.name, max_tokens=self.max_tokens, messages=_messages(request), **extra
            )
        except anthropic.APIStatusError as err:
            raise from_status("anthropic", err.status_code, err.message, dict(err.response.headers)) from None
        except anthropic.APIConnectionError as err:
            raise unavailable("anthropic", err) from None
        except RecursionError:  # the SDK reading a body nested past Python's recursion limit
            raise from_status("anthropic", 502, "the response is nested too deeply to read", {}) from None
        texts: list[str] = []
        calls: list[ToolCall] = []
        for block in message.content:
            if block.type == "text":
                texts.append(block.text)
            elif block.type == "tool_use":
                calls.append(tool_call_of(block.id, block.name, block.input))
        usage = getattr(message, "usage", None)  # a compatible server may leave it out
        response = ModelResponse(
            text="".join(texts),
            tool_calls=tuple(calls),
            usage=reported_usage(
                "anthropic",
                getattr(usage, "input_tokens", None),
                getattr(usage, "output_tokens", None),
            ),
            model_name=message.model or self.name,
            finish_reason=message.stop_reason or "",
        )
        return response.model_copy(update={"usage": counted_usage(request, response, provider="anthropic")})


# The wire format is validated by the SDK; its TypedDict unions add nothing here.
def _messages(request: ModelRequest) -> list[Any]:
    out: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})

    for message in request.messages:
        if isinstance(message, UserMessage):
            add("user", [{"type": "text", "text": message.content}])
        elif isinstance(message, AssistantMessage):
            blocks: list[dict[str, Any]] = [{"type": "text", "text": message.text}] if message.text else []
            blocks += [
                {"type": "tool_use", "id": c.id, "name": c.name, "input": c.args} for c in message.tool_calls
            ]
            add("assistant", blocks)
        elif isinstance(message, ToolResultMessage):
            add(
                "user",
                [
                    {
                        "type": "tool_result",
                        "tool_use_id": message.call_id,
                        "content": message.content,
                        "is_error": message.is_error,
                    }
                ],
            )
    return list(out)
