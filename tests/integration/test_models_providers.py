"""The real ``openai`` and ``anthropic`` clients against a local server speaking each protocol.

The server, started on 127.0.0.1 by the tests, answers each request with the next scripted
reply (status, headers, JSON body) and records what the client sent, so these tests check
the wire format both ways: tool definitions and results out, tool calls and usage in, and
errors (429 with Retry-After, 5xx, 401, 400) mapped to the error tree.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from stockade.exceptions import (
    ConfigurationError,
    ModelAuthError,
    ModelError,
    ModelRateLimited,
    ModelRequestRejected,
    ModelUnavailable,
)
from stockade.models import (
    AssistantMessage,
    ModelRequest,
    ToolCall,
    ToolDefinition,
    ToolResultMessage,
    UserMessage,
)
from tests.conftest import require

try:
    from stockade.models.anthropic_messages import AnthropicModel
    from stockade.models.openai_chat import OpenAIModel

    HAVE_SDKS = True
except ConfigurationError:  # an SDK is missing; the adapter says which extra to install
    HAVE_SDKS = False


@pytest.fixture(autouse=True)
def _sdks() -> None:
    require("the openai and anthropic SDKs", HAVE_SDKS, "pip install 'stockade[openai,anthropic]'")


@dataclass
class Reply:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class WireServer:
    url: str
    replies: list[Reply]
    received: list[tuple[str, dict[str, Any]]]


@pytest.fixture
def server() -> Iterator[WireServer]:
    state = WireServer(url="", replies=[], received=[])

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length", "0"))
            state.received.append((self.path, json.loads(self.rfile.read(length) or b"{}")))
            reply = state.replies.pop(0)
            data = json.dumps(reply.body).encode()
            self.send_response(reply.status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            for key, value in reply.headers.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield state
    httpd.shutdown()
    httpd.server_close()
    thread.join()


READ = ToolDefinition(
    name="read_file",
    description="Read a file.",
    parameters={"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
)
REQUEST = ModelRequest(
    system="be careful",
    messages=(
        UserMessage(content="fix it"),
        AssistantMessage(
            text="Reading.", tool_calls=(ToolCall(id="c1", name="read_file", args={"path": "a.py"}),)
        ),
        ToolResultMessage(call_id="c1", name="read_file", content="1  x = 1"),
    ),
    tools=(READ,),
)


def openai_completion(message: dict[str, Any], finish: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "gpt-4.1-2025-04-14",
        "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
        "usage": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150},
    }


def openai_error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "error", "code": None, "param": None}}


async def test_openai_tool_calls_and_usage_travel_both_ways(server: WireServer) -> None:
    server.replies.append(
        Reply(
            200,
            openai_completion(
                {
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "read_file", "arguments": '{"path": "b.py"}'},
                        },
                        {
                            "id": "call_10",
                            "type": "function",
                            "function": {"name": "read_file", "arguments": "{oops"},
                        },
                    ],
                },
                "tool_calls",
            ),
        )
    )
    model = OpenAIModel("gpt-4.1", base_url=server.url + "/v1", api_key="test-key")
    response = await model.request(REQUEST)

    assert response.tool_calls[0] == ToolCall(id="call_9", name="read_file", args={"path": "b.py"})
    assert (
        response.tool_calls[1].malformed is not None and "not valid JSON" in response.tool_calls[1].malformed
    )
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.requests) == (
        120,
        30,
        1,
    )
    assert response.model_name == "gpt-4.1-2025-04-14" and response.finish_reason == "tool_calls"

    path, body = server.received[0]
    assert path == "/v1/chat/completions" and body["model"] == "gpt-4.1"
    assert body["messages"] == [
        {"role": "system", "content": "be careful"},
        {"role": "user", "content": "fix it"},
        {
            "role": "assistant",
            "content": "Reading.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1  x = 1"},
    ]
    assert body["tools"] == [{"type": "function", "function": READ.model_dump()}]


async def test_openai_final_answer(server: WireServer) -> None:
    server.replies.append(Reply(200, openai_completion({"content": "All fixed."}, "stop")))
    response = await OpenAIModel("gpt-4.1", base_url=server.url + "/v1", api_key="k").request(REQUEST)
    assert response.text == "All fixed." and response.tool_calls == ()


@pytest.mark.parametrize(
    ("status", "headers", "kind", "retry_after"),
    [
        (429, {"retry-after": "3"}, ModelRateLimited, 3.0),
        (503, {}, ModelUnavailable, None),
        (401, {}, ModelAuthError, None),
        (400, {}, ModelRequestRejected, None),
    ],
)
async def test_openai_errors_map_to_the_error_tree(
    server: WireServer,
    status: int,
    headers: dict[str, str],
    kind: type[ModelError],
    retry_after: float | None,
) -> None:
    server.replies.append(Reply(status, openai_error("nope"), headers))
    model = OpenAIModel("gpt-4.1", base_url=server.url + "/v1", api_key="k")
    with pytest.raises(kind) as caught:
        await model.request(REQUEST)
    assert caught.value.status_code == status and caught.value.retry_after == retry_after
    assert len(server.received) == 1  # the SDK's own retries are off: retrying is the wrapper's job


async def test_an_unreachable_server_is_transient() -> None:
    model = OpenAIModel("gpt-4.1", base_url="http://127.0.0.1:9/v1", api_key="k", timeout_s=2)
    with pytest.raises(ModelUnavailable) as caught:
        await model.request(REQUEST)
    assert caught.value.retryable


def anthropic_message(content: list[dict[str, Any]], stop: str) -> dict[str, Any]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5-20250929",
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {"input_tokens": 200, "output_tokens": 40},
    }


async def test_anthropic_tool_use_and_usage_travel_both_ways(server: WireServer) -> None:
    server.replies.append(
        Reply(
            200,
            anthropic_message(
                [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "b.py"}},
                ],
                "tool_use",
            ),
        )
    )
    model = AnthropicModel("claude-test", base_url=server.url, api_key="test-key", max_tokens=1000)
    response = await model.request(REQUEST)

    assert response.text == "Let me look."
    assert response.tool_calls == (ToolCall(id="toolu_1", name="read_file", args={"path": "b.py"}),)
    assert (response.usage.input_tokens, response.usage.output_tokens) == (200, 40)
    assert response.finish_reason == "tool_use"

    path, body = server.received[0]
    assert path == "/v1/messages" and body["system"] == "be careful" and body["max_tokens"] == 1000
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "fix it"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "c1", "name": "read_file", "input": {"path": "a.py"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "c1", "content": "1  x = 1", "is_error": False},
            ],
        },
    ]
    assert body["tools"] == [
        {"name": "read_file", "description": "Read a file.", "input_schema": READ.parameters}
    ]


@pytest.mark.parametrize(
    ("status", "headers", "kind", "retry_after"),
    [
        (429, {"retry-after": "12"}, ModelRateLimited, 12.0),
        (529, {}, ModelUnavailable, None),
        (403, {}, ModelAuthError, None),
        (400, {}, ModelRequestRejected, None),
    ],
)
async def test_anthropic_errors_map_to_the_error_tree(
    server: WireServer,
    status: int,
    headers: dict[str, str],
    kind: type[ModelError],
    retry_after: float | None,
) -> None:
    body = {"type": "error", "error": {"type": "some_error", "message": "nope"}}
    server.replies.append(Reply(status, body, headers))
    model = AnthropicModel("claude-test", base_url=server.url, api_key="k")
    with pytest.raises(kind) as caught:
        await model.request(REQUEST)
    assert caught.value.status_code == status and caught.value.retry_after == retry_after
    assert len(server.received) == 1
