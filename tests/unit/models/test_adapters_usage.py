"""The provider adapters count what a response cost from the usage it reports: missing usage
by the estimate (a provider that leaves it out is not free), anything but a count refused.
Each adapter runs over its real SDK, answered by an in-process HTTP transport."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("httpx2")

import httpx2  # noqa: E402

from stockade.exceptions import ModelResponseInvalid  # noqa: E402
from stockade.models import ModelRequest, ModelResponse, Usage, UserMessage  # noqa: E402
from stockade.models.anthropic_messages import AnthropicModel  # noqa: E402
from stockade.models.openai_chat import OpenAIModel  # noqa: E402

REQUEST = ModelRequest(system="be brief", messages=(UserMessage(content="hi"),))


def _served(body: dict[str, object]) -> httpx2.AsyncClient:
    """An HTTP client whose every request is answered with ``body`` (a provider's JSON)."""
    return httpx2.AsyncClient(transport=httpx2.MockTransport(lambda _: httpx2.Response(200, json=body)))


def _openai(usage: dict[str, object] | None) -> ModelResponse:
    body: dict[str, object] = {
        "id": "c", "object": "chat.completion", "created": 0, "model": "gpt-4.1",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    }  # fmt: skip
    if usage is not None:
        body["usage"] = usage
    client = openai.AsyncOpenAI(api_key="k", base_url="http://provider.test/v1", http_client=_served(body))
    return asyncio.run(OpenAIModel("gpt-4.1", client=client).request(REQUEST))


def _anthropic(usage: dict[str, object] | None) -> ModelResponse:
    body: dict[str, object] = {
        "id": "m", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
        "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
    }  # fmt: skip
    if usage is not None:
        body["usage"] = usage
    client = anthropic.AsyncAnthropic(api_key="k", base_url="http://provider.test", http_client=_served(body))
    return asyncio.run(AnthropicModel("claude-sonnet-4-5", client=client).request(REQUEST))


@pytest.mark.parametrize(
    ("ask", "inputs", "outputs"),
    [(_openai, "prompt_tokens", "completion_tokens"), (_anthropic, "input_tokens", "output_tokens")],
    ids=["openai", "anthropic"],
)
def test_a_providers_usage_is_counted_estimated_when_missing_and_refused_when_negative(
    ask: Callable[[dict[str, object] | None], ModelResponse], inputs: str, outputs: str
) -> None:
    assert ask({inputs: 12, outputs: 3, "total_tokens": 15}).usage == Usage(
        input_tokens=12, output_tokens=3, requests=1
    )
    missing = ask(None).usage  # not free: counted by the estimate
    assert missing.requests == 1 and missing.input_tokens > 0 and missing.output_tokens > 0
    with pytest.raises(ModelResponseInvalid, match="not a count of tokens") as refused:
        ask({inputs: -30_000_000, outputs: 5, "total_tokens": 0})
    assert not refused.value.retryable
