"""Signals for the commands that hold a sandbox.

A terminal's Ctrl-C (SIGINT), a service manager's SIGTERM and a closed terminal's SIGHUP all
mean "stop now": the command must still remove what it made (the sandbox's processes, its
mounts, cgroups and run folder), which only the ``with`` blocks that opened them can do. So
each of the three either raises ``Interrupted`` in the main thread, as Ctrl-C raises
``KeyboardInterrupt`` (``interruptible``), or calls back a command that stops more gently
(``on_stop``: ``stockade agent`` saves the run and interrupts it, to be resumed). What
removes a sandbox runs with them held (``held``, ``closed_whole``): a signal that cut a close
short would leave behind what it was removing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import FrameType
from typing import TypeVar

__all__ = [
    "STOP_SIGNALS",
    "Interrupted",
    "closed_whole",
    "exit_code",
    "held",
    "interruptible",
    "on_stop",
    "signal_name",
]

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def exit_code(signum: int) -> int:
    """What a shell reports for a process a signal stopped: 128 + the signal's number."""
    return 128 + signum


@contextlib.contextmanager
def _handlers(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may handle signals (a test runner's worker, an embedding app)
        return
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise ``Interrupted`` in the main thread for the block."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    with _handlers(handler):
        yield


@contextlib.contextmanager
def on_stop(stop: Callable[[int], None]) -> Iterator[list[int]]:
    """The first stop signal calls ``stop(signum)`` in a thread of its own (it may take a moment;
    the main thread keeps driving what it drives); a second one raises ``Interrupted``, for
    whoever will not wait. The list yielded holds the signals received."""
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        if len(received) > 1:
            raise Interrupted(signum)
        threading.Thread(target=stop, args=(signum,), name="stockade-stop", daemon=True).start()

    with _handlers(handler):
        yield received


@contextlib.contextmanager
def held() -> Iterator[list[int]]:
    """Stop signals are recorded, not acted on, for the block (a close, which they would cut
    short); the list yielded holds those received. Then the handlers before it are back."""
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    with _handlers(handler):
        yield received


@contextlib.contextmanager
def closed_whole(manager: AbstractContextManager[T]) -> Iterator[T]:
    """``manager`` (a sandbox, an agent), whose exit runs with stop signals ``held``: one that
    arrives then raises ``Interrupted`` once the exit is done, unless an exception (a first
    signal's ``Interrupted``) already leaves the block: that one goes on, as it was."""
    value = manager.__enter__()
    try:
        yield value
    except BaseException as error:
        with held() as late:
            suppressed = manager.__exit__(type(error), error, error.__traceback__)
        if not suppressed:
            raise
    else:
        with held() as late:
            manager.__exit__(None, None, None)
    if late:
        raise Interrupted(late[0])
