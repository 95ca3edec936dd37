"""Stockade's own worker threads: where its blocking calls run when driven from asyncio.

Never the event loop's default executor: that pool is the application's, and small
(``min(32, cpus + 4)`` threads: 6 on two cores). Six long commands filled it, so a quick call
on another sandbox, the application's own ``asyncio.to_thread`` and a cancelled call's clean-up
all queued behind them (an echo took 9.5 s, ``wait_for(..., 1)`` raised after 14.5 s), and an
``async def`` approver awaiting ``to_thread`` waited for a thread its own callers held: six
gathered approvals hung for good.

A thread per call, started when the call starts and ended with it: nothing queues, so no call
waits behind another; no thread outlives its call (no idle pool kept for the process's life,
none to restart after a ``fork``), and importing stockade starts none. A thread costs tens
of microseconds; a sandbox call is a round trip to another process, milliseconds at least.
The threads are not daemons: the interpreter exits only once each call has ended, as it
waits for the default executor's.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

__all__ = ["off_loop", "submit"]

P = ParamSpec("P")
R = TypeVar("R")


def submit(
    fn: Callable[..., R], *args: Any, daemon: bool = False, name: str = "stockade-call"
) -> concurrent.futures.Future[R]:
    """``fn(*args)`` in a thread of its own, started now. A cancel of the future that wins
    the race with the thread's start runs nothing (``Future.cancel`` then says True).
    ``daemon``: for a call its caller may give up waiting for (a source that never answers),
    which must not keep the interpreter from exiting."""
    future: concurrent.futures.Future[R] = concurrent.futures.Future()

    def work() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as error:  # an Interrupted, a KeyboardInterrupt: the awaiter's to see
            future.set_exception(error)
        else:
            future.set_result(result)

    threading.Thread(target=work, name=name, daemon=daemon).start()
    return future


async def off_loop(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``asyncio.to_thread(fn, *args, **kwargs)`` on stockade's threads (the caller's context
    variables seen there, as with ``to_thread``)."""
    import asyncio  # lazily: importing stockade must stay cheap

    context = contextvars.copy_context()
    return await asyncio.wrap_future(submit(context.run, functools.partial(fn, *args, **kwargs)))
