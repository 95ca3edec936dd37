"""A blocking context manager around a coroutine, with the event loop kept free.

``await run_within(opened, body)`` is ``with opened as value: return await body(value)`` where
entering and exiting ``opened`` (a sandbox started and seeded, closed, a trail flushed) run in
worker threads. What entering sets in the context (context variables: the session's observer,
the watched kill switch) is what ``body`` and the exit see, as in the plain ``with``: the three
run in one context, one after the other, never at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from stockade._threads import submit

__all__ = ["run_within"]

T = TypeVar("T")
R = TypeVar("R")


async def run_within(
    opened: contextlib.AbstractContextManager[T], body: Callable[[T], Coroutine[Any, Any, R]]
) -> R:
    """``with opened as value: return await body(value)``, ``opened``'s enter and exit in worker
    threads. A cancellation while ``opened`` enters or exits waits for that thread to end (a
    sandbox half started would be left with nobody to close it), exits, then is raised; one
    while ``body`` runs cancels ``body`` as it would in the ``with``. ``opened`` must not
    suppress exceptions (none of ours does)."""
    context = contextvars.copy_context()
    entering = asyncio.wrap_future(submit(context.run, opened.__enter__))
    cancelled = await _wait_out(entering)
    if cancelled is not None:
        if entering.exception() is None:
            await _exit(context, opened, cancelled)
        raise cancelled
    try:
        # a task of its own only to run in ``context``: cancelling this one cancels it
        result = await asyncio.create_task(body(entering.result()), context=context)
    except BaseException as err:
        await _exit(context, opened, err)
        raise
    await _exit(context, opened, None)
    return result


async def _exit(
    context: contextvars.Context, opened: contextlib.AbstractContextManager[Any], err: BaseException | None
) -> None:
    kind, trace = (type(err), err.__traceback__) if err else (None, None)
    exiting = asyncio.wrap_future(submit(context.run, opened.__exit__, kind, err, trace))
    cancelled = await _wait_out(exiting)
    exiting.result()  # what the exit raised
    if cancelled is not None:
        raise cancelled


async def _wait_out(work: asyncio.Future[Any]) -> asyncio.CancelledError | None:
    """Wait until ``work`` (a worker thread's) has ended, through cancellations of the task:
    the last one, for the caller to raise once it has undone what the work did."""
    cancelled = None
    while not work.done():
        try:
            await asyncio.wait((work,))
        except asyncio.CancelledError as err:
            cancelled = err
    return cancelled
