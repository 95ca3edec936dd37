from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, cast

import pytest
import stamina

from stockade import exceptions as exc
from stockade.audit.redact import Redactor
from stockade.runtime.clock import ManualClock
from stockade.runtime.events import FlakyRerun, RetryScheduled, RuntimeEvent
from stockade.runtime.retry import (
    AsyncRetryingBackend,
    AsyncRetryingInstance,
    Retrier,
    RetryingBackend,
    RetryingInstance,
    RetryPolicy,
    is_transient,
    run_tests_allowing_flaky,
)
from stockade.sandbox.base import OpResult
from stockade.sandbox.ops import Op, ReadFile, RunCommand, WriteFile
from stockade.testing import FakeBackend, FakeInstance, MemoryWorkspace
from stockade.types import CommandResult


class FailsThen:
    """Raises ``error`` the first ``times`` calls, then returns ``value``."""

    def __init__(self, error: Exception, times: int, value: object = "ok") -> None:
        self.error, self.times, self.value, self.calls = error, times, value, 0

    def __call__(self) -> object:
        self.calls += 1
        if self.calls <= self.times:
            raise self.error
        return self.value


def answers(call: FailsThen) -> Callable[[Op[Any]], OpResult]:
    """A handler for ``FakeInstance`` answering every op with ``call()``."""
    return lambda op: cast(OpResult, call())


def retrier(events: list[RuntimeEvent], clock: ManualClock, **policy: float) -> Retrier:
    return Retrier(policy=RetryPolicy(**policy), observer=events.append, clock=clock, rng=random.Random(1))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (exc.SandboxStartError("x"), True),
        (exc.BackendUnavailable("x"), True),
        (exc.ModelRateLimited("429"), True),
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (exc.SandboxFileNotFound("x"), False),
        (exc.PolicyDenied("x"), False),
        (exc.ModelRequestRejected("400"), False),
        (SyntaxError("x"), False),
        (AssertionError(), False),
        (PermissionError(), False),
    ],
)
def test_one_classification_decides_what_is_retried(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient


def test_a_transient_failure_is_retried_and_each_retry_reported(
    events: list[RuntimeEvent], clock: ManualClock
) -> None:
    call = FailsThen(exc.SandboxStartError("engine hiccup"), times=2)
    assert retrier(events, clock).call("sandbox:start", call) == "ok"
    assert call.calls == 3
    assert [e.attempt for e in events if isinstance(e, RetryScheduled)] == [1, 2]
    first = events[0]
    assert isinstance(first, RetryScheduled)
    assert first.subject == "sandbox:start" and "engine hiccup" in first.reason and first.delay_s > 0


def test_three_attempts_by_default_then_the_error_surfaces(
    events: list[RuntimeEvent], clock: ManualClock
) -> None:
    call = FailsThen(exc.BackendUnavailable("down"), times=10)
    with pytest.raises(exc.BackendUnavailable):
        retrier(events, clock).call("x", call)
    assert call.calls == 3
    assert len(events) == 2


def test_a_permanent_failure_is_never_retried(events: list[RuntimeEvent], clock: ManualClock) -> None:
    call = FailsThen(exc.SandboxFileNotFound("nope"), times=1)
    with pytest.raises(exc.SandboxFileNotFound):
        retrier(events, clock).call("x", call)
    assert call.calls == 1 and events == []


def test_retry_after_is_the_delay(events: list[RuntimeEvent], clock: ManualClock) -> None:
    call = FailsThen(exc.ModelRateLimited("429", retry_after=7.5), times=1)
    retrier(events, clock, wait_max=1.0).call("model:x", call)
    assert isinstance(events[0], RetryScheduled) and events[0].delay_s == 7.5


def test_backoff_grows_exponentially_with_bounded_jitter() -> None:
    policy = RetryPolicy(wait_initial=1.0, wait_jitter=0.5, wait_max=100.0)
    rng = random.Random(0)
    for attempt, base in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0)]:
        assert base <= policy.backoff(attempt, rng) <= base + 0.5
    assert RetryPolicy(wait_max=3.0).backoff(50, rng) == 3.0


def test_no_retry_starts_after_the_deadline(events: list[RuntimeEvent], clock: ManualClock) -> None:
    def slow_failure() -> None:
        clock.advance(8.0)
        raise exc.SandboxStartError("slow")

    with pytest.raises(exc.SandboxStartError):
        retrier(events, clock, deadline_s=10.0, attempts=5, wait_jitter=0).call("x", slow_failure)
    assert len(events) == 1  # 8s + backoff fits in 10s once; 16s does not


def test_an_instance_retries_reads_but_not_commands_or_writes(
    events: list[RuntimeEvent], clock: ManualClock
) -> None:
    flaky_reads = FailsThen(exc.ResourceContention("busy"), times=1, value=b"data")

    def handler(op):  # type: ignore[no-untyped-def]
        if isinstance(op, ReadFile):
            return flaky_reads()
        raise exc.ResourceContention("busy")

    inner = FakeInstance(handler, "fake", 1)
    instance = RetryingInstance(inner, retrier(events, clock))
    assert instance.execute(ReadFile(path="a")) == b"data"
    with pytest.raises(exc.ResourceContention):
        instance.execute(RunCommand(argv=("make",)))
    with pytest.raises(exc.ResourceContention):
        instance.execute(WriteFile(path="a", data=b""))
    assert [type(op).__name__ for op in inner.ops] == ["ReadFile", "ReadFile", "RunCommand", "WriteFile"]


def test_the_caller_may_mark_a_side_effecting_op_idempotent(
    events: list[RuntimeEvent], clock: ManualClock
) -> None:
    writes = FailsThen(exc.ResourceContention("busy"), times=1, value=None)
    inner = FakeInstance(answers(writes), "fake", 1)
    RetryingInstance(inner, retrier(events, clock), idempotent=(WriteFile,)).execute(
        WriteFile(path="a", data=b"")
    )
    assert writes.calls == 2


def test_sandbox_creation_is_retried(events: list[RuntimeEvent], clock: ManualClock) -> None:
    class FlakyStart(FakeBackend):
        starts = 0

        def start(self, spec):  # type: ignore[no-untyped-def]
            self.starts += 1
            if self.starts == 1:
                raise exc.SandboxStartError("bwrap: cannot set up namespace")
            return super().start(spec)

    backend = FlakyStart(MemoryWorkspace())
    from stockade import Sandbox

    with Sandbox.create(backend=RetryingBackend(backend, retrier(events, clock))) as sbx:
        sbx.files.write("a.txt", "hi")
        assert sbx.files.read("a.txt") == "hi"
    assert backend.starts == 2
    assert isinstance(events[0], RetryScheduled) and events[0].subject == "fake:start"


async def test_the_async_instance_retries_reads_but_not_commands_or_writes(
    events: list[RuntimeEvent], clock: ManualClock
) -> None:
    flaky_reads = FailsThen(exc.ResourceContention("busy"), times=2, value=b"data")

    def handler(op):  # type: ignore[no-untyped-def]
        if isinstance(op, ReadFile):
            return flaky_reads()
        raise exc.ResourceContention("busy")

    inner = FakeInstance(handler, "fake", 1)  # FakeInstance is an AsyncInstance too
    instance = AsyncRetryingInstance(inner, retrier(events, clock))
    assert await instance.aexecute(ReadFile(path="a")) == b"data"
    with pytest.raises(exc.ResourceContention):
        await instance.aexecute(RunCommand(argv=("make",)))
    with pytest.raises(exc.ResourceContention):
        await instance.aexecute(WriteFile(path="a", data=b""))
    assert [type(op).__name__ for op in inner.ops] == ["ReadFile"] * 3 + ["RunCommand", "WriteFile"]
    assert [(e.subject, e.attempt) for e in events if isinstance(e, RetryScheduled)] == [
        ("fake:ReadFile", 1),
        ("fake:ReadFile", 2),
    ]


async def test_the_async_instance_gives_up_on_permanent_errors_and_after_three_attempts(
    events: list[RuntimeEvent], clock: ManualClock
) -> None:
    missing = FailsThen(exc.SandboxFileNotFound("a: no such file"), times=5)
    busy = FailsThen(exc.ResourceContention("busy"), times=5)
    for failing, calls in ((missing, 1), (busy, 3)):
        instance = AsyncRetryingInstance(FakeInstance(answers(failing), "fake", 1), retrier(events, clock))
        with pytest.raises(type(failing.error)):
            await instance.aexecute(ReadFile(path="a"))
        assert failing.calls == calls


async def test_the_async_instance_retries_what_the_caller_marks_idempotent(
    events: list[RuntimeEvent], clock: ManualClock
) -> None:
    writes = FailsThen(exc.ResourceContention("busy"), times=1, value=None)
    inner = FakeInstance(answers(writes), "fake", 1)
    instance = AsyncRetryingInstance(inner, retrier(events, clock), idempotent=(WriteFile,))
    await instance.aexecute(WriteFile(path="a", data=b""))
    assert writes.calls == 2


async def test_async_sandbox_creation_is_retried(events: list[RuntimeEvent], clock: ManualClock) -> None:
    class FlakyStart(FakeBackend):
        starts = 0

        async def astart(self, spec):  # type: ignore[no-untyped-def]
            self.starts += 1
            if self.starts == 1:
                raise exc.SandboxStartError("bwrap: cannot set up namespace")
            return await super().astart(spec)

    backend = FlakyStart(MemoryWorkspace())
    from stockade import AsyncSandbox

    sbx = await AsyncSandbox.create(backend=AsyncRetryingBackend(backend, retrier(events, clock)))
    async with sbx:
        await sbx.files.write("a.txt", "hi")
        assert await sbx.files.read("a.txt") == "hi"
    assert backend.starts == 2
    assert isinstance(events[0], RetryScheduled) and events[0].subject == "fake:start"
    assert isinstance(sbx.instance, AsyncRetryingInstance)


def _result(code: int) -> CommandResult:
    return CommandResult(exit_code=code, stdout="", stderr="", duration_s=0.1)


def test_a_failing_test_run_is_rerun_once_when_flakiness_is_accepted(events: list[RuntimeEvent]) -> None:
    outcomes = iter([_result(1), _result(0)])
    run = run_tests_allowing_flaky(lambda: next(outcomes), allow_flaky=True, observer=events.append)
    assert run.result.ok and run.reran and run.flaky
    assert run.first is not None and run.first.exit_code == 1
    assert events == [FlakyRerun(subject="run_tests", first_exit_code=1, second_exit_code=0)]


def test_a_failing_test_run_is_not_rerun_by_default(events: list[RuntimeEvent]) -> None:
    calls = []

    def run() -> CommandResult:
        calls.append(1)
        return _result(1)

    outcome = run_tests_allowing_flaky(run, allow_flaky=False, observer=events.append)
    assert not outcome.result.ok and not outcome.reran and len(calls) == 1 and events == []


KEY = "sk-proj-LeakTestKey0123456789abcdef"


def test_a_retry_reason_is_redacted_before_an_observer_or_stamina_sees_it(
    events: list[RuntimeEvent], clock: ManualClock, stamina_log: list[Any]
) -> None:
    quoted = exc.ModelUnavailable(f"upstream overloaded for Bearer {KEY}")
    call = FailsThen(quoted, times=9)
    logs = stamina_log
    with pytest.raises(exc.ModelUnavailable) as raised:
        retrier(events, clock, attempts=2, wait_initial=0, wait_jitter=0).call("model:x", call)
    assert raised.value is quoted  # the caller gets the error itself, once the attempts run out
    (event,) = events
    assert isinstance(event, RetryScheduled)
    assert event.reason == "ModelUnavailable: upstream overloaded for Bearer [REDACTED:api_key]"
    (line,) = [line for line in logs if line["event"] == "stamina.retry_scheduled"]
    assert "[REDACTED:api_key]" in line["caused_by"] and KEY not in repr(logs)


def test_a_retrier_redacts_with_the_redactor_it_is_given(
    events: list[RuntimeEvent], clock: ManualClock
) -> None:
    redactor = Redactor()
    redactor.add_secret("gwkey-PlainShape-77665544")
    retrying = Retrier(
        observer=events.append, clock=clock, redact=redactor.text, policy=RetryPolicy(wait_jitter=0)
    )
    call = FailsThen(exc.ModelUnavailable("refused gwkey-PlainShape-77665544"), times=1)
    assert retrying.call("model:x", call) == "ok"
    assert [e.reason for e in events] == ["ModelUnavailable: refused [REDACTED:secret]"]  # type: ignore[union-attr]


async def test_stamina_test_mode_running_out_of_attempts_raises_the_error_itself(
    events: list[RuntimeEvent], clock: ManualClock
) -> None:
    quoted = exc.ModelUnavailable(f"overloaded for {KEY}")

    async def fails() -> None:
        raise quoted

    with stamina.set_testing(True, attempts=1), pytest.raises(exc.ModelUnavailable) as raised:
        await retrier(events, clock, attempts=3).acall("model:x", fails)
    assert raised.value is quoted
