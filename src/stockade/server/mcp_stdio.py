"""``stockade mcp`` over stdio: the one client on this process's stdin and stdout.

Apart from the protocol (``mcp_face``) and from HTTP (``mcp_http``): the SDK's stdio transport
reads a line whole, so stdin reaches it through a bounded reader, on a descriptor of its own,
waited on by the event loop so that a stop signal ends the wait; and it reads on whether or not
its answers are taken, so what it hands the server is read only while few requests wait for
their answers (``_InFlight``), counted by what they take parsed (``mcp_cost``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import stat
import sys
from collections.abc import Iterator
from typing import Any, BinaryIO, cast

import anyio
import mcp_types as types
from mcp.shared.message import ServerMessageMetadata, SessionMessage

from stockade import exceptions as exc
from stockade.server.mcp_cost import message_cost, too_costly
from stockade.server.mcp_face import MAX_MESSAGE_BYTES, McpFace

__all__ = ["MAX_HELD_BYTES", "MAX_HELD_REQUESTS", "serve_stdio"]

# Requests read from stdin and not answered yet, and what they take parsed (``message_cost``):
# past either, stdin waits
MAX_HELD_REQUESTS = 32
MAX_HELD_BYTES = 64 << 20


async def serve_stdio(
    face: McpFace, *, max_message_bytes: int = MAX_MESSAGE_BYTES, max_held_requests: int = MAX_HELD_REQUESTS,
    max_held_bytes: int = MAX_HELD_BYTES,
) -> None:  # fmt: skip
    """Serve the one client on this process's stdin/stdout until it closes them. A message (a
    line) longer than ``max_message_bytes``, or that would take more than ``MAX_MESSAGE_COST``
    parsed, ends the session: ``RequestTooLarge`` once it has.

    Stdin is read while fewer than ``max_held_requests`` of the client's requests, taking
    fewer than ``max_held_bytes`` parsed, wait for their answers (twice as many while the
    server waits for the client's answer to a question of its own, which may come behind
    them)."""
    from mcp.server.stdio import stdio_server

    with _claimed_stdin() as wire:
        # the transport only iterates its stdin: it gets lines bounded before they are read whole
        bounded = _BoundedLines(wire, max_message_bytes)
        async with stdio_server(stdin=cast("anyio.AsyncFile[str]", bounded)) as (read, write):
            held = _InFlight(max_held_requests, max_held_bytes, sizes=bounded.sizes)
            # the protocol has stdout (taken above); a stray print (a library's log line) would
            # corrupt it, so from here stdout is stderr
            real, sys.stdout = sys.stdout, sys.stderr
            try:
                await face.server.run(
                    held.reading(read), held.writing(write), face.server.create_initialization_options()
                )
            finally:
                sys.stdout = real
    if bounded.refused is not None:
        # its answer could not be told apart from the message's next piece: the session ended
        raise exc.RequestTooLarge(
            f"{bounded.refused}: the session ended (over HTTP such a message is answered 413)",
            limit=max_message_bytes, fix="send smaller messages (a large file in pieces)",
        )  # fmt: skip


class _InFlight:
    """The client's requests read and not answered yet: the server's read waits while they are
    too many, so the transport's reader stops and stdin fills (the client's writes then wait).

    The SDK spawns a task per request as it reads it, and its transport reads on whatever the
    answers do: a client that sent requests and never read its answers grew the server by each
    one (2.4 GB after 787 requests of 3 MiB, 1.2 GB after 51,194 ``tools/list``) until the host
    ran out. A request weighs what it takes parsed, not its bytes: 64 MiB of 4 MiB lines of
    ``[{},{},...]`` held 1.9 GB. A request counts from its read until its answer is handed to
    the writer, or until it settles unanswered (cancelled by the client); notifications and
    the client's answers to the server's own requests are never held back. While the server
    waits for such an answer (an elicitation asking for an approval), twice the bound is read:
    the answer may come behind requests of the client's, and read no further it would not come
    at all (the call waits its whole ``--approval-wait``, then is denied)."""

    def __init__(self, max_requests: int, max_bytes: int, *, sizes: collections.deque[int]) -> None:
        self._max_requests = max_requests
        self._max_bytes = max_bytes
        self._sizes = sizes  # each line's cost, in the order its message is read
        self._held: dict[types.RequestId, list[int]] = {}  # by id: the cost of each request
        self._count = 0
        self._bytes = 0
        self._asked: set[types.RequestId] = set()  # the server's requests the client has to answer
        self._changed = anyio.Event()

    def room(self) -> bool:
        times = 2 if self._asked else 1
        return self._count < self._max_requests * times and self._bytes < self._max_bytes * times

    def reading(self, inner: Any) -> _Reading:
        return _Reading(inner, self)

    def writing(self, inner: Any) -> _Writing:
        return _Writing(inner, self)

    async def wait_for_room(self) -> None:
        while not self.room():
            changed = self._changed
            await changed.wait()

    def read(self, item: SessionMessage | Exception) -> SessionMessage | Exception:
        """Count ``item``, just read: a request is held (and told how it settles unanswered)."""
        size = self._sizes.popleft() if self._sizes else 0
        if not isinstance(item, SessionMessage):
            return item
        message = item.message
        if isinstance(message, types.JSONRPCResponse | types.JSONRPCError):
            self._discard_asked(message.id)
        if not isinstance(message, types.JSONRPCRequest) or item.metadata is not None:
            return item
        self._held.setdefault(message.id, []).append(size)
        self._count += 1
        self._bytes += size
        return SessionMessage(
            message,
            metadata=ServerMessageMetadata(on_request_unanswered=functools.partial(self._settle, message.id)),
        )

    def writing_request(self, message: types.JSONRPCMessage) -> None:
        if isinstance(message, types.JSONRPCRequest):
            self._asked.add(message.id)
            self._tell()
        elif isinstance(message, types.JSONRPCNotification) and message.method == "notifications/cancelled":
            # the server gave up on its request: no answer to it is waited for
            self._discard_asked((message.params or {}).get("requestId"))

    def written(self, message: types.JSONRPCMessage) -> None:
        if isinstance(message, types.JSONRPCResponse | types.JSONRPCError) and message.id is not None:
            self._release(message.id)

    async def _settle(self, request_id: types.RequestId) -> None:
        self._release(request_id)

    def _release(self, request_id: types.RequestId) -> None:
        sizes = self._held.get(request_id)
        if not sizes:
            return
        self._count -= 1
        self._bytes -= sizes.pop(0)
        if not sizes:
            del self._held[request_id]
        self._tell()

    def _discard_asked(self, request_id: object) -> None:
        if request_id in self._asked:
            self._asked.discard(request_id)
            self._tell()

    def _tell(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


class _Reading:
    """The transport's read stream, read only while ``_InFlight`` has room."""

    def __init__(self, inner: Any, held: _InFlight) -> None:
        self._inner = inner
        self._held = held

    @property
    def last_context(self) -> Any:  # the sender's context, which the SDK's loop reads
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> SessionMessage | Exception:
        await self._held.wait_for_room()
        return self._held.read(await self._inner.receive())

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> _Reading:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> _Reading:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _Writing:
    """The transport's write stream, telling ``_InFlight`` what is answered and asked."""

    def __init__(self, inner: Any, held: _InFlight) -> None:
        self._inner = inner
        self._held = held

    async def send(self, item: SessionMessage, /) -> None:
        self._held.writing_request(item.message)
        await self._inner.send(item)
        self._held.written(item.message)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _Writing:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _BoundedLines:
    """The lines of ``wire`` as text, each at most ``limit`` bytes and ``MAX_MESSAGE_COST``
    parsed; one past either ends them (``refused`` says why), never handed to the parser.

    A pipe, socket or terminal is waited on by the event loop and read only once it has bytes,
    so a stop signal cancels the wait: a thread blocked in ``readline`` could not be cancelled,
    and kept the process alive (ignoring SIGTERM) until the client closed stdin. A file (or
    anything not a descriptor) never blocks for long: it is read in a worker thread."""

    def __init__(self, wire: BinaryIO, limit: int) -> None:
        self._wire = wire
        self._limit = limit
        self._fd = _pollable(wire)
        self._buffer = bytearray()
        self._at_end = False
        self.refused: str | None = None
        # the cost of each line given, until its message is read (the transport makes one of each)
        self.sizes: collections.deque[int] = collections.deque()

    def __aiter__(self) -> _BoundedLines:
        return self

    async def __anext__(self) -> str:
        if self._fd is None:
            read = functools.partial(self._wire.readline, self._limit + 1)
            line = await anyio.to_thread.run_sync(read, abandon_on_cancel=True)
        else:
            line = await self._polled_line(self._fd)
        if not line:
            raise StopAsyncIteration
        if len(line) > self._limit and not line.endswith(b"\n"):
            self.refused = f"the client sent a message longer than {self._limit} bytes"
            raise StopAsyncIteration
        cost = message_cost(line)
        self.refused = too_costly(cost)
        if self.refused is not None:
            raise StopAsyncIteration
        self.sizes.append(cost)
        return line.decode("utf-8", errors="replace")

    async def _polled_line(self, fd: int) -> bytes:
        """As ``readline(limit + 1)``: a line, its first ``limit + 1`` bytes, or what is left."""
        while True:
            end = self._buffer.find(b"\n", 0, self._limit + 1)
            if end >= 0 or len(self._buffer) > self._limit or self._at_end:
                take = end + 1 if end >= 0 else self._limit + 1
                line = bytes(self._buffer[:take])
                del self._buffer[:take]
                return line
            await anyio.wait_readable(fd)
            chunk = os.read(fd, _READ_BYTES)  # readable: returns at once, b"" at the end
            self._at_end = not chunk
            self._buffer += chunk


_READ_BYTES = 64 * 1024


def _pollable(wire: BinaryIO) -> int | None:
    """``wire``'s descriptor when a read of it may wait for ever (a pipe, socket or terminal)."""
    try:
        fd = wire.fileno()
        mode = os.fstat(fd).st_mode
    except (OSError, ValueError):  # not a file (tests)
        return None
    waits = stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or (stat.S_ISCHR(mode) and os.isatty(fd))
    return fd if waits else None


@contextlib.contextmanager
def _claimed_stdin() -> Iterator[BinaryIO]:
    """The client's stdin on a descriptor of its own, fd 0 on the null device meanwhile, as the
    SDK does for the stdin it opens itself: a child, or a stray read, must not take its bytes."""
    stdin = sys.stdin.buffer
    try:
        on_fd = stdin.fileno() == 0
    except (OSError, ValueError):  # not a file (tests): read it in place
        on_fd = False
    if not on_fd:
        yield stdin
        return
    import fcntl

    wire = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        # never closed: a reader thread may still be blocked on it when the session ends
        yield os.fdopen(wire, "rb", closefd=False)
    finally:
        os.dup2(wire, 0)
