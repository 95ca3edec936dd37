"""Cutting a call that runs in a worker thread, as a Ctrl-C cuts one in the main thread.

``AsyncSandbox`` runs each blocking call in a worker thread, which no signal interrupts.
When the task awaiting it is cancelled, the event loop ``request``s the call's ``Cut``
(carried into the thread by a context variable) and waits for the thread to end: the call's
next wait for the supervisor raises ``Interrupted`` there, once, so the same clean-up paths
as a ``KeyboardInterrupt``'s run (a staged write aborted, the running job cancelled inside)
before the task's ``CancelledError`` goes on.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from typing import Any

__all__ = ["CUT", "Cut", "Interrupted"]


class Interrupted(BaseException):
    """Raised in a worker thread whose awaiting task was cancelled: control flow, not an
    error (as ``KeyboardInterrupt``); the task itself gets ``CancelledError``."""


class Cut:
    """One call's interruption, asked for from the event loop, delivered once in its thread:
    the clean-up requests after it must get their answers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[queue.SimpleQueue[Any], Any] = {}
        self.requested = False
        self._delivered = False
        self._finished = False

    def request(self) -> bool:
        """Ask for it: each wait in progress is woken up (and raises). True when the call had
        finished already: what it returned is the asker's to let go of."""
        with self._lock:
            self.requested = True
            waiting = list(self._waiting.items())
            finished = self._finished
        for q, wake in waiting:
            q.put(wake)
        return finished

    def finish(self) -> bool:
        """The call returned: True when it was asked to stop before, and what it returned is
        the thread's to let go of (no one takes it)."""
        with self._lock:
            self._finished = True
            return self.requested

    def watch(self, q: queue.SimpleQueue[Any], wake: Any) -> None:
        """``q`` is waited on: a request puts ``wake`` in it; raises if one came already."""
        with self._lock:
            self._waiting[q] = wake
        self.deliver()

    def forget(self, q: queue.SimpleQueue[Any]) -> None:
        with self._lock:
            self._waiting.pop(q, None)

    def deliver(self) -> None:
        """Raise ``Interrupted`` if asked and not raised yet."""
        with self._lock:
            due = self.requested and not self._delivered
            self._delivered = self._delivered or due
        if due:
            raise Interrupted


# The cut of the call this thread runs for a cancellable task; None in plain sync use.
CUT: contextvars.ContextVar[Cut | None] = contextvars.ContextVar("stockade_cut", default=None)
