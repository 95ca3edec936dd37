"""Circuit breakers: stop calling what keeps failing, try again after a cool-down.

CLOSED --(threshold consecutive failures)--> OPEN --(cooldown_s)--> HALF_OPEN
HALF_OPEN lets one trial call through: success closes, failure re-opens.
While open, calls are refused with ``CircuitOpen`` (retryable, ``retry_after`` = time left).
A caller's error (``StockadeError.caller_error``: a missing file, a wrong argument, a policy
denial) or a runtime refusal is not a failure of the thing behind the breaker.

A run's tool breakers (``tool:NAME``) are its own (``RunBreakers``): its tools work on its own
sandbox, so a tool failing in one run says nothing of another's (one MCP session reading five
missing files opened ``tool:read_file`` for every session). Providers' and backends' breakers
are shared by every run.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from stockade.exceptions import CircuitOpen, RunStopped, RuntimeLimit, SandboxError, StockadeError
from stockade.runtime.clock import Clock, SystemClock
from stockade.runtime.events import BreakerChanged, BreakerState, Observer, ignore
from stockade.sandbox.base import (
    Backend,
    Instance,
    OpResult,
    OutputSink,
    SandboxSpec,
    WrapperBackend,
    WrapperInstance,
)
from stockade.sandbox.ops import Op

__all__ = [
    "BreakerConfig",
    "BreakerInstance",
    "Breakers",
    "BreakingBackend",
    "CircuitBreaker",
    "RunBreakers",
    "counts_as_failure",
    "sandbox_failure",
]

T = TypeVar("T")


def _callers(err: BaseException) -> bool:
    return isinstance(err, StockadeError) and err.caller_error


def counts_as_failure(err: BaseException) -> bool:
    """The caller's errors (denials, a missing file, a wrong argument), limits and run signals
    (a kill, a pause for approval) are no failure of the protected thing; anything else is."""
    return not isinstance(err, RuntimeLimit | RunStopped) and not _callers(err)


def sandbox_failure(err: BaseException) -> bool:
    """A failure of the backend itself, not of what the caller asked (a missing file is not)."""
    return isinstance(err, SandboxError | ConnectionError | TimeoutError) and not _callers(err)


@dataclass(frozen=True, kw_only=True)
class BreakerConfig:
    threshold: int = 5
    cooldown_s: float = 30.0


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        config: BreakerConfig | None = None,
        *,
        clock: Clock | None = None,
        observer: Observer = ignore,
    ) -> None:
        self.name = name
        self.config = config or BreakerConfig()
        self.clock = clock or SystemClock()
        self.observer = observer
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._trial_running = False

    @property
    def state(self) -> BreakerState:
        with self._lock:
            self._maybe_half_open()
            return self._state

    @property
    def failures(self) -> int:
        return self._failures

    def _move(self, new: BreakerState, reason: str = "") -> None:
        old, self._state = self._state, new
        if new is BreakerState.OPEN:
            self._opened_at = self.clock.monotonic()
        if old is not new:
            self.observer(
                BreakerChanged(name=self.name, old=old, new=new, failures=self._failures, reason=reason)
            )

    def _maybe_half_open(self) -> None:
        if self._state is BreakerState.OPEN and self._remaining() <= 0:
            self._move(BreakerState.HALF_OPEN, "cool-down over")

    def _remaining(self) -> float:
        return self._opened_at + self.config.cooldown_s - self.clock.monotonic()

    def before(self) -> None:
        """Refuse with ``CircuitOpen`` unless a call may go through now."""
        with self._lock:
            self._maybe_half_open()
            if self._state is BreakerState.CLOSED:
                return
            if self._state is BreakerState.HALF_OPEN and not self._trial_running:
                self._trial_running = True
                return
            wait = max(self._remaining(), 0.0) if self._state is BreakerState.OPEN else 1.0
            raise CircuitOpen(
                f"{self.name} is unavailable after {self._failures} consecutive failures; "
                f"retry in {wait:.1f}s",
                name=self.name,
                retry_after=wait,
            )

    def success(self) -> None:
        with self._lock:
            self._maybe_half_open()
            if self._state is BreakerState.OPEN:
                # A call that started before it opened (a slow one, or one in flight when the
                # anomaly monitor tripped it): the cool-down stands, only a trial closes it.
                return
            self._trial_running = False
            self._failures = 0
            self._move(BreakerState.CLOSED, "call succeeded")

    def failure(self, reason: str = "") -> None:
        with self._lock:
            self._trial_running = False
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN or self._failures >= self.config.threshold:
                self._move(BreakerState.OPEN, reason)

    def trip(self, reason: str) -> None:
        """Open now (the anomaly monitor's "open the breaker")."""
        with self._lock:
            self._trial_running = False
            self._move(BreakerState.OPEN, reason)

    def call(
        self,
        fn: Callable[[], T],
        *,
        failed: Callable[[T], bool] | None = None,
        error_counts: Callable[[BaseException], bool] = counts_as_failure,
    ) -> T:
        """Run ``fn`` through the breaker. ``error_counts`` says which errors are failures of the
        protected thing; ``failed`` marks a returned value as a failure too."""
        self.before()
        try:
            result = fn()
        except BaseException as err:
            if error_counts(err):
                self.failure(f"{type(err).__name__}: {err}")
            else:
                self.success_without_reset()
            raise
        if failed is not None and failed(result):
            self.failure("the call reported failure")
        else:
            self.success()
        return result

    async def acall(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        error_counts: Callable[[BaseException], bool] = counts_as_failure,
    ) -> T:
        """``call`` for coroutines."""
        self.before()
        try:
            result = await fn()
        except BaseException as err:
            if error_counts(err):
                self.failure(f"{type(err).__name__}: {err}")
            else:
                self.success_without_reset()
            raise
        self.success()
        return result

    def success_without_reset(self) -> None:
        """The call never reached the protected thing: release a half-open trial, count nothing."""
        with self._lock:
            self._trial_running = False


@dataclass(kw_only=True)
class Breakers:
    """One breaker per name ("tool:run_code", "model:gpt-x", "backend:process"), made on demand."""

    config: BreakerConfig = field(default_factory=BreakerConfig)
    clock: Clock = field(default_factory=SystemClock)
    observer: Observer = ignore
    _made: dict[str, CircuitBreaker] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, name: str) -> CircuitBreaker:
        with self._lock:
            found = self._made.get(name)
            if found is None:
                found = CircuitBreaker(name, self.config, clock=self.clock, observer=self.observer)
                self._made[name] = found
            return found

    def states(self) -> dict[str, BreakerState]:
        with self._lock:
            made = dict(self._made)
        return {name: b.state for name, b in made.items()}


@dataclass(kw_only=True)
class RunBreakers(Breakers):
    """One run's breakers: its tools' (``tool:NAME``) its own, every other name ``shared``'s."""

    shared: Breakers

    def get(self, name: str) -> CircuitBreaker:
        return super().get(name) if name.startswith("tool:") else self.shared.get(name)

    @classmethod
    def of(cls, shared: Breakers) -> RunBreakers:
        """A run's breakers, configured and observed as ``shared`` is."""
        return cls(config=shared.config, clock=shared.clock, observer=shared.observer, shared=shared)


class BreakerInstance(WrapperInstance):
    """Every op of a sandbox through the backend's breaker (a crash or a protocol error counts)."""

    def __init__(self, wrapped: Instance, breaker: CircuitBreaker) -> None:
        super().__init__(wrapped)
        self.breaker = breaker

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        return self.breaker.call(lambda: self.wrapped.handle(op, sink), error_counts=sandbox_failure)


class BreakingBackend(WrapperBackend):
    """A backend whose starts and ops go through the breaker ``backend:<tier>``."""

    def __init__(self, wrapped: Backend, breakers: Breakers) -> None:
        super().__init__(wrapped)
        self.breaker = breakers.get(f"backend:{wrapped.tier}")

    def start(self, spec: SandboxSpec) -> BreakerInstance:
        started = self.breaker.call(lambda: self.wrapped.start(spec), error_counts=sandbox_failure)
        return BreakerInstance(started, self.breaker)
