"""Rate limits, spend limits and per-run budgets.

Rolling windows live in a ``Window``: ``LocalWindow`` (exact, in memory, one process, reads
an injectable clock) or ``RedisWindow`` (shared by every process and host that points at the
same Redis, via the ``limits`` library's sliding-window counter). ``window_for(url)`` picks.
Money is counted in integer micro-dollars so that windows only ever add integers.

A limit is keyed: the key says who shares it (``run:<id>`` for one run, ``tenant:<name>`` for
every run of a tenant, in every process that reaches the same Redis). What a refusal does to
an agent run is the ``LimitGate``'s choice (``OnLimit``): wait for the window to free up, or
stop the run (``BudgetExceeded``). Either way the model is not asked again for nothing.
"""

from __future__ import annotations

import enum
import math
import threading
import time
import tomllib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from stockade.exceptions import BudgetExceeded, ConfigurationError, LimitWait, RateLimited
from stockade.models.pricing import DEFAULT_PRICES, Price
from stockade.runtime.clock import Clock, SystemClock, asleep
from stockade.runtime.events import LimitHit, Observer, ignore

if TYPE_CHECKING:
    from limits.strategies import SlidingWindowCounterRateLimiter

__all__ = [
    "Budget",
    "BudgetMeter",
    "LimitGate",
    "LocalWindow",
    "MeterState",
    "OnLimit",
    "RateLimit",
    "RedisWindow",
    "SpendLimit",
    "Verdict",
    "Window",
    "load_prices",
    "window_for",
]

MICRO = 1_000_000


@dataclass(frozen=True, kw_only=True)
class Verdict:
    allowed: bool
    used: int
    limit: int
    retry_after: float = 0.0


class Window(Protocol):
    """Costs per key over the last ``period_s`` seconds."""

    def hit(self, key: str, cost: int, *, limit: int, period_s: float) -> Verdict:
        """Record ``cost`` if it fits under ``limit``; refuse (recording nothing) if not."""

    def add(self, key: str, cost: int, *, limit: int, period_s: float) -> Verdict:
        """Record ``cost`` that was already incurred; ``allowed`` says whether more fits."""

    def peek(self, key: str, *, limit: int, period_s: float) -> Verdict:
        """Whether one more unit fits now."""


class LocalWindow:
    """An exact rolling window in this process."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or SystemClock()
        self._events: dict[str, deque[tuple[float, int]]] = {}
        self._lock = threading.Lock()

    def _used(self, key: str, period_s: float) -> tuple[deque[tuple[float, int]], int, float]:
        now = self.clock.monotonic()
        events = self._events.setdefault(key, deque())
        while events and events[0][0] <= now - period_s:
            events.popleft()
        return events, sum(c for _, c in events), now

    def _wait(self, events: deque[tuple[float, int]], excess: int, now: float, period_s: float) -> float:
        freed = 0
        for at, cost in events:
            freed += cost
            if freed >= excess:
                return max(at + period_s - now, 0.0)
        return period_s

    def hit(self, key: str, cost: int, *, limit: int, period_s: float) -> Verdict:
        with self._lock:
            events, used, now = self._used(key, period_s)
            if used + cost > limit:
                wait = self._wait(events, used + cost - limit, now, period_s)
                return Verdict(allowed=False, used=used, limit=limit, retry_after=wait)
            events.append((now, cost))
            return Verdict(allowed=True, used=used + cost, limit=limit)

    def add(self, key: str, cost: int, *, limit: int, period_s: float) -> Verdict:
        with self._lock:
            events, used, now = self._used(key, period_s)
            events.append((now, cost))
            used += cost
            if used >= limit:
                wait = self._wait(events, used - limit + 1, now, period_s)
                return Verdict(allowed=False, used=used, limit=limit, retry_after=wait)
            return Verdict(allowed=True, used=used, limit=limit)

    def peek(self, key: str, *, limit: int, period_s: float) -> Verdict:
        with self._lock:
            events, used, now = self._used(key, period_s)
            if used + 1 > limit:
                wait = self._wait(events, used + 1 - limit, now, period_s)
                return Verdict(allowed=False, used=used, limit=limit, retry_after=wait)
            return Verdict(allowed=True, used=used, limit=limit)


class RedisWindow:
    """A window shared through Redis (``limits``' sliding-window counter; wall-clock based)."""

    def __init__(self, url: str, *, namespace: str = "stockade") -> None:
        try:
            from limits.storage import storage_from_string
            from limits.strategies import SlidingWindowCounterRateLimiter
        except ModuleNotFoundError:
            raise ConfigurationError(
                'shared limits need Redis support: pip install "stockade[redis]"'
            ) from None
        self.url = url
        self.namespace = namespace
        self.storage = storage_from_string(url)
        self.limiter: SlidingWindowCounterRateLimiter = SlidingWindowCounterRateLimiter(self.storage)

    def _item(self, limit: int, period_s: float) -> object:
        from limits import RateLimitItemPerSecond

        return RateLimitItemPerSecond(limit, max(int(period_s), 1), namespace=self.namespace)

    def _verdict(self, allowed: bool, key: str, item: object, limit: int) -> Verdict:
        from limits import RateLimitItem

        assert isinstance(item, RateLimitItem)
        stats = self.limiter.get_window_stats(item, key)
        wait = 0.0 if allowed else max(stats.reset_time - time.time(), 0.0)
        return Verdict(allowed=allowed, used=limit - stats.remaining, limit=limit, retry_after=wait)

    def hit(self, key: str, cost: int, *, limit: int, period_s: float) -> Verdict:
        from limits import RateLimitItem

        item = self._item(limit, period_s)
        assert isinstance(item, RateLimitItem)
        return self._verdict(self.limiter.hit(item, key, cost=cost), key, item, limit)

    def add(self, key: str, cost: int, *, limit: int, period_s: float) -> Verdict:
        from limits import RateLimitItem

        item = self._item(limit, period_s)
        assert isinstance(item, RateLimitItem)
        if not self.limiter.hit(item, key, cost=cost):
            # The money is spent even though it does not fit: fill the window for everyone.
            remaining = self.limiter.get_window_stats(item, key).remaining
            if remaining > 0:
                self.limiter.hit(item, key, cost=remaining)
        return self._verdict(self.limiter.test(item, key, cost=1), key, item, limit)

    def peek(self, key: str, *, limit: int, period_s: float) -> Verdict:
        from limits import RateLimitItem

        item = self._item(limit, period_s)
        assert isinstance(item, RateLimitItem)
        return self._verdict(self.limiter.test(item, key, cost=1), key, item, limit)


def window_for(redis_url: str | None, *, clock: Clock | None = None) -> Window:
    """In memory for one process, or shared when a Redis URL is configured."""
    return RedisWindow(redis_url) if redis_url else LocalWindow(clock)


class RateLimit:
    """At most ``per_minute`` actions per key over a rolling minute; refuses with ``RateLimited``."""

    def __init__(
        self,
        *,
        per_minute: int,
        window: Window | None = None,
        name: str = "actions",
        observer: Observer = ignore,
        period_s: float = 60.0,
    ) -> None:
        if per_minute <= 0:
            raise ConfigurationError(f"RateLimit.per_minute must be > 0, got {per_minute}")
        self.per_minute = per_minute
        self.window = window or LocalWindow()
        self.name = name
        self.observer = observer
        self.period_s = period_s

    def take(self, key: str = "global") -> Verdict:
        """Count one action if it fits now; say so either way (nothing is reported)."""
        return self.window.hit(f"{self.name}:{key}", 1, limit=self.per_minute, period_s=self.period_s)

    def peek(self, key: str = "global") -> Verdict:
        """Whether one more action fits now (nothing counted, nothing reported)."""
        return self.window.peek(f"{self.name}:{key}", limit=self.per_minute, period_s=self.period_s)

    def describe(self, key: str) -> str:
        per = "minute" if self.period_s == 60.0 else f"{self.period_s:g} s"
        return f"{self.per_minute} {self.name} per {per} reached for {key!r}"

    def acquire(self, key: str = "global") -> None:
        """Count one action, or report the refusal and raise ``RateLimited``."""
        verdict = self.take(key)
        if verdict.allowed:
            return
        detail = self.describe(key)
        self.observer(LimitHit(kind="rate", key=key, detail=detail, retry_after=verdict.retry_after))
        raise RateLimited(
            f"{detail}; retry in {verdict.retry_after:.1f}s", key=key, retry_after=verdict.retry_after
        )


def load_prices(path: str | Path) -> dict[str, Price]:
    """An editable price table: ``[models."gpt-4.1"] input_per_mtok = 2.0  output_per_mtok = 8.0``
    in a TOML file, on top of ``DEFAULT_PRICES``."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    prices = dict(DEFAULT_PRICES)
    for name, entry in raw.get("models", {}).items():
        try:
            prices[name] = Price(
                input_per_mtok=float(entry["input_per_mtok"]),
                output_per_mtok=float(entry["output_per_mtok"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigurationError(
                f"{path}: models.{name}: needs numbers input_per_mtok and output_per_mtok ({err})"
            ) from None
    return prices


class SpendLimit:
    """At most ``dollars_per_hour`` per key over a rolling hour; refuses with ``BudgetExceeded``."""

    def __init__(
        self,
        *,
        dollars_per_hour: float,
        window: Window | None = None,
        observer: Observer = ignore,
        period_s: float = 3600.0,
    ) -> None:
        if not (0 < dollars_per_hour < math.inf):  # nan fails both: it limited nothing
            raise ConfigurationError(
                f"SpendLimit.dollars_per_hour must be finite and > 0, got {dollars_per_hour}"
            )
        self.limit = round(dollars_per_hour * MICRO)
        self.dollars_per_hour = dollars_per_hour
        self.window = window or LocalWindow()
        self.observer = observer
        self.period_s = period_s

    def describe(self, key: str, verdict: Verdict) -> str:
        spent = verdict.used / MICRO
        return f"spend ${spent:.4f} reached the limit of ${self.dollars_per_hour:.2f}/hour for {key!r}"

    def _refuse(self, key: str, verdict: Verdict) -> BudgetExceeded:
        detail = self.describe(key, verdict)
        self.observer(LimitHit(kind="spend", key=key, detail=detail, retry_after=verdict.retry_after))
        return BudgetExceeded(detail, kind="dollars_per_hour", retry_after=verdict.retry_after)

    def peek(self, key: str = "global") -> Verdict:
        """Whether more spending fits now (nothing is reported)."""
        return self.window.peek(f"spend:{key}", limit=self.limit, period_s=self.period_s)

    def check(self, key: str = "global") -> None:
        verdict = self.peek(key)
        if not verdict.allowed:
            raise self._refuse(key, verdict)

    def charge(self, dollars: float, key: str = "global") -> Verdict:
        """Count money already spent, never raising: what was paid for is used; the next
        ``check`` refuses once the window is full."""
        cost = max(round(dollars * MICRO), 0)
        return self.window.add(f"spend:{key}", cost, limit=self.limit, period_s=self.period_s)

    def record(self, dollars: float, key: str = "global") -> None:
        """Count money already spent; raise when it crossed the limit."""
        verdict = self.charge(dollars, key)
        if not verdict.allowed:
            raise self._refuse(key, verdict)


class OnLimit(enum.StrEnum):
    """What an agent run does when a limit refuses its next action."""

    WAIT = "wait"  # wait for the window to free up (the default for rate limits)
    STOP = "stop"  # end the run, status "budget" (the default for spend limits)


# A waiting run looks at its kill switch this often.
WAIT_SLICE_S = 0.5


@dataclass(kw_only=True)
class LimitGate:
    """Applies a limit to an agent's next action: through at once, after waiting for the window
    (``OnLimit.WAIT``; ``interrupted`` is called between slices of the wait, e.g. the kill
    switch's ``check``), or not at all: the run stops (``OnLimit.STOP``, ``BudgetExceeded``).
    With ``wait_in_place_s``, a wait longer than that is not waited here: the run stops
    resumable (``LimitWait``, "defer"), so that whoever runs it is free until the window frees.
    Each refusal is reported once (``LimitHit`` with the action taken)."""

    on_limit: OnLimit
    clock: Clock = field(default_factory=SystemClock)
    observer: Observer = ignore
    wait_in_place_s: float | None = None

    async def admit(
        self,
        *,
        kind: str,
        key: str,
        probe: Callable[[], Verdict],
        describe: Callable[[Verdict], str],
        interrupted: Callable[[], None] | None = None,
    ) -> None:
        """``probe`` answers whether the action may go now (and counts it when it may)."""
        verdict = probe()
        if verdict.allowed:
            return
        detail = describe(verdict)
        wait = max(verdict.retry_after, 0.0)
        action = "defer" if self._defers(wait) else self.on_limit.value
        self.observer(LimitHit(kind=kind, key=key, detail=detail, retry_after=wait, action=action))
        if self.on_limit is OnLimit.STOP:
            what = "rate_per_minute" if kind == "rate" else "dollars_per_hour"
            raise BudgetExceeded(f"{detail}; the run stops (on_limit=stop)", kind=what, retry_after=wait)
        while not verdict.allowed:
            if self._defers(verdict.retry_after):  # at first, or another run took the window meanwhile
                again = verdict.retry_after
                raise LimitWait(
                    f"{describe(verdict)}; the run waits off its worker, again in {again:.0f} s",
                    kind=kind, key=key, retry_after=again,
                )  # fmt: skip
            left = max(verdict.retry_after, 0.01)
            while left > 0:  # in slices, so that a kill stops the wait
                if interrupted is not None:
                    interrupted()
                chunk = min(left, WAIT_SLICE_S)
                await asleep(self.clock, chunk)
                left -= chunk
            verdict = probe()

    def _defers(self, wait: float) -> bool:
        return (
            self.on_limit is OnLimit.WAIT and self.wait_in_place_s is not None and wait > self.wait_in_place_s
        )


@dataclass(frozen=True, kw_only=True)
class Budget:
    """Per-run ceilings; ``None`` means unbounded."""

    max_steps: int | None = None
    max_wall_s: float | None = None
    max_tokens: int | None = None
    max_dollars: float | None = None


@dataclass(frozen=True, kw_only=True)
class MeterState:
    """What a run has used so far: saved with the run's checkpoint, restored on resume."""

    steps: int = 0
    tokens: int = 0
    dollars: float = 0.0
    elapsed_s: float = 0.0


@dataclass(kw_only=True)
class BudgetMeter:
    budget: Budget
    clock: Clock = field(default_factory=SystemClock)
    observer: Observer = ignore
    steps: int = 0
    tokens: int = 0
    dollars: float = 0.0
    _started: float = field(default=-1.0, repr=False)
    _offset: float = 0.0

    def __post_init__(self) -> None:
        self._started = self.clock.monotonic()

    @classmethod
    def resume(cls, budget: Budget, state: MeterState, *, clock: Clock | None = None) -> BudgetMeter:
        meter = cls(budget=budget, clock=clock or SystemClock())
        meter.steps, meter.tokens, meter.dollars, meter._offset = (
            state.steps,
            state.tokens,
            state.dollars,
            state.elapsed_s,
        )
        return meter

    @property
    def elapsed_s(self) -> float:
        return self._offset + self.clock.monotonic() - self._started

    def state(self) -> MeterState:
        return MeterState(
            steps=self.steps, tokens=self.tokens, dollars=self.dollars, elapsed_s=self.elapsed_s
        )

    def step(self) -> None:
        """Count one step (checked first: step N+1 of a budget of N is refused)."""
        self.check(next_step=True)
        self.steps += 1

    def charge(self, *, tokens: int = 0, dollars: float = 0.0) -> None:
        self.tokens += tokens
        self.dollars += dollars

    def check(self, *, next_step: bool = False) -> None:
        b = self.budget
        over: tuple[str, str] | None = None
        if b.max_steps is not None and self.steps + (1 if next_step else 0) > b.max_steps:
            over = ("steps", f"{b.max_steps} steps")
        elif b.max_wall_s is not None and self.elapsed_s >= b.max_wall_s:
            over = ("wall_time", f"{b.max_wall_s:g}s of wall time")
        elif b.max_tokens is not None and self.tokens >= b.max_tokens:
            over = ("tokens", f"{b.max_tokens} tokens (used {self.tokens})")
        elif b.max_dollars is not None and self.dollars >= b.max_dollars:
            over = ("dollars", f"${b.max_dollars:.2f} (spent ${self.dollars:.4f})")
        if over is not None:
            kind, what = over
            self.observer(LimitHit(kind="budget", key=kind, detail=f"run budget of {what} is spent"))
            raise BudgetExceeded(f"the run's budget of {what} is spent", kind=kind)
