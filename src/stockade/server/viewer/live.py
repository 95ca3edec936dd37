"""A live run page's event stream (``changes``: "changed" as the run's trail grows, "end" once
it settled, waits or its session ended) and the thread a store's read runs on, off the event
loop (``blocking``). Apart from the routes, which hand the stream to ``HeldStream``.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import Request

from stockade import exceptions as exc
from stockade.server.viewer.values import SETTLED, RunSource

__all__ = ["POLL_S", "WAITING", "blocking", "changes"]

POLL_S = 0.5
# a run that waits for someone (an approval; a look at why its actions failed): its stream ends
# as the API's does, and the page comes back for it now and then (viewer.js)
WAITING = frozenset({"paused", "broken"})


async def blocking(function: Callable[[], Any]) -> Any:
    return await anyio.to_thread.run_sync(function)


def _look(still: Callable[[], None], source: RunSource, run_id: str, seq: int) -> tuple[int, str] | None:
    still()
    return source.changes(run_id, seq)


async def changes(
    request: Request, source: RunSource, still: Callable[[], None], run_id: str, after: int,
    status: str | None,
) -> AsyncIterator[bytes]:  # fmt: skip
    """``changed`` each time the run's trail grows or its status moves; ``end`` once it settled
    or waits (a paused run may wait for days: the page comes back for it, not this loop), or
    once ``still`` (asked at each poll) finds the session no longer valid: signed out,
    expired, its token taken out (``signed_out``; the page reloads, to the sign-in)."""
    seq = after
    while True:
        try:
            changed = await blocking(functools.partial(_look, still, source, run_id, seq))
        except exc.AuthenticationError as error:
            yield f"event: end\ndata: {json.dumps({'signed_out': True, 'reason': str(error)})}\n\n".encode()
            return
        if changed is None:
            yield b"event: end\ndata: {}\n\n"
            return
        last, now = changed
        if last != seq or now != status:
            seq, status = last, now
            yield f"event: changed\ndata: {json.dumps({'seq': seq, 'status': status})}\n\n".encode()
        elif now in SETTLED or now in WAITING:
            waits = now in WAITING  # the page comes back later: a decision sends the run on
            ended = {"seq": seq, "status": status, "waits": waits}
            yield f"event: end\ndata: {json.dumps(ended)}\n\n".encode()
            return
        if await request.is_disconnected():
            return
        await asyncio.sleep(POLL_S)
