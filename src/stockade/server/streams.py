"""The event streams a tenant holds open at once (``/v1/runs/{id}/events``, the viewer's
``/ui/runs/{id}/events``): each one polls the database while it is open, so one tenant's
thousands of them would slow every other tenant's requests. A tenant has
``ServiceConfig.max_streams`` of them in one API process; one more is refused (429,
``Retry-After``) until one ends or its client goes."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterable

from stockade import exceptions as exc
from stockade.server.held import HeldResponse

__all__ = ["HeldStream", "StreamSlot", "StreamSlots"]

RETRY_S = 5.0  # what a refused client is told to wait: a stream ends when its run pauses or ends


class StreamSlot:
    """One open stream of ``key``; ``release`` gives it back (once, however often called)."""

    def __init__(self, slots: StreamSlots, key: str) -> None:
        self._slots = slots
        self.key = key
        self._held = True
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._slots._give_back(self.key)


class StreamSlots:
    """At most ``per_key`` slots taken per key (a tenant) in this process."""

    def __init__(self, per_key: int) -> None:
        if per_key < 1:
            raise exc.InvalidArgument(
                f"max_streams must be at least 1, not {per_key}",
                argument="max_streams",
                fix="give how many event streams a tenant may hold open at once (e.g. 16)",
            )
        self.per_key = per_key
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, key: str, *, who: str) -> StreamSlot:
        """``RateLimited`` when ``key`` holds ``per_key`` streams already."""
        with self._lock:
            held = self._open.get(key, 0)
            if held >= self.per_key:
                raise exc.RateLimited(
                    f"{who} has {held} event streams open, its most at once: close one (a stream "
                    "ends by itself when its run pauses or ends)",
                    key=f"streams:{key}",
                    retry_after=RETRY_S,
                )
            self._open[key] = held + 1
        return StreamSlot(self, key)

    def held(self, key: str) -> int:
        with self._lock:
            return self._open.get(key, 0)

    def _give_back(self, key: str) -> None:
        with self._lock:
            left = self._open.get(key, 0) - 1
            if left > 0:
                self._open[key] = left
            else:
                self._open.pop(key, None)


class HeldStream(HeldResponse):
    """An event stream that holds ``slot`` for as long as it is served (``HeldResponse``)."""

    def __init__(
        self, content: AsyncIterable[bytes], *, slot: StreamSlot, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(content, hold=slot, media_type="text/event-stream", headers=headers)
        self.slot = slot
