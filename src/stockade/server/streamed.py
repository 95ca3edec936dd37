"""A command or ``run_code`` streamed as NDJSON while it runs: its output, then its result.

A worker thread runs the call and puts what it prints in an ``Outbox``; the event loop takes
it out and sends it, one line at a time. Everything the outbox holds for its client counts
against the tenant's ``bodies_mb`` (``server/held.py``) until it is sent: the output waiting
(at most ``STREAM_BUFFER_CHARS`` a stream, less when the share is full: what does not fit is
left out of the stream and the gap marked), and the result line (all of the output again),
from when the call ends. Forty streams whose clients read nothing had held 17.7 MB each,
outside any share, once their calls had given back their places.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
from fastapi.encoders import jsonable_encoder
from fastapi.responses import StreamingResponse

from stockade import exceptions as exc
from stockade.server.calls import CutOnLeave, RunningCalls
from stockade.server.deps import recheck
from stockade.server.held import HeldBytes, held_bytes
from stockade.server.problems import from_error

if TYPE_CHECKING:
    from fastapi import Request

    from stockade.server.tenants import Principal, Tenant

__all__ = ["RECHECK_S", "STREAM_BUFFER_CHARS", "Outbox", "streamed"]

# What a streamed call's printed output may hold in this process while its client reads slower
# than the call prints (characters of text; a character is at most 4 bytes in memory).
STREAM_BUFFER_CHARS = 1 << 20

# How often a stream asks whether its token still stands (as the run events' stream does).
RECHECK_S = 1.0

# The streamed calls running, kept until they end: a stream cut by its token's end, or never
# read (its client gone before its first line), runs on to its deadline unread.
_streaming: set[asyncio.Future[None]] = set()


def line(kind: str, payload: Any) -> bytes:
    """One NDJSON line of a stream."""
    if kind in ("stdout", "stderr"):
        shaped: dict[str, Any] = {"type": kind, "data": payload}
    elif kind == "skipped":
        shaped = {"type": "skipped", **payload}
    elif kind == "result":
        shaped = {"type": "result", "result": payload}
    else:
        shaped = {"type": "error", "problem": payload}
    return json.dumps(jsonable_encoder(shaped), ensure_ascii=False).encode() + b"\n"


class Outbox:
    """The lines a streamed call has for its client and not yet sent: a worker thread puts,
    the event loop takes. Output past ``STREAM_BUFFER_CHARS`` waiting, or past what the
    tenant's ``bodies_mb`` has left, is left out of the stream, counted, and the gap marked by
    a ``{"type": "skipped", "stdout": N, "stderr": M}`` line (characters) where the stream goes
    on, or before the result; the result still holds all of the output (up to
    ``output_bytes``).

    Dropped, not waited for: the sandbox's supervisor sends a command's output as it comes (up
    to output_bytes) over the one channel all of the sandbox's calls share, whose reader
    cannot stop for one call; a worker held back here would only move the same bytes into the
    channel's queue for that call, keep the sandbox busy, and run the call past its deadline
    (which takes the sandbox down). Never waiting also means nothing a sandbox sends can pile
    up behind a client that reads nothing. ``close`` gives back what is still in it."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        held: HeldBytes,
        tenant: Tenant,
        limit: int = STREAM_BUFFER_CHARS,
    ) -> None:
        self._loop = loop
        self._held = held
        self._tenant = tenant
        self._limit = limit
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._lock = threading.Lock()
        self._waiting = 0  # characters of output in the queue, counted against the share
        self._skipped = {"stdout": 0, "stderr": 0}  # since the last mark
        self._closed = False  # the loop's: nothing more is queued, what comes is given back

    def _send(self, item: tuple[str, Any]) -> None:
        self._loop.call_soon_threadsafe(self._arrive, item)

    def _arrive(self, item: tuple[str, Any]) -> None:
        if self._closed:  # its stream is over: what it held goes back
            self._let_go(item)
        else:
            self._queue.put_nowait(item)

    def _let_go(self, item: tuple[str, Any]) -> None:
        kind, payload = item
        if kind in ("stdout", "stderr"):
            with self._lock:
                self._waiting -= len(payload)
            self._held.give_back(self._tenant, len(payload))
        elif kind == "result":
            payload[1].release()

    def _gap(self) -> dict[str, int] | None:
        with self._lock:
            gap, self._skipped = self._skipped, {"stdout": 0, "stderr": 0}
        return gap if any(gap.values()) else None

    def output(self, kind: str, text: str) -> None:
        """From the worker thread: one piece of output, or left out when too much waits."""
        with self._lock:
            fits = self._waiting + len(text) <= self._limit
            if fits:
                try:
                    self._held.take(self._tenant, len(text), what="a stream's output")
                except exc.QuotaExceeded:
                    fits = False
            if not fits:
                self._skipped[kind] += len(text)
                return
            self._waiting += len(text)
        gap = self._gap()
        if gap is not None:
            self._send(("skipped", gap))
        self._send((kind, text))

    def end(self, kind: str, payload: Any) -> None:
        """The result (its line and its ``Hold``) or the problem: always sent, after any gap."""
        gap = self._gap()
        if gap is not None:
            self._send(("skipped", gap))
        self._send((kind, payload))

    async def take(self) -> tuple[str, Any]:
        kind, payload = await self._queue.get()
        if kind in ("stdout", "stderr"):
            with self._lock:
                self._waiting -= len(payload)
            self._held.give_back(self._tenant, len(payload))
        return kind, payload

    def close(self) -> None:
        """From the loop, once the stream is over: what is queued, and what comes, goes back."""
        self._closed = True
        while not self._queue.empty():
            self._let_go(self._queue.get_nowait())


async def _fed(outbox: Outbox, request: Request, caller: Principal, call: Awaitable[bytes]) -> None:
    """``call``'s result line, held against the tenant's share (an error line past it), or its
    error, as the last of ``outbox``."""
    try:
        result = await call
        try:
            hold = held_bytes(request).hold(caller.tenant, len(result), what="the result of a call that ran")
        except exc.QuotaExceeded as error:
            outbox.end("error", from_error(error, request.url.path).body)
        else:
            outbox.end("result", (result, hold))
    except exc.StockadeError as error:
        outbox.end("error", from_error(error, request.url.path).body)
    except BaseException as error:  # never leave the stream hanging
        problem = from_error(exc.StockadeError(f"internal error: {type(error).__name__}"), request.url.path)
        outbox.end("error", problem.body)
        if not isinstance(error, Exception):
            raise


def streamed(
    request: Request,
    caller: Principal,
    calls: RunningCalls,
    work: Callable[[Callable[[str], object], Callable[[str], object]], dict[str, Any]],
) -> StreamingResponse:
    """Run ``work(on_stdout, on_stderr)`` in a thread as one of the caller's ``calls`` and
    stream what it prints, then its result. A token taken out or given another role meanwhile
    reads no further: the stream ends with an error line within ``RECHECK_S`` (and the result
    is asked for afresh), and the call runs on to its end (a
    sandbox is its tenant's, not a token's), its output left unread. A client that goes has
    its call cut in the sandbox (``CutOnLeave``)."""
    outbox = Outbox(asyncio.get_running_loop(), held_bytes(request), caller.tenant)
    leave = CutOnLeave(request)

    def push(kind: str) -> Callable[[str], object]:
        return lambda text: outbox.output(kind, text)

    def run() -> bytes:  # the result's line is encoded in the worker: all of the output again
        return line("result", work(push("stdout"), push("stderr")))

    calls.take(caller.tenant)  # refused here, as a 429, before the stream starts
    # started now, not when the body is first read: the place just taken is given back when
    # the call ends, even if the response is never sent
    task = asyncio.ensure_future(_fed(outbox, request, caller, leave.run(run)))
    _streaming.add(task)
    task.add_done_callback(_streaming.discard)
    task.add_done_callback(lambda _: calls.give_back(caller.tenant))

    async def lines() -> AsyncIterator[bytes]:
        checked, ended = time.monotonic(), False
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(outbox.take(), RECHECK_S)
                except TimeoutError:  # nothing printed for a while: the token is asked all the same
                    kind, payload = "", None
                if kind != "result" and time.monotonic() - checked >= RECHECK_S:
                    checked = time.monotonic()
                    try:
                        await anyio.to_thread.run_sync(lambda: recheck(request, caller))
                    except exc.AuthenticationError as error:
                        yield line("error", from_error(error, request.url.path).body)
                        return
                if not kind:
                    continue
                if kind == "result":
                    result, hold = payload
                    try:  # what it holds goes back however this ends (a client gone mid-check too)
                        # the result (all of the output again) is never sent on an old check
                        try:
                            await anyio.to_thread.run_sync(lambda: recheck(request, caller))
                        except exc.AuthenticationError as error:
                            yield line("error", from_error(error, request.url.path).body)
                            return
                        yield result  # back here once the server has handed it to the socket
                    finally:
                        hold.release()
                    ended = True
                    break
                yield line(kind, payload)
                if kind == "error":
                    ended = True
                    break
        finally:
            outbox.close()
            # one that did not end (its token's end, its client gone) is not awaited, the
            # response being over: _streaming keeps it until it ends
            if ended:
                await task

    return StreamingResponse(lines(), media_type="application/x-ndjson")
