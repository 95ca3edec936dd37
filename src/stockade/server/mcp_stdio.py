"""``stockade mcp`` over stdio: the one client on this process's stdin and stdout.

Apart from the protocol (``mcp_face``) and from HTTP (``mcp_http``): the SDK's stdio transport
reads a line whole, so stdin reaches it through a bounded reader, on a descriptor of its own,
waited on by the event loop so that a stop signal ends the wait.
"""

from __future__ import annotations

import contextlib
import functools
import os
import stat
import sys
from collections.abc import Iterator
from typing import BinaryIO, cast

import anyio

from stockade import exceptions as exc
from stockade.server.mcp_face import MAX_MESSAGE_BYTES, McpFace

__all__ = ["serve_stdio"]


async def serve_stdio(face: McpFace, *, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
    """Serve the one client on this process's stdin/stdout until it closes them. A message (a
    line) longer than ``max_message_bytes`` ends the session: ``RequestTooLarge`` once it has."""
    from mcp.server.stdio import stdio_server

    with _claimed_stdin() as wire:
        # the transport only iterates its stdin: it gets lines bounded before they are read whole
        bounded = _BoundedLines(wire, max_message_bytes)
        async with stdio_server(stdin=cast("anyio.AsyncFile[str]", bounded)) as (read, write):
            # the protocol has stdout (taken above); a stray print (a library's log line) would
            # corrupt it, so from here stdout is stderr
            real, sys.stdout = sys.stdout, sys.stderr
            try:
                await face.server.run(read, write, face.server.create_initialization_options())
            finally:
                sys.stdout = real
    if bounded.too_long:
        # its answer could not be told apart from the message's next piece: the session ended
        raise exc.RequestTooLarge(
            f"the client sent a message longer than {max_message_bytes} bytes: the session ended "
            "(over HTTP such a message is answered 413)",
            limit=max_message_bytes, fix="send smaller messages (a large file in pieces)",
        )  # fmt: skip


class _BoundedLines:
    """The lines of ``wire`` as text, each at most ``limit`` bytes; a longer one ends them
    (``too_long`` says so).

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
        self.too_long = False

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
            self.too_long = True
            raise StopAsyncIteration
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
