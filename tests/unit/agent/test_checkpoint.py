"""Checkpoints after every step; a run resumes from them, in this process or another one."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stockade import Sandbox
from stockade.agent import (
    Agent,
    AgentEvent,
    Checkpointer,
    GuardContext,
    JsonFileCheckpointer,
    MemoryCheckpointer,
    RunState,
    RunStatus,
    ToolCalled,
)
from stockade.exceptions import ApprovalRequired, ConfigurationError
from stockade.models import ToolCall
from stockade.models.scripted import Turn
from stockade.testing import FakeBackend, ScriptedModel, tool_call
from stockade.tools import ToolContext, default_toolset, idempotency_key, tool

TURNS: list[Turn] = [
    tool_call("write_file", {"path": "notes.txt", "content": "one\n"}),
    tool_call("read_file", {"path": "notes.txt"}),
    "done",
]


def test_both_checkpointers_implement_the_protocol(tmp_path: Path) -> None:
    assert isinstance(MemoryCheckpointer(), Checkpointer)
    assert isinstance(JsonFileCheckpointer(tmp_path), Checkpointer)


async def test_the_state_is_checkpointed_after_every_node() -> None:
    saved = MemoryCheckpointer()
    sbx = Sandbox.create(backend=FakeBackend())
    async with Agent(ScriptedModel(TURNS), checkpointer=saved).iter("note", sandbox=sbx, run_id="r1") as run:
        async for _ in run:
            state = saved.load("r1")
            assert state is not None
            if run.state.status.finished and run.result is None:
                # The node that ended the run (the final answer) is not checkpointed as ended:
                # the checkpoint that says so is End's, after what it keeps (the diff, the
                # trail's last events); a crash before it resumes from the node before.
                assert state.status == RunStatus.RUNNING and len(state.steps) == len(run.state.steps) - 1
            else:
                assert state.model_dump() == run.state.model_dump()
    assert saved.load("r1").status == RunStatus.SUCCESS  # type: ignore[union-attr]


def test_a_run_stopped_after_two_nodes_resumes_in_another_process(tmp_path: Path) -> None:
    import asyncio

    checkpoints = JsonFileCheckpointer(tmp_path / "runs")
    sbx = Sandbox.create(backend=FakeBackend())

    async def first_two_nodes() -> None:
        async with Agent(ScriptedModel(TURNS), checkpointer=checkpoints).iter(
            "note", sandbox=sbx, run_id="run-42"
        ) as run:
            await run.next()  # the model asks to write
            await run.next()  # the write happens; then this process "crashes"

    asyncio.run(first_two_nodes())
    workspace = tmp_path / "workspace"
    sbx.files.download_dir(workspace)  # the workspace travels with the run

    script = textwrap.dedent(f"""
        import json
        from stockade import Sandbox
        from stockade.agent import Agent, JsonFileCheckpointer
        from stockade.testing import FakeBackend, ScriptedModel, tool_call
        turns = [tool_call("write_file", {{"path": "notes.txt", "content": "one\\n"}}),
                 tool_call("read_file", {{"path": "notes.txt"}}), "done"]
        agent = Agent(ScriptedModel(turns), checkpointer=JsonFileCheckpointer({str(tmp_path / "runs")!r}))
        with Sandbox.create(backend=FakeBackend(), workspace={str(workspace)!r}) as sbx:
            result = agent.run_sync(resume="run-42", sandbox=sbx)
        print(json.dumps({{"status": result.status.value, "steps": len(result.steps),
                          "read": result.steps[1].tool_calls[0].observation, "diff": result.diff}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert report["status"] == "success" and report["steps"] == 3
    assert report["read"] == "notes.txt: lines 1-1 of 1\n1  one"
    assert report["diff"] == "--- /dev/null\n+++ b/notes.txt\n@@ -0,0 +1 @@\n+one\n"


async def test_a_step_resumed_mid_way_does_not_repeat_calls_that_already_ran() -> None:
    ran: list[str] = []

    @tool
    def effect(ctx: ToolContext, name: str) -> str:
        """Do something visible once.

        Args:
            name: what to record.
        """
        ran.append(name)
        return f"did {name}"

    class Crash(Exception):
        pass

    def crash_on_second(event: AgentEvent) -> None:
        if isinstance(event, ToolCalled) and event.call.args == {"name": "b"}:
            raise Crash  # a bug, not a stop: it propagates and the last checkpoint stays

    turns: list[Turn] = [[tool_call("effect", {"name": "a"}), tool_call("effect", {"name": "b"})], "done"]
    tools = default_toolset().including(effect)
    saved = MemoryCheckpointer()
    sbx = Sandbox.create(backend=FakeBackend())
    crashing = Agent(ScriptedModel(turns), tools=tools, checkpointer=saved, observers=[crash_on_second])
    with pytest.raises(Crash):
        await crashing.run("effects", sandbox=sbx, run_id="r")
    assert ran == ["a"]

    result = await Agent(ScriptedModel(turns), tools=tools, checkpointer=saved).run(resume="r", sandbox=sbx)
    assert ran == ["a", "b"]
    assert result.status == RunStatus.SUCCESS
    assert [r.observation for r in result.steps[0].tool_calls] == ["did a", "did b"]
    assert [r.idempotency_key for r in result.steps[0].tool_calls] == [
        idempotency_key("r", 1, k, f"call_0_{k}") for k in (0, 1)
    ]


def test_an_approval_pauses_the_run_and_resuming_continues_it() -> None:
    approved: set[str] = set()

    def needs_approval(ctx: GuardContext, call: ToolCall) -> ToolCall:
        if call.name == "write_file" and ctx.run_id not in approved:
            raise ApprovalRequired("writing needs a human", rule="writes", request_id="req-1")
        return call

    saved = MemoryCheckpointer()
    sbx = Sandbox.create(backend=FakeBackend())
    agent = Agent(ScriptedModel(TURNS), guards=[needs_approval], checkpointer=saved)
    paused = agent.run_sync("note", sandbox=sbx, run_id="r")
    assert paused.status == RunStatus.PAUSED and not sbx.files.exists("notes.txt")

    approved.add("r")
    result = agent.run_sync(resume="r", sandbox=sbx)
    assert result.status == RunStatus.SUCCESS and sbx.files.read("notes.txt") == "one\n"
    assert len(result.steps) == 3


def test_the_state_round_trips_through_json() -> None:
    sbx = Sandbox.create(backend=FakeBackend())
    result = Agent(ScriptedModel(TURNS)).run_sync("note", sandbox=sbx)
    again = RunState.model_validate_json(result.state.model_dump_json())
    assert again == result.state


def test_resuming_an_unknown_run_says_so(tmp_path: Path) -> None:
    agent = Agent(ScriptedModel(TURNS), checkpointer=JsonFileCheckpointer(tmp_path))
    with pytest.raises(ConfigurationError, match="no checkpoint for run 'nope'"):
        agent.run_sync(resume="nope", sandbox=Sandbox.create(backend=FakeBackend()))
    with pytest.raises(ConfigurationError, match="cannot name a checkpoint file"):
        JsonFileCheckpointer(tmp_path).load("../etc/passwd")


class RecordingKeeper:
    """A ``SandboxKeeper`` that keeps nothing and says what it was asked."""

    def __init__(self, *, each_call: bool = False) -> None:
        self.each_call = each_call
        self.calls: list[str] = []

    def keep(self, run_id: str, sandbox: Sandbox) -> str | None:
        self.calls.append("keep")
        return f"snap-{len(self.calls)}"

    def release(self, run_id: str) -> None:
        self.calls.append("release")


def test_a_paused_run_keeps_its_sandbox_and_lets_it_go_when_it_resumes_and_ends() -> None:
    approved: set[str] = set()

    def needs_approval(ctx: GuardContext, call: ToolCall) -> ToolCall:
        if call.name == "read_file" and ctx.run_id not in approved:
            raise ApprovalRequired("reading needs a human", rule="reads", request_id="req-1")
        return call

    saved, keeper = MemoryCheckpointer(), RecordingKeeper()
    sbx = Sandbox.create(backend=FakeBackend())
    agent = Agent(ScriptedModel(TURNS), guards=[needs_approval], checkpointer=saved, keeper=keeper)
    paused = agent.run_sync("note", sandbox=sbx, run_id="r")
    assert paused.status == RunStatus.PAUSED and keeper.calls == ["keep"]
    assert saved.load("r").snapshot == "snap-1"  # type: ignore[union-attr]  # the checkpoint names it

    approved.add("r")
    result = agent.run_sync(resume="r", sandbox=sbx)
    assert result.status == RunStatus.SUCCESS and keeper.calls == ["keep", "release", "release"]
    assert saved.load("r").snapshot is None  # type: ignore[union-attr]


def test_a_run_that_asks_keeps_its_sandbox_after_every_call() -> None:
    keeper = RecordingKeeper(each_call=True)
    sbx = Sandbox.create(backend=FakeBackend())
    result = Agent(ScriptedModel(TURNS), checkpointer=MemoryCheckpointer(), keeper=keeper).run_sync(
        "note", sandbox=sbx, run_id="r"
    )
    assert result.status == RunStatus.SUCCESS and keeper.calls == ["keep", "keep", "release"]
    assert result.state.snapshot is None
