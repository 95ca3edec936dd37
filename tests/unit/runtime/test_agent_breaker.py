"""The agent's circuit breaker, black-box: a scripted model and a policy file, judged by the run's
result, its audit trail and its run store."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from stockade.agent import RunStatus
from stockade.assembly import AgentConfig, build_agent
from stockade.audit import SQLiteStore
from stockade.audit.events import AuditEvent
from stockade.models import ScriptedModel, tool_call
from stockade.runs import open_run_store
from stockade.runtime.clock import ManualClock
from stockade.sandbox.ops import RunCode
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.tools import Toolset, read_file, run_code, run_tests, shell, write_file
from stockade.types import CommandResult, Execution, ExecutionError

POLICY = """\
version = 1
[trust]
level = "trusted"
[commands]
deny = ["curl"]
"""

RAISE = tool_call("run_code", {"language": "python", "code": "1/0"})
DIVISION = ExecutionError(name="ZeroDivisionError", value="division by zero", traceback="")


def raising(op: RunCode) -> Execution:
    if "1/0" in op.code:
        return Execution(error=DIVISION)
    return Execution()


def failing_command(op: object) -> CommandResult:
    return CommandResult(exit_code=1, stdout="", stderr="nope", duration_s=0.0)


def setup(tmp_path: Path, model: ScriptedModel, **overrides: object) -> AgentConfig:
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    workspace = MemoryWorkspace(code=raising, commands=failing_command)
    base = AgentConfig(
        model=model,
        policy=policy,
        backend=FakeBackend(workspace, tier="process"),
        audit=f"sqlite:///{tmp_path / 'audit.db'}",
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
        clock=ManualClock(),
        anomaly=False,  # the monitor's own rules are tested apart
        tools=Toolset([run_code, shell, run_tests, read_file, write_file]),
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def trail(tmp_path: Path, run_id: str) -> list[AuditEvent]:
    with SQLiteStore(tmp_path / "audit.db") as store:
        return list(store.events(run_id=run_id))


def code_ops(config: AgentConfig) -> int:
    backend = config.backend
    assert isinstance(backend, FakeBackend)
    return sum(1 for i in backend.instances for op in i.ops if isinstance(op, RunCode))


def test_five_raising_calls_in_a_row_stop_the_run_broken_with_the_reason(tmp_path: Path) -> None:
    model = ScriptedModel([RAISE] * 7 + ["done"])
    config = setup(tmp_path, model)
    with build_agent(config) as agent:
        result = agent.run_sync("divide", run_id="b1")
    assert result.status == RunStatus.BROKEN
    assert code_ops(config) == 5  # the sixth call never ran
    assert len(model.requests) == 5  # and the model was not asked again
    assert result.error is not None and result.error.count("ZeroDivisionError") == 5
    assert "run_code (step 5)" in result.error
    events = trail(tmp_path, "b1")
    (tripped,) = [e for e in events if e.kind.value == "breaker_change"]
    assert tripped.attributes["name"] == "agent" and tripped.attributes["new"] == "open"
    assert tripped.step == 5 and tripped.attributes["failures"] == 5
    assert "ZeroDivisionError" in str(tripped.attributes["reason"])
    (end,) = [e for e in events if e.kind.value == "run_end"]
    assert end.attributes["status"] == "broken" and "ZeroDivisionError" in str(end.attributes["error"])
    with open_run_store(f"sqlite:///{tmp_path / 'audit.db'}") as store:
        summary = store.summary("b1")
        assert summary is not None and summary.status == RunStatus.BROKEN
        assert summary.error is not None and "ZeroDivisionError" in summary.error
        calls = store.tool_calls("b1")
    assert [c.failed for c in calls] == [True] * 5


def test_every_kind_of_failure_counts(tmp_path: Path) -> None:
    model = ScriptedModel(
        [
            RAISE,  # code that raised
            tool_call("shell", {"command": "false"}),  # a command that failed
            tool_call("run_tests", {"command": "make check"}),  # a test run that failed
            tool_call("read_file", {"path": "missing.txt"}),  # a tool error
            tool_call("shell", {"command": "curl https://example.com"}),  # a denial
            "done",
        ]
    )
    with build_agent(setup(tmp_path, model)) as agent:
        result = agent.run_sync("fail", run_id="b2")
    assert result.status == RunStatus.BROKEN, result.error
    assert result.error is not None
    for what in ("run_code (step 1)", "shell (step 2): exit code 1", "run_tests (step 3)",
                 "read_file (step 4): error: SandboxFileNotFound", "shell (step 5): denied"):  # fmt: skip
        assert what in result.error


def test_a_success_resets_the_count(tmp_path: Path) -> None:
    ok = tool_call("run_code", {"language": "python", "code": "1"})
    model = ScriptedModel([RAISE] * 4 + [ok] + [RAISE] * 4 + ["done"])
    with build_agent(setup(tmp_path, model)) as agent:
        result = agent.run_sync("flaky", run_id="b3")
    assert result.status == RunStatus.SUCCESS
    assert not [e for e in trail(tmp_path, "b3") if e.kind.value == "breaker_change"]


def test_the_threshold_is_configurable_and_none_turns_it_off(tmp_path: Path) -> None:
    with build_agent(setup(tmp_path, ScriptedModel([RAISE] * 3), max_consecutive_failures=2)) as agent:
        assert agent.run_sync("x", run_id="b4").status == RunStatus.BROKEN
    off = setup(tmp_path, ScriptedModel([RAISE] * 7 + ["gave up"]), max_consecutive_failures=None)
    with build_agent(off) as agent:
        assert agent.run_sync("x", run_id="b5").status == RunStatus.SUCCESS
    assert code_ops(off) == 7


def test_a_person_resumes_a_broken_run_and_the_breaker_closes(tmp_path: Path) -> None:
    ok = tool_call("run_code", {"language": "python", "code": "1"})
    config = setup(tmp_path, ScriptedModel([RAISE] * 5 + [ok, "fixed"]))
    with build_agent(config) as agent:
        broken = agent.run_sync("divide", run_id="b6")
        assert broken.status == RunStatus.BROKEN
        resumed = agent.resume_sync("b6")
    assert resumed.status == RunStatus.SUCCESS and resumed.answer == "fixed"
    changes = [e.attributes for e in trail(tmp_path, "b6") if e.kind.value == "breaker_change"]
    assert [(c["old"], c["new"]) for c in changes] == [("closed", "open"), ("open", "closed")]
    with open_run_store(f"sqlite:///{tmp_path / 'audit.db'}") as store:
        summary = store.summary("b6")
    assert summary is not None and summary.status == RunStatus.SUCCESS


def test_failures_in_one_step_stop_the_calls_after_them(tmp_path: Path) -> None:
    model = ScriptedModel([[RAISE] * 7, "done"])
    config = setup(tmp_path, model)
    with build_agent(config) as agent:
        result = agent.run_sync("divide", run_id="b7")
    assert result.status == RunStatus.BROKEN and code_ops(config) == 5
