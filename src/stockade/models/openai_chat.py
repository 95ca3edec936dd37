"""OpenAI-compatible chat completions with tool calling, through the official ``openai`` SDK.

Works with OpenAI and with any server speaking the same protocol (vLLM, Ollama, llama.cpp
server, LM Studio) through ``base_url`` (or ``OPENAI_BASE_URL``). The SDK's own retries are
off: retrying is the job of a wrapper that sees the mapped ``ModelError`` and its
``retry_after``.
"""

from __future__ import annotations

import json
import os
from typing import Any

try:
    import openai
except ModuleNotFoundError as err:  # pragma: no cover - exercised by the import-blocking test
    from stockade.exceptions import ConfigurationError

    raise ConfigurationError(
        "the OpenAI adapter needs the openai SDK: pip install 'stockade[openai]'"
    ) from err

from stockade.models._calls import decoded_call
from stockade.models._errors import from_status, reported_usage, unavailable
from stockade.models.base import Model, counted_usage, require_api_key
from stockade.models.messages import (
    AssistantMessage,
    ModelRequest,
    ModelResponse,
    ToolResultMessage,
    UserMessage,
)

__all__ = ["OpenAIModel"]

_NO_KEY = "unused"  # what a local server without keys is sent: not a secret, never redacted


class OpenAIModel(Model):
    provider = "openai"
    """``OpenAIModel("gpt-4.1")``, or ``OpenAIModel("llama3", base_url="http://localhost:11434/v1")``."""

    def __init__(
        self,
        name: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_tokens: int | None = None,
        client: openai.AsyncOpenAI | None = None,
    ) -> None:
        self.name = name
        self.max_tokens = max_tokens
        if client is None:
            base_url = base_url or os.environ.get("OPENAI_BASE_URL")
            if api_key is None:
                # local OpenAI-compatible servers usually ignore the key; OpenAI itself needs one
                api_key = os.environ.get("OPENAI_API_KEY") or (
                    _NO_KEY if base_url else require_api_key("OPENAI_API_KEY", "openai")
                )
            client = openai.AsyncOpenAI(api_key=api_key, base_url=base_url, timeout=timeout_s, max_retries=0)
        self.client = client

    def credentials(self) -> tuple[str, ...]:
        key = self.client.api_key
        return (key,) if key and key != _NO_KEY else ()

    async def request(self, request: ModelRequest) -> ModelResponse:
        tools = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
            }
            for t in request.tools
        ]
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        if self.max_tokens is not None:
            extra["max_tokens"] = self.max_tokens
        try:
            completion = await self.client.chat.completions.create(
                model=self.name, messages=_messages(request), **extra
            )
        except openai.APIStatusError as err:
            raise from_status("openai", err.status_code, err.message, dict(err.response.headers)) from None
        except openai.APIConnectionError as err:
            raise unavailable("openai", err) from None
        except RecursionError:  # the SDK reading a body nested past Python's recursion limit
            raise from_status("openai", 502, "the response is nested too deeply to read", {}) from None
        if not completion.choices:
            raise from_status("openai", 502, "the response has no choices", {})
        choice = completion.choices[0]
        calls = tuple(
            decoded_call(c.id, c.function.name, c.function.arguments)
            for c in (choice.message.tool_calls or ())
            if c.type == "function"
        )
        usage = completion.usage
        response = ModelResponse(
            text=choice.message.content or "",
            tool_calls=calls,
            usage=reported_usage(
                "openai",
                usage.prompt_tokens if usage else None,
                usage.completion_tokens if usage else None,
            ),
            model_name=completion.model or self.name,
            finish_reason=choice.finish_reason or "",
        )
        return response.model_copy(update={"usage": counted_usage(request, response, provider="openai")})


# The wire format is validated by the SDK; its TypedDict unions add nothing here.
def _messages(request: ModelRequest) -> list[Any]:
    out: list[dict[str, Any]] = [{"role": "system", "content": request.system}] if request.system else []
    for message in request.messages:
        if isinstance(message, UserMessage):
            out.append({"role": "user", "content": message.content})
        elif isinstance(message, AssistantMessage):
            entry: dict[str, Any] = {"role": "assistant", "content": message.text or None}
            if message.tool_calls:
                entry["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": json.dumps(c.args)},
                    }
                    for c in message.tool_calls
                ]
            out.append(entry)
        elif isinstance(message, ToolResultMessage):
            out.append({"role": "tool", "tool_call_id": message.call_id, "content": message.content})
    return list(out)
