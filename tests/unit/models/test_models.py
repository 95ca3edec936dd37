"""Model resolution, the scripted doubles, prices and the mapping of provider errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stockade.exceptions import (
    ConfigurationError,
    ModelAuthError,
    ModelRateLimited,
    ModelRequestRejected,
    ModelUnavailable,
)
from stockade.models import (
    FunctionModel,
    ModelRequest,
    ModelResponse,
    ScriptedModel,
    ToolCall,
    Usage,
    UserMessage,
    cost_usd,
    resolve_model,
    tool_call,
)
from stockade.models._errors import from_status, parse_retry_after

REQUEST = ModelRequest(system="be brief", messages=(UserMessage(content="hi"),))


async def test_a_scripted_model_replays_its_turns() -> None:
    model = ScriptedModel([tool_call("list_files"), "bye"])
    first = await model.request(REQUEST)
    assert first.tool_calls == (ToolCall(id="call_0_0", name="list_files"),)
    assert first.usage.requests == 1 and first.usage.input_tokens > 0
    assert model.requests == [REQUEST]


def test_turns_load_from_a_json_file(tmp_path: Path) -> None:
    path = tmp_path / "turns.json"
    path.write_text(json.dumps([{"name": "read_file", "args": {"path": "a.py"}}, "fixed"]))
    model = resolve_model(f"scripted:{path}")
    assert isinstance(model, ScriptedModel)
    assert model.responses[0].tool_calls[0].args == {"path": "a.py"}
    assert model.responses[1].text == "fixed"


def test_a_bad_turns_file_is_a_configuration_error(tmp_path: Path) -> None:
    path = tmp_path / "turns.json"
    path.write_text('{"not": "a list"}')
    with pytest.raises(ConfigurationError, match="is not a list of scripted turns"):
        ScriptedModel.from_file(path)


async def test_a_function_model_may_be_async() -> None:
    async def answer(request: ModelRequest) -> ModelResponse:
        return ModelResponse(text=request.system, usage=Usage(requests=1))

    assert (await FunctionModel(answer).request(REQUEST)).text == "be brief"


def test_names_resolve_with_hints() -> None:
    with pytest.raises(ConfigurationError, match="use PROVIDER:NAME"):
        resolve_model("gpt-4.1")
    with pytest.raises(ConfigurationError, match=r"unknown model provider 'nope'.*OPENAI_BASE_URL"):
        resolve_model("nope:x")


def test_a_missing_api_key_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("anthropic")
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="set ANTHROPIC_API_KEY"):
        resolve_model("anthropic:claude-sonnet-4-5")


def test_a_missing_sdk_names_the_extra_to_install() -> None:
    script = (
        "import sys; sys.modules['openai'] = None\n"
        "from stockade.models import resolve_model\n"
        "try:\n    resolve_model('openai:gpt-4.1')\n"
        "except Exception as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.startswith("ConfigurationError") and "pip install 'stockade[openai]'" in out


def test_importing_stockade_does_not_import_any_sdk() -> None:
    script = (
        "import stockade, stockade.agent, stockade.tools, stockade.models, sys\n"
        "print('openai' in sys.modules, 'anthropic' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False False"


@pytest.mark.parametrize(
    ("status", "kind", "retryable"),
    [
        (429, ModelRateLimited, True),
        (500, ModelUnavailable, True),
        (503, ModelUnavailable, True),
        (529, ModelUnavailable, True),
        (400, ModelRequestRejected, False),
        (404, ModelRequestRejected, False),
        (401, ModelAuthError, False),
        (403, ModelAuthError, False),
    ],
)
def test_http_statuses_map_to_the_error_tree(status: int, kind: type, retryable: bool) -> None:
    error = from_status("openai", status, "nope", {})
    assert type(error) is kind and error.retryable is retryable and error.status_code == status


def test_retry_after_is_read_in_seconds_milliseconds_or_as_a_date() -> None:
    assert parse_retry_after({"Retry-After": "7"}) == 7.0
    assert parse_retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert parse_retry_after({"Retry-After": "Wed, 21 Oct 2015 07:28:10 GMT"}, now=1445412480.0) == 10.0
    assert parse_retry_after({}) is None


def test_costs_use_the_longest_listed_prefix_and_unknown_models_are_free() -> None:
    usage = Usage(input_tokens=1_000_000, output_tokens=1_000_000)
    assert cost_usd("gpt-4.1-mini-2025-04-14", usage) == pytest.approx(2.0)
    assert cost_usd("llama3", usage) == 0.0
