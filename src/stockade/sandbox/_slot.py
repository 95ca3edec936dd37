"""One thing started ahead of need and held for the next taker: a spare sandbox
(``spare.py``), the microVM tier's QEMU started ahead (``_microvm_ahead.py``).

At most one is held, and at most one is being made (``begin`` ... ``put`` or ``done``). What
is put after ``close``, or while one is held, is refused (the maker discards it): nothing is
held once the slot is closed, and nothing is ever discarded twice.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Slot"]

T = TypeVar("T")


class Slot(Generic[T]):
    """``discard`` ends a held thing that nobody will take (dropped, or the slot closed)."""

    def __init__(self, discard: Callable[[T], None]) -> None:
        self._discard = discard
        self._lock = threading.Lock()
        self._held: T | None = None
        self._idle = threading.Event()  # set while nothing is being made
        self._idle.set()
        self.closed = False
        _slots.add(self)

    def _forked(self) -> None:
        """In a forked child: closed and idle, holding nothing, with a lock of its own (the
        parent's may have been copied held)."""
        self._lock = threading.Lock()
        self._held = None  # the parent's to take or discard
        self._idle = threading.Event()
        self._idle.set()
        self.closed = True

    def take(self) -> T | None:
        """The held thing, now the caller's; None if none."""
        with self._lock:
            held, self._held = self._held, None
        return held

    def peek(self) -> T | None:
        """The held thing, still held (for a look: another thread may take it meanwhile)."""
        return self._held

    @property
    def filling(self) -> bool:
        """Whether one is being made."""
        return not self._idle.is_set()

    def begin(self) -> bool:
        """Whether to make one now: none is held or being made, and the slot is open. True
        obliges the caller to end with ``put`` or ``done``."""
        with self._lock:
            if self.closed or self._held is not None or not self._idle.is_set():
                return False
            self._idle.clear()
            return True

    def put(self, thing: T) -> bool:
        """Hold ``thing`` (ending what ``begin`` began, if it did); False: refused (the slot is
        closed or holds one) and discarded here, before ``wait`` returns: one who closes the
        slot and waits knows that nothing made for it is left (a process that ends next must
        not leave a thing half made: a QEMU started ahead left its folder and cgroup)."""
        with self._lock:
            if not (self.closed or self._held is not None):
                self._held = thing
                self._idle.set()
                return True
        try:
            self._discard(thing)
        finally:
            self._idle.set()
        return False

    def done(self) -> None:
        """End what ``begin`` began without a thing (making it failed)."""
        self._idle.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is being made (or ``timeout``); whether one is held."""
        self._idle.wait(timeout)
        return self._held is not None

    def drop(self) -> None:
        """Discard the held thing, if any."""
        held = self.take()
        if held is not None:
            self._discard(held)

    def close(self) -> None:
        """Hold nothing from now on. Idempotent; one being made is refused when put."""
        with self._lock:
            self.closed = True
        self.drop()


# Every slot of the process, for the after-fork hook; weakly, so that a slot dies with its owner.
_slots: weakref.WeakSet[Slot[Any]] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for slot in list(_slots):
        slot._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
