"""A recorded run replayed with its own model responses: the same observations, or the differences."""

from __future__ import annotations

from collections.abc import Iterator

from stockade import Sandbox
from stockade.agent import Agent
from stockade.agent.state import RunState
from stockade.assembly import build_agent
from stockade.models.scripted import Turn
from stockade.policy.schema import Policy, TrustRules
from stockade.runs import RunStore
from stockade.runs.records import RunSetup
from stockade.runs.replay import ReplayReport, normalise, recorded_model, replay, replay_config
from stockade.sandbox.ops import RunCommand
from stockade.testing import FakeBackend, MemoryWorkspace, ScriptedModel, tool_call
from stockade.tools import default_toolset, shell
from stockade.types import CommandResult, Trust

TURNS: list[Turn] = [
    tool_call("write_file", {"path": "a.txt", "content": "x\n"}),
    tool_call("shell", {"command": "pytest -q"}),
    "the tests pass",
]


def answering(*outputs: tuple[int, str]) -> FakeBackend:
    """A sandbox whose commands answer ``outputs`` in turn."""
    answers: Iterator[tuple[int, str]] = iter(outputs)

    def commands(op: RunCommand) -> CommandResult:
        code, stdout = next(answers)
        return CommandResult(exit_code=code, stdout=stdout, stderr="", duration_s=0.01)

    return FakeBackend(MemoryWorkspace(commands=commands), tier="process")


async def record(store: RunStore, backend: FakeBackend) -> None:
    agent = Agent(ScriptedModel(TURNS), tools=default_toolset().including(shell), checkpointer=store)
    with Sandbox.create(backend=backend) as sbx:
        assert (await agent.run("make the tests pass", sandbox=sbx, run_id="run-1")).ok


async def replayed(state: RunState, backend: FakeBackend) -> ReplayReport:
    """``state`` replayed under a trusted policy on ``backend``."""
    setup = RunSetup(policy=Policy(trust=TrustRules(level=Trust.TRUSTED)), role=None, tier="process")
    with build_agent(replay_config(state, setup, backend=backend)) as agent:
        return await replay(state, agent=agent)


async def test_the_same_environment_gives_the_same_observations(store: RunStore) -> None:
    await record(store, answering((0, "1 passed in 0.12s\n")))
    state = store.load("run-1")
    assert state is not None
    report = await replayed(state, answering((0, "1 passed in 0.31s\n")))
    assert report.ok, report.differences
    assert report.compared == 2 and report.replayed_status == report.recorded_status


async def test_a_flaky_test_shows_up_as_a_difference(store: RunStore) -> None:
    await record(store, answering((0, "1 passed in 0.12s\n")))
    state = store.load("run-1")
    assert state is not None
    report = await replayed(state, answering((1, "FAILED test_a.py::test_x - assert 0\n")))
    (difference,) = report.differences
    assert (difference.step, difference.tool, difference.what) == (2, "shell", "observation")
    assert difference.recorded.startswith("exit code 0") and difference.replayed.startswith("exit code 1")


async def test_the_recorded_model_plays_the_recorded_responses(store: RunStore) -> None:
    await record(store, answering((0, "ok\n")))
    state = store.load("run-1")
    assert state is not None
    model = recorded_model(state)
    assert [r.tool_calls[0].name if r.tool_calls else r.text for r in model.responses] == [
        "write_file",
        "shell",
        "the tests pass",
    ]


def test_timings_and_addresses_are_masked() -> None:
    assert normalise("3 passed in 0.12s, <object at 0x7f3a2b1c9d>") == (
        "3 passed in <duration>, <object at <address>>"
    )
