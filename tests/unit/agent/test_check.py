"""The acceptance check: "success" means the check passed, not only that the model said it was done."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from stockade import Sandbox
from stockade.agent import (
    Agent,
    AgentEvent,
    CheckFinished,
    CheckNode,
    RunLimits,
    RunStatus,
    ToolRejected,
)
from stockade.assembly import AgentConfig, build_agent
from stockade.audit import AuditLog, MemoryStore
from stockade.exceptions import InvalidArgument
from stockade.models import ToolCall
from stockade.policy import Policy
from stockade.policy.schema import TrustRules
from stockade.sandbox.base import OpResult
from stockade.sandbox.ops import Op, RunCommand
from stockade.testing import FakeBackend, MemoryWorkspace, ScriptedModel, tool_call
from stockade.types import CommandResult, Trust

CHECK = "python3 -m unittest"
FAILING = """F
======================================================================
FAIL: test_add (test_calc.T.test_add)
----------------------------------------------------------------------
AssertionError: -1 != 3

----------------------------------------------------------------------
Ran 1 test in 0.001s

FAILED (failures=1)
"""
PASSING = (
    ".\n----------------------------------------------------------------------\nRan 1 test in 0.001s\n\nOK\n"
)


def workspace() -> MemoryWorkspace:
    """The check fails until calc.py returns a + b."""
    ws = MemoryWorkspace(files={"calc.py": b"def add(a, b):\n    return a - b\n"})

    def run(op: RunCommand) -> CommandResult:
        fixed = b"a + b" in ws.files.get("calc.py", b"")
        return CommandResult(
            exit_code=0 if fixed else 1, stdout="", stderr=PASSING if fixed else FAILING, duration_s=0.1
        )

    ws.commands = run
    return ws


FIXED = "def add(a, b):\n    return a + b\n"


def test_a_failing_check_sends_the_model_back_to_work_until_it_passes() -> None:
    events: list[AgentEvent] = []
    model = ScriptedModel(
        ["all green", tool_call("write_file", {"path": "calc.py", "content": FIXED}), "fixed for real"]
    )
    agent = Agent(model, check=CHECK, observers=[events.append])
    with Sandbox.create(backend=FakeBackend(workspace())) as sbx:
        result = agent.run_sync("make the tests pass", sandbox=sbx)
    assert result.status == RunStatus.SUCCESS and result.answer == "fixed for real"
    checks = [e.record for e in events if isinstance(e, CheckFinished)]
    assert [c.passed for c in checks] == [False, True]
    assert checks[0].summary == "unittest: 0 passed, 1 failed, 0 errors, 0 skipped (exit code 1)"
    told = model.requests[1].messages[-1].content  # type: ignore[union-attr]
    assert f"The acceptance check `{CHECK}` failed" in told and "AssertionError: -1 != 3" in told
    assert result.check is not None and result.check.passed


def test_a_check_that_never_passes_ends_the_run_with_its_own_status() -> None:
    agent = Agent(ScriptedModel(["done"] * 5), check=CHECK, limits=RunLimits(max_check_failures=2))
    with Sandbox.create(backend=FakeBackend(workspace())) as sbx:
        result = agent.run_sync("make the tests pass", sandbox=sbx)
    assert result.status == RunStatus.CHECK_FAILED and not result.ok
    assert result.error is not None and "failed 2 times" in result.error and "1 failed" in result.error
    assert len(result.state.checks) == 2


def test_running_out_of_steps_right_after_a_failed_check_is_check_failed() -> None:
    agent = Agent(ScriptedModel(["done", "done"]), check=CHECK, limits=RunLimits(max_steps=1))
    with Sandbox.create(backend=FakeBackend(workspace())) as sbx:
        result = agent.run_sync("make the tests pass", sandbox=sbx)
    assert result.status == RunStatus.CHECK_FAILED
    assert result.error is not None and "max_steps=1" in result.error and "acceptance check" in result.error


async def test_the_check_is_a_node_of_the_loop() -> None:
    agent = Agent(ScriptedModel(["done"]), check="true")
    with Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sbx:
        async with agent.iter("go", sandbox=sbx) as run:
            nodes = [type(node).__name__ async for node in run]
    assert nodes == ["ModelRequestNode", "CheckNode", "End"]
    assert CheckNode is not None and run.result is not None and run.result.ok


def test_without_a_check_the_final_answer_is_success_as_before() -> None:
    with Sandbox.create(backend=FakeBackend(workspace())) as sbx:
        assert Agent(ScriptedModel(["done"])).run_sync("go", sandbox=sbx).status == RunStatus.SUCCESS


def test_build_agent_passes_the_check_and_audits_it(tmp_path: object) -> None:
    log = AuditLog(MemoryStore(), flush_interval_s=None)
    config = AgentConfig(
        model=ScriptedModel(["all green", "still green"]),
        policy=Policy(trust=TrustRules(level=Trust.TRUSTED)),
        backend=FakeBackend(workspace(), tier="process"),
        audit=log,
        check=CHECK,
        limits=RunLimits(max_check_failures=2),
        approval_dir=f"{tmp_path}/approvals",
        kill_target=f"{tmp_path}/kill",
    )
    with build_agent(config) as agent:
        result = agent.run_sync("make the tests pass")
    assert result.status == RunStatus.CHECK_FAILED
    log.flush()
    checks = [e for e in log.store.events() if e.kind.value == "check"]
    assert [e.attributes["passed"] for e in checks] == [False, False]
    assert checks[0].attributes["command"] == CHECK
    ends = [e.attributes["status"] for e in log.store.events() if e.kind.value == "run_end"]
    assert ends == ["check_failed"]


@pytest.mark.parametrize("check", ["", "   ", 3, "true\x00base64 /etc/hostname"])
def test_an_empty_check_or_one_holding_a_nul_is_refused(check: object) -> None:
    with pytest.raises(InvalidArgument, match="check"):
        Agent(ScriptedModel(["done"]), check=check)  # type: ignore[arg-type]


def test_an_invalid_tool_call_is_an_event_observers_see() -> None:
    events: list[AgentEvent] = []
    bad = ToolCall(name="read_file", malformed="the arguments are not valid JSON")
    agent = Agent(ScriptedModel([bad, tool_call("nope"), "done"]), observers=[events.append])
    with Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sbx:
        assert agent.run_sync("go", sandbox=sbx).ok
    rejected = [e.record for e in events if isinstance(e, ToolRejected)]
    assert [r.call.name for r in rejected] == ["read_file", "nope"]
    assert (
        "not valid JSON" in rejected[0].observation and "there is no tool 'nope'" in rejected[1].observation
    )


def test_runs_show_lists_each_check(tmp_path: object) -> None:
    from typer.testing import CliRunner

    from stockade.cli.main import app
    from stockade.runs import RunRecorder, open_run_store

    db = f"sqlite:///{tmp_path}/audit.db"
    with open_run_store(db) as store:
        agent = Agent(
            ScriptedModel(["done"] * 3), check=CHECK, checkpointer=store, observers=[RunRecorder(store)]
        )
        with Sandbox.create(backend=FakeBackend(workspace())) as sbx:
            agent.run_sync("go", sandbox=sbx, run_id="checked")
    shown = CliRunner().invoke(app, ["runs", "show", "checked", "--db", db])
    assert "check after step 1: python3 -m unittest failed" in shown.output
    assert "check_failed" in shown.output


def audited(tmp_path: object, backend: FakeBackend, log: AuditLog) -> AgentConfig:
    return AgentConfig(
        model=ScriptedModel(["done"]),
        policy=Policy(trust=TrustRules(level=Trust.TRUSTED)),
        backend=backend,
        audit=log,
        check="python3 -m pytest -q",
        approval_dir=f"{tmp_path}/approvals",
        kill_target=f"{tmp_path}/kill",
    )


def run_ends(log: AuditLog) -> list[object]:
    log.flush()
    return [e.attributes["status"] for e in log.store.events() if e.kind.value == "run_end"]


def test_a_report_the_code_wrote_in_shift_jis_is_no_pass_and_the_run_still_ends(tmp_path: object) -> None:
    """A conftest.py's pytest_unconfigure rewrote the report declaring shift_jis: expat's
    ValueError escaped run_sync, and the trail ended at sandbox_stop with no run_end. The
    plain output stands, and pytest's exit code 0 without a report it could read is no pass."""
    ws = MemoryWorkspace()

    def run(op: RunCommand) -> CommandResult:
        path = op.envs["PYTEST_ADDOPTS"].split()[0].removeprefix("--junitxml=/workspace/")
        ws.files[path] = b'<?xml version="1.0" encoding="shift_jis"?><testsuite/>'
        return CommandResult(exit_code=0, stdout="1 passed", stderr="", duration_s=0.1)

    ws.commands = run
    log = AuditLog(MemoryStore(), flush_interval_s=None)
    config = replace(
        audited(tmp_path, FakeBackend(ws, tier="process"), log), limits=RunLimits(max_check_failures=1)
    )
    with build_agent(config) as agent:
        result = agent.run_sync("make the tests pass")
    assert result.status == RunStatus.CHECK_FAILED and result.check is not None
    assert result.check.summary == (  # the plain output's, not a report's
        "exit code 0; not a pass: pytest was asked for a JUnit report and left none readable (at most 8 MiB)"
    )
    assert run_ends(log) == ["check_failed"]


def test_whatever_the_check_raises_ends_the_run_as_an_error_with_its_end_recorded(
    tmp_path: object,
) -> None:
    """A tool's failure is an observation; the check's ended run_sync with no run_end in the
    trail. It ends the run "error" now, saying why, as a failing store or provider does."""
    ws = MemoryWorkspace()

    def broken(op: Op[Any]) -> OpResult:
        if isinstance(op, RunCommand):
            raise RuntimeError("the backend's own bug")
        return ws(op)

    log = AuditLog(MemoryStore(), flush_interval_s=None)
    with build_agent(audited(tmp_path, FakeBackend(broken, tier="process"), log)) as agent:
        result = agent.run_sync("make the tests pass")
    assert result.status == RunStatus.ERROR and result.error is not None
    assert "acceptance check `python3 -m pytest -q` failed to run" in result.error
    assert "RuntimeError: the backend's own bug" in result.error
    assert run_ends(log) == ["error"]
