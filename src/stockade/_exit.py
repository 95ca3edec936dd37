"""The one exit hook for what a process left open: egress proxies closed, then audit logs
flushed.

Both hold records in memory that a daemon thread would write later (a proxy's observer is
told on its loop's next turn, a log writes in batches), and the interpreter freezes daemon
threads as it finalizes: without this, a program that ends (or dies of an exception) without
closing them loses the last records. The order is fixed here, whatever was imported or started
first: a proxy closed at exit tells its observer, which records into an audit log, so every
proxy closes before any log flushes. Not in a forked child: what it inherited is its parent's,
which finishes it. A ``SIGKILL`` loses them all the same.

``finalize`` is ``weakref.finalize`` under the same rule, for what ends a host resource (a
sandbox, a spare, a template, a QEMU started ahead): a forked child inherits the finalizers,
and its exit would otherwise run them, killing its parent's sandboxes. A ``weakref.finalize``
is spent once called: an end cut short (a Ctrl-C while a container is removed) would never
run again, so one that raises is kept and run again at exit; ``undo`` does the same for the
clean-up of a start that failed. Ends are written to run twice.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVarTuple

__all__ = ["LOGS", "PROXIES", "LeftOpen", "finalize", "forget", "keep", "undo"]

Ts = TypeVarTuple("Ts")

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
# Ends that raised (were interrupted): the pid that owns them -> run again at exit.
_unfinished: list[tuple[int, Callable[..., object], tuple[object, ...]]] = []


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
    with _lock:
        unfinished = [(end, args) for opener, end, args in _unfinished if opener == pid]
        _unfinished.clear()
    for end, args in unfinished:
        try:
            end(*args)
        except Exception:
            _log.exception("%r could not be finished at exit", end)


def finalize(owner: object, end: Callable[[*Ts], object], *args: *Ts) -> weakref.finalize[Any, Any]:
    """``weakref.finalize(owner, end, *args)`` whose ``end`` runs only in this process: called,
    collected or at exit in a forked child, it does nothing (the parent ends its own)."""
    return weakref.finalize(owner, _in_opener, os.getpid(), end, *args)


def undo(end: Callable[[*Ts], object], *args: *Ts) -> None:
    """``end(*args)`` now; if it raises (an interrupt, or a failure), once more at exit."""
    try:
        end(*args)
    except BaseException:
        with _lock:
            _unfinished.append((os.getpid(), end, args))
        raise


def _in_opener(opener: int, end: Callable[..., object], *args: object) -> None:
    if os.getpid() == opener:
        undo(end, *args)
