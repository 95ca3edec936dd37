"""Time, injectable: every runtime control reads a ``Clock`` so tests can move time by hand."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Protocol

__all__ = ["Clock", "ManualClock", "SystemClock", "asleep"]


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    async def asleep(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)


class ManualClock:
    """A clock that moves only when told to; ``sleep`` advances it instead of waiting."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()
        self.slept: list[float] = []

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.advance(max(seconds, 0.0))

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


async def asleep(clock: Clock, seconds: float) -> None:
    """Wait on ``clock`` without holding up the event loop (a clock of your own without an
    ``asleep`` method sleeps in a worker thread)."""
    native = getattr(clock, "asleep", None)
    if native is not None:
        await native(seconds)
    else:
        await asyncio.to_thread(clock.sleep, seconds)
