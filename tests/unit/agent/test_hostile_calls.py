"""Whatever a model sends as a tool call, the run goes on within its limits: a call no record
can hold or no tool can read is refused as ``InvalidToolCall`` (told to the model, audited),
every refusal and denial is bounded like an observation, and a call that ran is recorded even
when the workspace it left cannot be kept.

Found by a hostile scripted model: a lone surrogate or arguments nested 300 levels crashed the
run from inside the adapter (untold to the model, and a resume replayed the same response); a
3 MiB tool name was echoed whole to the model and stored ten times; a denial quoted a 200 KB
path whole; a call whose workspace the store could not keep vanished from every record.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from stockade import Sandbox
from stockade.agent import Agent, RunLimits, RunStatus
from stockade.agent.screen import MAX_CALL_ARGS_DEPTH, MAX_TOOL_NAME_CHARS
from stockade.audit import AuditLog, EventKind, verify
from stockade.audit.agent import TEXT_CAP, AuditObserver
from stockade.audit.stores import open_store
from stockade.models import FunctionModel, Model, ModelRequest, ModelResponse, ToolCall
from stockade.models.messages import AssistantMessage
from stockade.policy.agent import policy_guard
from stockade.policy.engine import PolicyEngine
from stockade.policy.schema import PathRules, Policy
from stockade.runs import RunRecorder, RunStore, open_run_store
from stockade.testing import FakeBackend, MemoryWorkspace, ScriptedModel, tool_call

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("httpx2")

import httpx2  # noqa: E402

from stockade.models.anthropic_messages import AnthropicModel  # noqa: E402
from stockade.models.openai_chat import OpenAIModel  # noqa: E402

SURROGATE = '{"path": "a.txt", "content": "x\\udcfe"}'  # valid JSON; no UTF-8 can hold it
NESTED_300 = '{"path": "a.txt", "content": ' + "[" * 300 + "]" * 300 + "}"  # past pydantic's 255
NESTED_100K = (
    '{"path": "a.txt", "content": ' + "[" * 100_000 + "]" * 100_000 + "}"
)  # json.loads: RecursionError


def _served(bodies: list[str]) -> httpx2.AsyncClient:
    """An HTTP client answering its n-th request with ``bodies[n]`` (a provider's raw JSON)."""
    answered: list[str] = []

    def answer(_: httpx2.Request) -> httpx2.Response:
        answered.append(bodies[len(answered)])
        return httpx2.Response(
            200, content=answered[-1].encode(), headers={"content-type": "application/json"}
        )

    return httpx2.AsyncClient(transport=httpx2.MockTransport(answer))


def openai_sending(arguments: str) -> Model:
    """The OpenAI adapter over its real SDK: one call to write_file with ``arguments`` (the raw
    JSON text of the wire), then a final answer."""
    call = {"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": arguments}}
    turns = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "assistant", "content": "gave up"},
    ]
    bodies = [
        json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "gpt-4.1",
                    "choices": [{"index": 0, "message": m, "finish_reason": "stop"}]})
        for m in turns
    ]  # fmt: skip
    client = openai.AsyncOpenAI(api_key="k", base_url="http://provider.test/v1", http_client=_served(bodies))
    return OpenAIModel("gpt-4.1", client=client)


def anthropic_sending(arguments: str) -> Model:
    """The Anthropic adapter over its real SDK: ``arguments`` as the ``input`` of a tool_use."""
    head = (
        '{"id": "m", "type": "message", "role": "assistant", "model": "claude", "stop_reason": "tool_use", '
    )
    use = (
        f'{head}"content": [{{"type": "tool_use", "id": "t1", "name": "write_file", "input": {arguments}}}]}}'
    )
    done = f'{head}"content": [{{"type": "text", "text": "gave up"}}]}}'
    client = anthropic.AsyncAnthropic(
        api_key="k", base_url="http://provider.test", http_client=_served([use, done])
    )
    return AnthropicModel("claude", client=client)


def scripted_sending(arguments: str) -> Model:
    """A model written as a function, handing the loop what no adapter would build (a call
    made without validation): the loop screens every model's calls alike."""
    args = json.loads(arguments)

    def answer(request: ModelRequest) -> ModelResponse:
        if any(isinstance(m, AssistantMessage) for m in request.messages):
            return ModelResponse(text="gave up")
        return ModelResponse(tool_calls=(ToolCall.model_construct(id="c1", name="write_file", args=args),))

    return FunctionModel(answer)


def _nested(depth: int) -> object:
    value: list[object] = []
    for _ in range(depth - 1):
        value = [value]
    return value


ADAPTERS = [openai_sending, anthropic_sending, scripted_sending]


@pytest.mark.parametrize("adapter", ADAPTERS, ids=["openai", "anthropic", "function"])
@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (SURROGATE, "hold text that is not Unicode (a lone surrogate"),
        (NESTED_300, "nested"),
        (
            '{"path": "a.txt", "content": ' + "[" * 70 + "]" * 70 + "}",
            f"more than {MAX_CALL_ARGS_DEPTH} levels",
        ),
    ],
    ids=["lone-surrogate", "nested-300", "nested-70"],
)
def test_arguments_no_record_can_hold_are_refused_and_the_run_goes_on(
    tmp_path: Path, adapter: Callable[[str], Model], arguments: str, said: str
) -> None:
    audit = AuditLog(open_store(f"sqlite:///{tmp_path / 'audit.db'}"), flush_interval_s=None)
    with (
        open_run_store(f"sqlite:///{tmp_path / 'runs.db'}") as store,
        Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sbx,
    ):
        agent = Agent(
            adapter(arguments), checkpointer=store, observers=[RunRecorder(store), AuditObserver(audit)]
        )
        result = agent.run_sync("write a.txt", sandbox=sbx, run_id="r")
        assert not sbx.files.exists("a.txt")
        assert store.load("r") is not None  # the checkpoint holds the refusal and reads back
    audit.close()
    refused = result.steps[0].tool_calls[0]
    assert result.status == RunStatus.SUCCESS and result.answer == "gave up"
    assert refused.error_type == "InvalidToolCall" and refused.call.args == {}
    assert (
        refused.observation.startswith("error: malformed call to write_file: ")
        and said in refused.observation
    )
    trail = open_store(f"sqlite:///{tmp_path / 'audit.db'}")
    calls = [e for e in trail.events(run_id="r") if e.kind == EventKind.TOOL_CALL]
    assert [c.attributes["error_type"] for c in calls] == ["InvalidToolCall"]
    assert verify(trail).ok
    trail.close()


def test_arguments_nested_past_the_interpreters_limit_are_refused_too() -> None:
    with Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sbx:
        result = Agent(openai_sending(NESTED_100K)).run_sync("write a.txt", sandbox=sbx)
    refused = result.steps[0].tool_calls[0]
    assert result.status == RunStatus.SUCCESS and refused.error_type == "InvalidToolCall"
    assert "nested" in refused.observation


def test_a_response_the_sdk_cannot_read_for_its_depth_is_a_typed_model_error() -> None:
    with Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sbx:
        result = Agent(anthropic_sending(NESTED_100K)).run_sync("write a.txt", sandbox=sbx)
    assert result.status == RunStatus.ERROR and "nested too deeply" in (result.error or "")


def test_a_tool_name_is_an_identifier_refused_past_its_length_and_quoted_cut(tmp_path: Path) -> None:
    name = "x" * (3 << 20)
    model = ScriptedModel([[tool_call(name, {}), tool_call("read\x00file\udcfe", {"path": "a"})], "done"])
    audit = AuditLog(open_store(f"sqlite:///{tmp_path / 'audit.db'}"), flush_interval_s=None)
    with (
        open_run_store(f"sqlite:///{tmp_path / 'runs.db'}") as store,
        Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sbx,
    ):
        agent = Agent(model, checkpointer=store, observers=[RunRecorder(store), AuditObserver(audit)])
        result = agent.run_sync("go", sandbox=sbx, run_id="r")
        ledger = store.tool_calls("r")
    audit.close()
    long, odd = result.steps[0].tool_calls
    assert result.status == RunStatus.SUCCESS
    assert long.error_type == odd.error_type == "InvalidToolCall"
    assert long.call.name == "x" * 64 + "…" and len(long.observation) < 400
    assert f"its tool name is {3 << 20:,} characters (sha256:" in long.observation
    assert f"(at most {MAX_TOOL_NAME_CHARS} printable characters); nothing was run" in long.observation
    assert odd.call.name == "read\\x00file\\udcfe" and odd.call.args == {}  # escaped, quotable
    sent = model.requests[-1]  # what the model was sent next: the refusals, not the name
    assert len(sent.model_dump_json()) < 20_000
    assert [r.call.name for r in ledger] == [long.call.name, odd.call.name]
    assert (tmp_path / "runs.db").stat().st_size < 1 << 20 and (
        tmp_path / "audit.db"
    ).stat().st_size < 1 << 20


def test_a_denial_quoting_a_long_path_is_bounded_everywhere(tmp_path: Path) -> None:
    path = "secrets/" + "B" * 200_000
    model = ScriptedModel([tool_call("write_file", {"path": path, "content": "x"}), "done"])
    audit = AuditLog(open_store(f"sqlite:///{tmp_path / 'audit.db'}"), flush_interval_s=None)
    engine = PolicyEngine(Policy(paths=PathRules(deny=("secrets/**",))))
    with Sandbox.create("process") as sbx:
        agent = Agent(
            model,
            guards=[policy_guard(engine)],
            observers=[AuditObserver(audit)],
            limits=RunLimits(max_observation_chars=12_000, max_denials=1),
        )
        result = agent.run_sync("go", sandbox=sbx, run_id="r")
    audit.close()
    denied = result.steps[0].tool_calls[0]
    assert denied.denied and denied.observation.startswith("denied by policy")
    assert len(denied.observation) < 12_200 and denied.cut_chars > 0
    assert result.status == RunStatus.DENIED and len(result.error or "") < 12_200
    trail = open_store(f"sqlite:///{tmp_path / 'audit.db'}")
    decisions = [e for e in trail.events(run_id="r") if e.kind == EventKind.POLICY_DECISION]
    ends = [e for e in trail.events(run_id="r") if e.kind == EventKind.RUN_END]
    trail.close()
    assert len(str(decisions[0].attributes["reason"])) <= TEXT_CAP + 100
    assert len(str(ends[0].attributes["error"])) <= TEXT_CAP + 100


def test_a_call_whose_workspace_cannot_be_kept_is_recorded_and_ends_the_run(tmp_path: Path) -> None:
    code = "import os\nfor i in range(40): open(f'f{i}', 'w').close()\nprint('made 40 files')"
    model = ScriptedModel([tool_call("run_code", {"language": "python", "code": code}), "done"])
    audit = AuditLog(open_store(f"sqlite:///{tmp_path / 'audit.db'}"), flush_interval_s=None)
    with (
        RunStore(open_run_store(f"sqlite:///{tmp_path / 'runs.db'}").db, max_workspace_entries=20) as store,
        Sandbox.create("process") as sbx,
    ):
        agent = Agent(model, checkpointer=store, observers=[RunRecorder(store), AuditObserver(audit)])
        result = agent.run_sync("make files", sandbox=sbx, run_id="r")
        ledger = store.tool_calls("r")
        assert sbx.files.exists("f39")  # it ran
    audit.close()
    (ran,) = [c for s in result.steps for c in s.tool_calls]
    assert result.status == RunStatus.ERROR
    assert (result.error or "").startswith(
        "run_code ran, and the workspace it left cannot be kept (SeedTooLarge"
    )
    assert "made 40 files" in ran.observation and "the run ends here" in ran.observation
    assert [r.idempotency_key for r in ledger] == [ran.idempotency_key]
    trail = open_store(f"sqlite:///{tmp_path / 'audit.db'}")
    calls = [e for e in trail.events(run_id="r") if e.kind == EventKind.TOOL_CALL]
    with open_run_store(f"sqlite:///{tmp_path / 'runs.db'}") as kept:
        report = verify(trail, run_id="r", ledger=kept)  # the trail and the ledger agree
    trail.close()
    assert [c.attributes["idempotency_key"] for c in calls] == [ran.idempotency_key]
    assert report.ok


def test_the_checkpoint_of_a_screened_response_reads_back() -> None:
    """Arguments 198 levels deep fit pydantic's validator (255) but not its JSON reader (200, with
    the checkpoint's own nesting): a run holding them could never be resumed."""
    model = ScriptedModel([tool_call("write_file", {"path": "a", "content": _nested(198)}), "done"])  # type: ignore[dict-item]
    with open_run_store("memory:") as store, Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sbx:
        asyncio.run(Agent(model, checkpointer=store).run("go", sandbox=sbx, run_id="r"))
        state = store.load("r")
    assert state is not None and state.steps[0].tool_calls[0].error_type == "InvalidToolCall"


@pytest.mark.parametrize("guarded", [True, False], ids=["policy", "no-policy"])
def test_a_diff_naming_no_file_is_refused_to_the_model_and_the_run_goes_on(guarded: bool) -> None:
    """ "/dev/null" over "/dev/null": the policy guard reads the diff's paths before the tool runs,
    and a bare AssertionError there ended the run ``interrupted``, the model told nothing."""
    diff = "--- /dev/null\n+++ /dev/null\n@@ -0,0 +1 @@\n+x\n"
    model = ScriptedModel([
        tool_call("apply_patch", {"diff": diff}),
        tool_call("write_file", {"path": "x.txt", "content": "x\n"}),
        "done",
    ])  # fmt: skip
    guards = [policy_guard(PolicyEngine(Policy()))] if guarded else []
    with Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sbx:
        result = Agent(model, guards=guards).run_sync("add x", sandbox=sbx)
        assert sbx.files.read("x.txt") == "x\n"  # the next step ran
    refused = result.steps[0].tool_calls[0]
    assert result.status == RunStatus.SUCCESS and result.answer == "done"
    assert refused.error_type == "PatchRejected" and not refused.denied
    assert "both /dev/null" in refused.observation
    assert "both /dev/null" in model.requests[1].model_dump_json()  # what the model was sent next
