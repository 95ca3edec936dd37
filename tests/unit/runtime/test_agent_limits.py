"""Rate and spend limits as an operator sets them, black-box: a scripted model, a policy file,
``build_agent``, judged by the run's result, the model's requests and the audit trail."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from stockade.agent import RunStatus
from stockade.assembly import AgentConfig, build_agent
from stockade.audit import AuditLog, MemoryStore
from stockade.audit.events import AuditEvent
from stockade.exceptions import InvalidArgument
from stockade.models import ModelResponse, ScriptedModel, Usage, tool_call
from stockade.runs import open_run_store
from stockade.runtime.clock import ManualClock
from stockade.sandbox.ops import RunCommand
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.tools import Toolset, shell

ECHO = tool_call("shell", {"command": "echo hi"})


def setup(tmp_path: Path, model: ScriptedModel, clock: ManualClock, **overrides: object) -> AgentConfig:
    policy = tmp_path / "policy.toml"
    policy.write_text('version = 1\n[trust]\nlevel = "trusted"\n')
    base = AgentConfig(
        model=model,
        policy=policy,
        backend=FakeBackend(MemoryWorkspace(), tier="process"),
        audit=AuditLog(MemoryStore(), flush_interval_s=None),
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
        clock=clock,
        anomaly=False,
        tools=Toolset([shell]),
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def commands(config: AgentConfig) -> int:
    backend = config.backend
    assert isinstance(backend, FakeBackend)
    return sum(1 for i in backend.instances for op in i.ops if isinstance(op, RunCommand))


def events(config: AgentConfig, kind: str) -> list[AuditEvent]:
    log = config.audit
    assert isinstance(log, AuditLog)
    log.flush()
    return [e for e in log.store.events() if e.kind.value == kind]


def test_a_refused_action_waits_for_the_window_by_default(tmp_path: Path, clock: ManualClock) -> None:
    model = ScriptedModel([ECHO] * 5 + ["done"])
    config = setup(tmp_path, model, clock, rate_per_minute=2)
    started = clock.monotonic()
    with build_agent(config) as agent:
        result = agent.run_sync("echo", run_id="l1")
    assert result.status == RunStatus.SUCCESS
    assert commands(config) == 5 and len(model.requests) == 6  # no model call spent on a refusal
    assert not any(c.is_error for s in result.steps for c in s.tool_calls)
    assert clock.monotonic() - started >= 120  # actions 3 and 5 waited for their minute
    waits = [e.attributes for e in events(config, "rate_limited")]
    assert len(waits) == 2 and all(w["decision"] == "wait" and w["key"] == "tenant:default" for w in waits)


def test_a_refused_action_can_stop_the_run_instead(tmp_path: Path, clock: ManualClock) -> None:
    model = ScriptedModel([ECHO] * 5 + ["done"])
    config = setup(tmp_path, model, clock, rate_per_minute=2, on_rate_limit="stop")
    with build_agent(config) as agent:
        result = agent.run_sync("echo", run_id="l2")
    assert result.status == RunStatus.BUDGET and "2 actions per minute" in (result.error or "")
    assert commands(config) == 2 and len(model.requests) == 3
    (stop,) = [e.attributes for e in events(config, "rate_limited")]
    assert stop["decision"] == "deny" and stop["action"] == "stop"


def test_the_shared_rate_is_shared_by_the_runs_of_a_tenant_and_the_run_rate_is_not(
    tmp_path: Path, clock: ManualClock
) -> None:
    shared = setup(tmp_path, ScriptedModel([ECHO] * 3 + ["done"]), clock, rate_per_minute=3,
                   on_rate_limit="stop")  # fmt: skip
    with build_agent(shared) as agent:
        first = agent.run_sync("echo", run_id="s1")
        second = agent.run_sync("echo", run_id="s2")
    assert (first.status, second.status) == (RunStatus.SUCCESS, RunStatus.BUDGET)
    assert commands(shared) == 3  # three actions for the tenant within the minute
    own = setup(tmp_path, ScriptedModel([ECHO] * 3 + ["done"]), clock, run_rate_per_minute=3,
                on_rate_limit="stop")  # fmt: skip
    with build_agent(own) as agent:
        statuses = [agent.run_sync("echo", run_id=f"p{n}").status for n in range(2)]
    assert statuses == [RunStatus.SUCCESS] * 2 and commands(own) == 6
    other = setup(tmp_path, ScriptedModel([ECHO] * 3 + ["done"]), clock, rate_per_minute=3,
                  on_rate_limit="stop", tenant="other")  # fmt: skip
    with build_agent(other) as agent:
        assert agent.run_sync("echo", run_id="o1").status == RunStatus.SUCCESS


SPENDY = ModelResponse(tool_calls=(ECHO,), usage=Usage(input_tokens=2_000, output_tokens=500, requests=1))
# gpt-4.1: $0.004 + $0.004 = $0.008 a turn


def test_a_spend_limit_stops_the_run_by_default_and_uses_what_was_paid_for(
    tmp_path: Path, clock: ManualClock
) -> None:
    model = ScriptedModel([SPENDY] * 10 + ["done"], name="gpt-4.1")
    config = setup(tmp_path, model, clock, dollars_per_hour=0.02)
    with build_agent(config) as agent:
        result = agent.run_sync("spend", run_id="d1")
    assert result.status == RunStatus.BUDGET and "0.02" in (result.error or "")
    assert len(model.requests) == 3 and commands(config) == 3  # the third, paid for, was used


def test_a_spend_limit_can_wait_for_its_window_instead(tmp_path: Path, clock: ManualClock) -> None:
    model = ScriptedModel([SPENDY] * 4 + ["done"], name="gpt-4.1")
    config = setup(tmp_path, model, clock, dollars_per_hour=0.02, on_spend_limit="wait")
    started = clock.monotonic()
    with build_agent(config) as agent:
        result = agent.run_sync("spend", run_id="d2")
    assert result.status == RunStatus.SUCCESS and commands(config) == 4 and len(model.requests) == 5
    assert clock.monotonic() - started >= 3600  # the fourth request waited for the hour to roll
    waits = [e.attributes for e in events(config, "budget")]
    assert waits and all(w["decision"] == "wait" and w["limit"] == "spend" for w in waits)


def test_a_long_wait_for_the_window_stops_the_run_and_its_resume_makes_the_call_once(
    tmp_path: Path, clock: ManualClock
) -> None:
    """What a service's worker does with a run whose window is full for long: not sleep on it.
    The run stops resumable before the refused call runs (a shell command: not idempotent), and
    once the window frees the resume runs that call, once, as if it had waited."""
    model = ScriptedModel([ECHO] * 3 + ["done"])
    with open_run_store("memory:") as store:
        config = setup(
            tmp_path, model, clock, rate_per_minute=2, limit_wait_in_place_s=5.0, checkpointer=store
        )
        with build_agent(config) as agent:
            stopped = agent.run_sync("echo", run_id="w1")
            assert stopped.status == RunStatus.INTERRUPTED and "LimitWait" in (stopped.error or "")
            assert "again in 60 s" in (stopped.error or "") and commands(config) == 2
            (defer,) = [e.attributes for e in events(config, "rate_limited")]
            assert defer["action"] == "defer" and defer["decision"] == "wait" and defer["retry_after"] == 60
            clock.advance(60)
            done = agent.resume_sync("w1")
        assert done.status == RunStatus.SUCCESS and commands(config) == 3 and len(model.requests) == 4
        assert not any(c.is_error for s in done.steps for c in s.tool_calls)  # no "outcome unknown"
        assert set(store.attempts("w1").values()) == {1}  # each call started once


def test_a_short_wait_for_the_window_is_waited_where_the_run_is(tmp_path: Path, clock: ManualClock) -> None:
    model = ScriptedModel([ECHO] * 3 + ["done"])
    config = setup(tmp_path, model, clock, rate_per_minute=2, rate_period_s=4.0, limit_wait_in_place_s=5.0)
    with build_agent(config) as agent:
        result = agent.run_sync("echo", run_id="w2")
    assert result.status == RunStatus.SUCCESS and commands(config) == 3
    assert [e.attributes["action"] for e in events(config, "rate_limited")] == ["wait"]


def test_a_long_wait_for_the_spend_window_stops_the_run_before_the_model_is_asked(
    tmp_path: Path, clock: ManualClock
) -> None:
    model = ScriptedModel([SPENDY] * 4 + ["done"], name="gpt-4.1")
    config = setup(
        tmp_path, model, clock, dollars_per_hour=0.02, on_spend_limit="wait", limit_wait_in_place_s=5.0
    )
    with build_agent(config) as agent:
        result = agent.run_sync("spend", run_id="w3")
    assert result.status == RunStatus.INTERRUPTED and len(model.requests) == 3  # the fourth not asked
    (defer,) = [e.attributes for e in events(config, "budget")]
    assert defer["action"] == "defer" and defer["limit"] == "spend"


def test_what_a_limit_does_is_checked_when_configured(tmp_path: Path, clock: ManualClock) -> None:
    with pytest.raises(InvalidArgument, match="on_rate_limit"):
        setup(tmp_path, ScriptedModel(["x"]), clock, on_rate_limit="retry")
