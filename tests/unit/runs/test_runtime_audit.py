"""Every retry, breaker change, limit refusal, anomaly and kill lands in the audit trail, filed under
the run, step and tool call it happened in; the chain verifies after the run."""

from __future__ import annotations

from typing import Any

import pytest

from stockade import Sandbox
from stockade.agent import Agent, ModelRequested, RunStarted, ToolCalled
from stockade.audit import EventKind, verify
from stockade.audit.agent import AuditObserver
from stockade.audit.runtime_events import RuntimeAuditor
from stockade.exceptions import AuditStoreError, ResourceContention
from stockade.models.messages import ModelRequest, ToolCall
from stockade.models.scripted import Turn
from stockade.runtime import Retrier, RetryingBackend, RetryPolicy
from stockade.runtime.events import (
    AnomalyAction,
    AnomalyFlagged,
    BreakerChanged,
    BreakerState,
    KillRequested,
    LimitHit,
)
from stockade.sandbox.base import OpResult
from stockade.sandbox.ops import Op, ReadFile
from stockade.testing import FakeBackend, MemoryWorkspace, ScriptedModel, capture_audit, tool_call
from stockade.tools import read_file

TURNS: list[Turn] = [
    tool_call("write_file", {"path": "a.txt", "content": "x\n"}),
    tool_call("read_file", {"path": "a.txt"}),
    "ok",
]


def reads_failing_once() -> FakeBackend:
    failures = iter([ResourceContention("the host is busy")])
    workspace = MemoryWorkspace()

    def handler(op: Op[Any]) -> OpResult:
        if isinstance(op, ReadFile) and op.path == "a.txt" and (error := next(failures, None)):
            raise error
        return workspace(op)

    return FakeBackend(handler)


def test_a_retried_read_becomes_a_retry_event_with_its_reason_and_delay() -> None:
    with capture_audit() as audit:
        auditor = RuntimeAuditor(audit)
        retrier = Retrier(policy=RetryPolicy(wait_initial=0.25, wait_jitter=0), observer=auditor)
        with Sandbox.create(backend=RetryingBackend(reads_failing_once(), retrier)) as sbx:
            agent = Agent(ScriptedModel(TURNS), observers=[AuditObserver(audit), auditor.track])
            assert agent.run_sync("read a.txt", sandbox=sbx, run_id="run-1").ok

        (retry,) = audit.of(EventKind.RETRY)
        assert (retry.run_id, retry.step, retry.actor) == ("run-1", 2, "runtime")
        assert retry.attributes == {
            "subject": "fake:ReadFile",
            "attempt": 1,
            "delay_s": 0.25,
            "reason": "ResourceContention: the host is busy",
            "call_id": "call_1_0",
        }
        kinds = audit.kinds()
        assert kinds.index(EventKind.RETRY) < kinds.index(EventKind.RUN_END)
        assert verify(audit.store).ok


def test_each_kind_of_runtime_event_has_its_audit_kind() -> None:
    with capture_audit() as audit:
        auditor = RuntimeAuditor(audit, run_id="run-2")
        auditor(
            BreakerChanged(name="tool:run_code", old=BreakerState.CLOSED, new=BreakerState.OPEN, failures=5)
        )
        auditor(LimitHit(kind="rate", key="run-2", detail="60 actions a minute", retry_after=1.5))
        auditor(LimitHit(kind="spend", key="team", detail="$5 an hour"))
        auditor(
            AnomalyFlagged(rule="loop", detail="the same call 8 times", action=AnomalyAction.OPEN_BREAKER)
        )
        auditor(KillRequested(run_id="run-9", reason="operator", killed_instances=2))

        assert audit.kinds() == [
            EventKind.BREAKER_CHANGE,
            EventKind.RATE_LIMITED,
            EventKind.BUDGET,
            EventKind.ANOMALY,
            EventKind.KILL_SWITCH,
        ]
        breaker, rate, _, anomaly, kill = audit.events
        assert breaker.attributes["new"] == "open" and breaker.attributes["failures"] == 5
        assert rate.attributes["decision"] == "deny" and rate.attributes["retry_after"] == 1.5
        assert anomaly.attributes["action"] == "open_breaker"
        assert (kill.run_id, kill.attributes["killed_instances"]) == ("run-9", 2)  # the killed run's id


def test_the_auditor_follows_the_step_and_call_in_progress() -> None:
    with capture_audit() as audit:
        auditor = RuntimeAuditor(audit)
        auditor.track(RunStarted(run_id="r", task="t", model_name="m", resumed=False))
        auditor.track(ModelRequested(run_id="r", step=3, request=ModelRequest(system="", messages=())))
        auditor(LimitHit(kind="rate", key="r", detail="slow down"))
        call = ToolCall(id="c1", name="read_file", args={})
        auditor.track(ToolCalled(run_id="r", step=3, call=call, tool=read_file, idempotency_key="r:3:c1"))
        auditor(LimitHit(kind="rate", key="r", detail="slow down"))
        model_time, tool_time = audit.events
        assert (model_time.step, "call_id" in model_time.attributes) == (3, False)
        assert (tool_time.step, tool_time.attributes["call_id"]) == (3, "c1")


class BrokenLog:
    """An audit log whose store is down."""

    def record(self, *args: object, **kwargs: object) -> None:
        raise AuditStoreError("the audit database is gone")


def test_a_failed_write_never_breaks_the_control_but_stops_the_run_at_its_next_event() -> None:
    auditor = RuntimeAuditor(BrokenLog())  # type: ignore[arg-type]
    auditor(LimitHit(kind="rate", key="r", detail="slow down"))  # does not raise
    with pytest.raises(AuditStoreError):
        auditor.track(RunStarted(run_id="r", task="t", model_name="m", resumed=False))
