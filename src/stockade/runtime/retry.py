"""Retry what is transient, and only that.

One classification drives everything: an error is transient when it says so
(``StockadeError.retryable``; provider 429/5xx and engine hiccups are mapped to such errors
at their boundary) or is a plain ``ConnectionError``/``TimeoutError`` from outside. Syntax
errors, failing assertions, missing files and policy denials are never retried.

Built on stamina: its loop, its attempt cap and its test mode (``stamina.set_testing(True)``
turns every wait to zero). The backoff itself is computed here, so that each retry can be
reported with its real delay, and so that ``retry_after`` and the deadline are honoured.

A retry's reason (the error's message) is redacted where it is made (``Retrier.redact``): a
provider may quote the key it was sent, and the reason goes to every observer (run store,
audit trail, metrics, the terminal). stamina itself only ever sees that redacted reason: its
log hook prints the error it retries, so it is handed a stand-in (``Scheduled``) and the
original error is raised again when the attempts run out.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import stamina

from stockade.audit.redact import StringProcessor, redact_tokens
from stockade.exceptions import StockadeError
from stockade.runtime.clock import Clock, SystemClock
from stockade.runtime.events import FlakyRerun, Observer, RetryScheduled, ignore
from stockade.sandbox.base import (
    AsyncBackend,
    AsyncInstance,
    Backend,
    Instance,
    OpResult,
    OutputSink,
    SandboxSpec,
    WrapperBackend,
    WrapperInstance,
)
from stockade.sandbox.ops import ListDir, Op, ReadFile, Stat
from stockade.types import CommandResult

__all__ = [
    "READ_OPS",
    "AsyncRetryingBackend",
    "AsyncRetryingInstance",
    "Retrier",
    "RetryPolicy",
    "RetryingBackend",
    "RetryingInstance",
    "TestRun",
    "is_transient",
    "run_tests_allowing_flaky",
]

T = TypeVar("T")

# Operations that change nothing: safe to repeat after a transient failure. Not GetArchive:
# it streams into the caller's sink, which a second attempt would feed a second archive.
READ_OPS: tuple[type[Op[Any]], ...] = (ReadFile, Stat, ListDir)


def is_transient(err: BaseException) -> bool:
    """Whether running the same call again can help."""
    if isinstance(err, StockadeError):
        return err.retryable
    return isinstance(err, ConnectionError | TimeoutError)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Exponential backoff with jitter: ``wait_initial * wait_exp_base**(n-1) + U(0, wait_jitter)``,
    capped at ``wait_max``; at most ``attempts`` tries, none starting after ``deadline_s``."""

    attempts: int = 3
    deadline_s: float = 60.0
    wait_initial: float = 0.1
    wait_max: float = 5.0
    wait_jitter: float = 1.0
    wait_exp_base: float = 2.0

    def backoff(self, attempt: int, rng: random.Random) -> float:
        jitter = rng.uniform(0, self.wait_jitter) if self.wait_jitter else 0.0
        try:
            return min(self.wait_max, self.wait_initial * self.wait_exp_base ** (attempt - 1) + jitter)
        except OverflowError:
            return self.wait_max


class Scheduled(Exception):  # never leaves the Retrier: stamina's view of an error, not one
    """What stamina is handed for a failure to retry: the redacted reason, not the error (its
    log hook prints ``repr`` of what it retries). ``error`` is raised again if none is left."""

    def __init__(self, reason: str, *, delay_s: float, error: Exception) -> None:
        super().__init__(reason)
        self.reason, self.delay_s, self.error = reason, delay_s, error

    def __repr__(self) -> str:
        return f"Scheduled({self.reason!r})"


def _hand_over(decide: Callable[[Exception], Scheduled | None], err: Exception) -> NoReturn:
    """To stamina: the stand-in of an error to retry, else the error itself (no retry)."""
    scheduled = decide(err)
    if scheduled is None:
        raise err
    raise scheduled from None


def _scheduled_delay(err: BaseException) -> bool | float:
    return err.delay_s if isinstance(err, Scheduled) else False


@dataclass(kw_only=True)
class Retrier:
    """Runs a call under a ``RetryPolicy``, reporting every retry to ``observer``, its reason
    passed through ``redact`` first (give it the redactor of the trail: ``redactor.text``)."""

    policy: RetryPolicy = field(default_factory=RetryPolicy)
    observer: Observer = ignore
    clock: Clock = field(default_factory=SystemClock)
    rng: random.Random = field(default_factory=random.Random)
    redact: StringProcessor = redact_tokens

    def _decider(
        self, subject: str, transient: Callable[[BaseException], bool]
    ) -> Callable[[Exception], Scheduled | None]:
        deadline = self.clock.monotonic() + self.policy.deadline_s
        attempt = 0

        def decide(err: Exception) -> Scheduled | None:
            nonlocal attempt
            attempt += 1
            if attempt >= self.policy.attempts or not transient(err):
                return None
            after = getattr(err, "retry_after", None)
            delay = float(after) if after is not None else self.policy.backoff(attempt, self.rng)
            if self.clock.monotonic() + delay > deadline:
                return None
            reason = self.redact(f"{type(err).__name__}: {err}")
            self.observer(RetryScheduled(subject=subject, attempt=attempt, delay_s=delay, reason=reason))
            return Scheduled(reason, delay_s=delay, error=err)

        return decide

    def call(
        self, subject: str, fn: Callable[[], T], *, transient: Callable[[BaseException], bool] = is_transient
    ) -> T:
        """Run ``fn``, again after each failure ``transient`` accepts, within the policy."""
        decide = self._decider(subject, transient)
        try:
            for attempt in stamina.retry_context(
                on=_scheduled_delay, attempts=self.policy.attempts, timeout=None
            ):
                with attempt:
                    try:
                        return fn()
                    except Exception as err:
                        _hand_over(decide, err)
        except Scheduled as last:  # stamina's test mode ran out of attempts first
            error = last.error
        raise error

    async def acall(
        self,
        subject: str,
        fn: Callable[[], Awaitable[T]],
        *,
        transient: Callable[[BaseException], bool] = is_transient,
    ) -> T:
        """``call`` for coroutines."""
        decide = self._decider(subject, transient)
        try:
            async for attempt in stamina.retry_context(
                on=_scheduled_delay, attempts=self.policy.attempts, timeout=None
            ):
                with attempt:
                    try:
                        return await fn()
                    except Exception as err:
                        _hand_over(decide, err)
        except Scheduled as last:  # stamina's test mode ran out of attempts first
            error = last.error
        raise error


class RetryingInstance(WrapperInstance):
    """Retries reads after transient failures; side-effecting ops only when the caller lists
    them in ``idempotent`` (e.g. ``(WriteFile, MakeDir)``). Commands are never retried here."""

    def __init__(
        self, wrapped: Instance, retrier: Retrier, *, idempotent: tuple[type[Op[Any]], ...] = ()
    ) -> None:
        super().__init__(wrapped)
        self.retrier = retrier
        self.retried_ops = READ_OPS + idempotent

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        if isinstance(op, self.retried_ops):
            return self.retrier.call(
                f"{self.tier}:{type(op).__name__}", lambda: self.wrapped.handle(op, sink)
            )
        return self.wrapped.handle(op, sink)


class RetryingBackend(WrapperBackend):
    """Sandbox creation is idempotent: a start that fails transiently is tried again."""

    def __init__(
        self, wrapped: Backend, retrier: Retrier, *, idempotent: tuple[type[Op[Any]], ...] = ()
    ) -> None:
        super().__init__(wrapped)
        self.retrier = retrier
        self.idempotent = idempotent

    def start(self, spec: SandboxSpec) -> RetryingInstance:
        instance = self.retrier.call(f"{self.tier}:start", lambda: self.wrapped.start(spec))
        return RetryingInstance(instance, self.retrier, idempotent=self.idempotent)


class AsyncRetryingInstance(AsyncInstance):
    """The async twin of ``RetryingInstance``: the same ops are retried, with stamina's async
    loop (its waits are ``asyncio.sleep``, so the event loop stays free while backing off)."""

    def __init__(
        self, inner: AsyncInstance, retrier: Retrier, *, idempotent: tuple[type[Op[Any]], ...] = ()
    ) -> None:
        self.inner = inner
        self.retrier = retrier
        self.retried_ops = READ_OPS + idempotent
        self.id = inner.id
        self.tier = inner.tier
        self.enforcement = inner.enforcement
        self.started_from = inner.started_from

    async def ahandle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        if isinstance(op, self.retried_ops):
            return await self.retrier.acall(
                f"{self.tier}:{type(op).__name__}", lambda: self.inner.ahandle(op, sink)
            )
        return await self.inner.ahandle(op, sink)

    async def aclose(self) -> None:
        await self.inner.aclose()

    @property
    def alive(self) -> bool:
        return self.inner.alive


class AsyncRetryingBackend(AsyncBackend):
    """The async twin of ``RetryingBackend``: a start that fails transiently is tried again."""

    def __init__(
        self, inner: AsyncBackend, retrier: Retrier, *, idempotent: tuple[type[Op[Any]], ...] = ()
    ) -> None:
        self.inner = inner
        self.retrier = retrier
        self.idempotent = idempotent
        self.tier = inner.tier

    async def astart(self, spec: SandboxSpec) -> AsyncRetryingInstance:
        instance = await self.retrier.acall(f"{self.tier}:start", lambda: self.inner.astart(spec))
        return AsyncRetryingInstance(instance, self.retrier, idempotent=self.idempotent)


@dataclass(frozen=True, kw_only=True)
class TestRun:
    """The outcome of a test command; ``reran`` says it was run twice, ``first`` is the first try."""

    __test__ = False  # not a pytest class

    result: CommandResult
    reran: bool = False
    first: CommandResult | None = None

    @property
    def flaky(self) -> bool:
        """Failed, then passed: the result is green, and the report must say so."""
        return self.reran and self.result.ok


def run_tests_allowing_flaky(
    run: Callable[[], CommandResult],
    *,
    allow_flaky: bool,
    subject: str = "run_tests",
    observer: Observer = ignore,
) -> TestRun:
    """Run a test command; when it fails and the caller accepts flakiness, run it once more."""
    first = run()
    if first.ok or not allow_flaky:
        return TestRun(result=first)
    second = run()
    observer(FlakyRerun(subject=subject, first_exit_code=first.exit_code, second_exit_code=second.exit_code))
    return TestRun(result=second, reran=True, first=first)
