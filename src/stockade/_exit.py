"""The one exit hook for what a process left open: egress proxies closed, then audit logs
flushed.

Both hold records in memory that a daemon thread would write later (a proxy's observer is
told on its loop's next turn, a log writes in batches), and the interpreter freezes daemon
threads as it finalizes: without this, a program that ends (or dies of an exception) without
closing them loses the last records. The order is fixed here, whatever was imported or started
first: a proxy closed at exit tells its observer, which records into an audit log, so every
proxy closes before any log flushes. Not in a forked child: what it inherited is its parent's,
which finishes it. A ``SIGKILL`` loses them all the same.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import Protocol

__all__ = ["LOGS", "PROXIES", "LeftOpen", "forget", "keep"]

_log = logging.getLogger(__name__)


class LeftOpen(Protocol):
    def finish_at_exit(self) -> None:
        """Write or hand on what is held; raise nothing that matters to others."""


# The stages, in the order they run at exit.
PROXIES = 0  # closing one tells its observer what it held: an audit log, flushed after
LOGS = 1
_stages: tuple[weakref.WeakKeyDictionary[LeftOpen, int], ...] = (
    weakref.WeakKeyDictionary(),  # the object -> the pid that opened it
    weakref.WeakKeyDictionary(),
)
_lock = threading.Lock()


def keep(thing: LeftOpen, stage: int) -> None:
    """Finish ``thing`` at this process's exit, in ``stage``, unless it is ``forget``-ten."""
    with _lock:
        _stages[stage][thing] = os.getpid()


def forget(thing: LeftOpen, stage: int) -> None:
    """``thing`` was closed: nothing left for the exit."""
    with _lock:
        _stages[stage].pop(thing, None)


@atexit.register
def _finish_left_open() -> None:
    pid = os.getpid()
    for stage in _stages:
        with _lock:
            left = [thing for thing, opener in stage.items() if opener == pid]
        for thing in left:
            try:
                thing.finish_at_exit()
            except Exception:  # at exit, nobody is left to raise to: say it where it can be seen
                _log.exception("%r could not be finished at exit", thing)
