from __future__ import annotations

import pytest

from stockade import exceptions as exc
from stockade.runtime.breaker import (
    BreakerConfig,
    Breakers,
    BreakingBackend,
    CircuitBreaker,
    RunBreakers,
    sandbox_failure,
)
from stockade.runtime.clock import ManualClock
from stockade.runtime.events import BreakerChanged, BreakerState, RuntimeEvent
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.ops import ReadFile
from stockade.testing import FakeBackend


def boom() -> None:
    raise exc.ToolError("tool failed")


def state(breaker: CircuitBreaker) -> BreakerState:
    """The breaker's state now (a call, so that mypy does not carry one assert to the next)."""
    return breaker.state


def fail(breaker: CircuitBreaker, times: int) -> None:
    for _ in range(times):
        with pytest.raises(exc.ToolError):
            breaker.call(boom)


def test_opens_after_five_consecutive_failures_and_refuses_with_a_typed_error(
    clock: ManualClock, events: list[RuntimeEvent]
) -> None:
    breaker = CircuitBreaker("tool:run_tests", clock=clock, observer=events.append)
    fail(breaker, 4)
    assert state(breaker) is BreakerState.CLOSED
    fail(breaker, 1)
    assert state(breaker) is BreakerState.OPEN
    with pytest.raises(exc.CircuitOpen) as refused:
        breaker.call(lambda: "never runs")
    assert refused.value.retryable and refused.value.name == "tool:run_tests"
    assert refused.value.retry_after == pytest.approx(30.0)
    assert events == [
        BreakerChanged(
            name="tool:run_tests",
            old=BreakerState.CLOSED,
            new=BreakerState.OPEN,
            failures=5,
            reason="ToolError: tool failed",
        )
    ]


def test_a_success_resets_the_count(clock: ManualClock) -> None:
    breaker = CircuitBreaker("t", clock=clock)
    fail(breaker, 4)
    breaker.call(lambda: None)
    fail(breaker, 4)
    assert state(breaker) is BreakerState.CLOSED


def test_half_opens_after_the_cool_down_and_one_trial_decides(clock: ManualClock) -> None:
    breaker = CircuitBreaker("t", BreakerConfig(threshold=2, cooldown_s=10), clock=clock)
    fail(breaker, 2)
    clock.advance(10)
    assert state(breaker) is BreakerState.HALF_OPEN
    fail(breaker, 1)  # the trial failed: open again for a full cool-down
    assert state(breaker) is BreakerState.OPEN
    clock.advance(10)
    assert breaker.call(lambda: "back") == "back"
    assert state(breaker) is BreakerState.CLOSED


def test_a_call_that_started_before_it_opened_does_not_close_it(clock: ManualClock) -> None:
    """A slow call went through while it was closed; two failures opened it meanwhile (or the
    anomaly monitor tripped it): that call's success closed it at once, skipping the cool-down."""
    breaker = CircuitBreaker("t", BreakerConfig(threshold=2, cooldown_s=60), clock=clock)

    def slow() -> str:
        fail(breaker, 2)  # what other calls did while this one ran
        assert state(breaker) is BreakerState.OPEN
        return "done late"

    assert breaker.call(slow) == "done late"
    assert state(breaker) is BreakerState.OPEN
    breaker.trip("anomaly")
    breaker.success()
    assert state(breaker) is BreakerState.OPEN
    clock.advance(60)
    assert breaker.call(lambda: "trial") == "trial" and state(breaker) is BreakerState.CLOSED


def test_half_open_lets_only_one_trial_through_at_a_time(clock: ManualClock) -> None:
    breaker = CircuitBreaker("t", BreakerConfig(threshold=1, cooldown_s=1), clock=clock)
    fail(breaker, 1)
    clock.advance(1)
    breaker.before()  # the trial is in flight
    with pytest.raises(exc.CircuitOpen):
        breaker.before()


def test_policy_denials_are_not_failures_of_the_tool(clock: ManualClock) -> None:
    breaker = CircuitBreaker("t", BreakerConfig(threshold=1), clock=clock)

    def denied() -> None:
        raise exc.PolicyDenied("no")

    with pytest.raises(exc.PolicyDenied):
        breaker.call(denied)
    assert state(breaker) is BreakerState.CLOSED


def test_a_result_can_count_as_a_failure(clock: ManualClock) -> None:
    breaker = CircuitBreaker("t", BreakerConfig(threshold=2), clock=clock)
    for _ in range(2):
        breaker.call(lambda: 1, failed=lambda code: code != 0)
    assert state(breaker) is BreakerState.OPEN


def test_one_breaker_per_name(clock: ManualClock, events: list[RuntimeEvent]) -> None:
    breakers = Breakers(config=BreakerConfig(threshold=1), clock=clock, observer=events.append)
    assert breakers.get("tool:a") is breakers.get("tool:a")
    fail(breakers.get("tool:a"), 1)
    assert breakers.states() == {"tool:a": BreakerState.OPEN}
    assert breakers.get("tool:b").state is BreakerState.CLOSED


def test_a_backend_breaker_counts_sandbox_failures_not_missing_files(clock: ManualClock) -> None:
    def handler(op):  # type: ignore[no-untyped-def]
        if op.path == "missing":
            raise exc.SandboxFileNotFound("missing")
        raise exc.SandboxCrashed("supervisor died")

    breakers = Breakers(config=BreakerConfig(threshold=2), clock=clock)
    instance = BreakingBackend(FakeBackend(handler), breakers).start(SandboxSpec())
    for _ in range(3):
        with pytest.raises(exc.SandboxFileNotFound):
            instance.execute(ReadFile(path="missing"))
    assert breakers.get("backend:fake").state is BreakerState.CLOSED
    for _ in range(2):
        with pytest.raises(exc.SandboxCrashed):
            instance.execute(ReadFile(path="x"))
    with pytest.raises(exc.CircuitOpen):
        instance.execute(ReadFile(path="missing"))


def test_a_pause_for_approval_or_a_kill_is_no_failure_of_the_tool(clock: ManualClock) -> None:
    breaker = CircuitBreaker("tool:write_file", clock=clock)

    def pauses() -> None:
        raise exc.ApprovalRequired("waits for a human", request_id="r1")

    for _ in range(10):
        with pytest.raises(exc.ApprovalRequired):
            breaker.call(pauses)
    assert state(breaker) is BreakerState.CLOSED


@pytest.mark.parametrize(
    "error",
    [
        exc.SandboxFileNotFound("no such file: missing.txt", path="missing.txt"),
        exc.PathEscapeError("../etc outside the workspace", path="../etc"),
        exc.InvalidArgument("limit is -1", argument="limit"),
        exc.InvalidToolCall("no tool 'nosuch'"),
        exc.PatchRejected("hunk 1 does not apply", path="a.py", hunk=1),
        exc.SnapshotNotFound("no snapshot snap-1"),
    ],
    ids=type,
)
def test_the_callers_errors_are_no_failure_of_a_tool_nor_a_backend(
    clock: ManualClock, error: exc.StockadeError
) -> None:
    """Found from outside: an MCP session reading five missing files opened ``tool:read_file``
    (refused for 30 s) for every session. What the caller asked wrong says nothing of the
    thing that served it: no breaker counts it, however often it comes."""
    assert error.caller_error

    def wrong() -> None:
        raise error

    tool = CircuitBreaker("tool:read_file", BreakerConfig(threshold=1), clock=clock)
    backend = CircuitBreaker("backend:process", BreakerConfig(threshold=1), clock=clock)
    for _ in range(10):
        with pytest.raises(type(error)):
            tool.call(wrong)
        with pytest.raises(type(error)):
            backend.call(wrong, error_counts=sandbox_failure)
    assert state(tool) is BreakerState.CLOSED and state(backend) is BreakerState.CLOSED


def test_a_runs_tool_breakers_are_its_own_and_the_rest_shared(clock: ManualClock) -> None:
    shared = Breakers(config=BreakerConfig(threshold=1), clock=clock)
    one, other = RunBreakers.of(shared), RunBreakers.of(shared)
    fail(one.get("tool:run_code"), 1)
    assert state(one.get("tool:run_code")) is BreakerState.OPEN
    assert state(other.get("tool:run_code")) is BreakerState.CLOSED  # another run's tool runs
    assert shared.states() == {}
    assert one.get("model:gpt") is other.get("model:gpt") is shared.get("model:gpt")
    assert one.get("backend:process") is shared.get("backend:process")
