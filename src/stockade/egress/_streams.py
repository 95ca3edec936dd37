"""The byte streams a sandbox's proxy speaks over: a socket's connection, and TLS it answers.

``Plain`` is an asyncio protocol of its own rather than asyncio's ``StreamReader`` and
``StreamWriter``: the proxy only ever wants "what has come" and "send this", and the
streams' machinery around that was a good part of the proxy's time per request. As a
``BufferedProtocol`` it also receives into a buffer that is kept: a plain protocol gets a
new 256 KiB ``bytes`` per read from asyncio, which glibc maps and unmaps each time (three
system calls per read, measured with ``strace``). The buffer is one per thread, shared by
all its streams: a transport hands it back (``buffer_updated``) before it reads again, and
one of 256 KiB per connection would be mapped, zeroed and unmapped per request.

What a sandbox's streams hold in the host's memory is bounded as a whole (``Buffers``, one
per proxy): bytes received and not yet read; the last read, which its reader holds (and the
copies it makes of it: h11's, the framing) until it asks for more or says it passed it on
(``release``, or the write that carries it on); and bytes written and waiting for a slow
reader, the whole of a write while its writer waits. Past its budget every stream of that
sandbox stops reading until some are taken: the per-connection cap alone let 128
connections where neither side reads hold ~120 MiB, and a charge given back as soon as a
read left the stream let copies on their way to the other side (three of up to 256 KiB
per connection) go uncounted.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar, cast

__all__ = ["BUFFERED_LIMIT", "CHUNK", "Buffers", "Plain", "ServerTLS", "Stream", "connect", "within", "wrap"]

T = TypeVar("T")
CHUNK = 256 * 1024  # the most one read returns; also what a stream holds unread before it pauses
QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)  # Linux
_received = threading.local()  # each thread's receive buffer (``Plain.get_buffer``)
MIN_READ = 4096
BUFFERED_LIMIT = 16 * 1024 * 1024  # bytes one sandbox's streams may hold at once (``Buffers``)


class Buffers:
    """What one sandbox's streams hold at once: received and not yet passed on (``Plain.recv``),
    and written and not yet taken by the peer (while a stream's writer waits). Past ``limit`` every stream
    sharing it stops reading (backpressure: the peers' sockets fill, then their senders
    wait); below three quarters of it they read again. A read that is under way may still
    land: the bound is ``limit`` plus one read per stream (``get_buffer``)."""

    def __init__(self, limit: int = BUFFERED_LIMIT) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0  # the most held at once (for tests and benchmarks)
        self._paused: set[Plain] = set()  # streams that stopped reading for the budget

    @property
    def full(self) -> bool:
        return self.held >= self.limit

    def take(self, amount: int) -> None:
        self.held += amount
        self.peak = max(self.peak, self.held)

    def give(self, amount: int) -> None:
        self.held -= amount
        if self._paused and self.held < self.limit * 3 // 4:
            paused, self._paused = self._paused, set()
            for stream in paused:
                stream._budget_freed()

    def wait(self, stream: Plain) -> None:
        self._paused.add(stream)

    def forget(self, stream: Plain) -> None:
        self._paused.discard(stream)


class Stream(Protocol):
    async def recv(self) -> bytes: ...
    async def send(self, data: bytes) -> None: ...
    def release(self) -> None: ...
    def close(self) -> None: ...
    def gone(self) -> bool: ...


class Plain(asyncio.BufferedProtocol):
    """One connection (a client's or a server's), as ``recv`` and ``send``."""

    def __init__(self, *, tls: bool = False, buffers: Buffers | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self._tls = tls  # a TLS transport cannot stay half-open after the peer's EOF
        self._buffers = buffers if buffers is not None else Buffers()  # the sandbox's, shared
        self._data = bytearray()  # received, not yet read
        self._charged = 0  # of ``_data``, what ``_buffers`` counts (none once the connection is lost)
        self._lent = 0  # of the last read, what ``_buffers`` counts while its reader holds it
        self._charged_out = 0  # written and waiting in the transport, counted while the writer waits
        self._view = memoryview(b"")  # where the transport's last read went (the thread's buffer)
        self._eof = False
        self._error: BaseException | None = None
        self._lost = False
        self._reading_paused = False
        self._reader: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None  # set while the transport's buffer is full
        self._tcp: Any = None  # the TCP socket ``quickack`` sets (looked up once)
        self._tcp_known = False

    # -- asyncio's side --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def get_buffer(self, sizehint: int) -> memoryview:
        view: memoryview | None = getattr(_received, "view", None)
        if view is None:
            view = _received.view = memoryview(bytearray(CHUNK))
        # No read past this stream's own cap nor the sandbox's budget (each at least a page,
        # so that a read always progresses): what is held stays within them, not one read over.
        room = min(CHUNK - len(self._data), self._buffers.limit - self._buffers.held)
        self._view = view[: max(MIN_READ, room)] if room < CHUNK else view
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        self._data += self._view[:nbytes]
        if not self._lost:
            self._charged += nbytes
            self._buffers.take(nbytes)
        if self.transport is not None and not self._reading_paused:
            if len(self._data) >= CHUNK:  # nobody reads as fast as this comes: wait for them
                self._pause()
            elif self._buffers.full:  # the sandbox holds its budget: wait for some to be read
                self._pause()
                self._buffers.wait(self)
        self._wake()

    def _pause(self) -> None:
        self._reading_paused = True
        assert self.transport is not None
        self.transport.pause_reading()

    def _budget_freed(self) -> None:
        """The sandbox's budget has room again: read, unless this stream's own cap holds it."""
        if self._reading_paused and len(self._data) < CHUNK and self.transport is not None:
            self._reading_paused = False
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                self.transport.resume_reading()

    def _release(self) -> None:
        """Nothing of this stream counts against the sandbox's budget any more (it is lost)."""
        self._buffers.forget(self)
        charged = self._charged + self._charged_out + self._lent
        self._charged = self._charged_out = self._lent = 0
        if charged:
            self._buffers.give(charged)

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return not self._tls  # keep our side open: a tunnel still carries the other direction

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._eof = True
        self._release()
        if exc is not None and self._error is None:
            self._error = exc
        self._wake()
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc or ConnectionResetError("connection lost"))
            waiter.exception()  # retrieved here: nobody may be waiting for it any more

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        charged, self._charged_out = self._charged_out, 0
        if charged:
            self._buffers.give(charged)
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake(self) -> None:
        waiter, self._reader = self._reader, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the proxy's side ------------------------------------------------------------------

    async def recv(self) -> bytes:
        """What has come (at most ``CHUNK``); ``b""`` at the end of the stream. It stays
        charged to the sandbox until the next ``recv`` or ``release``: the reader holds it,
        and what it makes of it, until then."""
        self.release()  # asking for more: the last read has been passed on
        if not self._data and not self._eof:
            self._reader = asyncio.get_running_loop().create_future()
            try:
                await self._reader
            finally:
                self._reader = None
        if self._data:
            if len(self._data) <= CHUNK:
                data = bytes(self._data)
                self._data.clear()
            else:
                data = bytes(self._data[:CHUNK])
                del self._data[:CHUNK]
            self._lent = min(len(data), self._charged)  # the reader's now, still the sandbox's
            self._charged -= self._lent
            if self._reading_paused and self.transport is not None and len(self._data) < CHUNK:
                if self._buffers.full:  # its own cap no longer holds it; the sandbox's budget does
                    self._buffers.wait(self)
                else:
                    self._reading_paused = False
                    self._buffers.forget(self)
                    self.transport.resume_reading()
            return data
        if self._error is not None:
            raise self._error
        return b""

    def release(self) -> None:
        """What the last ``recv`` returned has been passed on: it counts no more."""
        lent, self._lent = self._lent, 0
        if lent:
            self._buffers.give(lent)

    async def send(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        if self._lost or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("connection lost")
        size = len(data)
        if data:
            self.transport.write(data)
        del data  # the transport's copy (or its reference to it) is what waits: not ours too
        if self._writable is not None:
            # What waits for a slow reader is the sandbox's too, while its writer waits: all
            # of what was written (a transport that keeps it whole keeps the part that went).
            owed = max(self.transport.get_write_buffer_size(), size) - self._charged_out
            if owed > 0:
                self._charged_out += owed
                self._buffers.take(owed)
            await self._writable

    def eof(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            if self.transport is not None and self.transport.can_write_eof():
                self.transport.write_eof()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close at once, without flushing what waits to be sent nor a TLS goodbye."""
        if self.transport is not None:
            self.transport.abort()

    def close_within(self, seconds: float) -> None:
        """Close after what waits to be sent is sent, or abort if the peer has not taken it
        within ``seconds`` (``close`` alone waits for a peer that may never read)."""
        self.close()
        if self.transport is not None and self.transport.get_write_buffer_size():
            asyncio.get_running_loop().call_later(seconds, self.abort)

    def quickack(self) -> None:
        """ACK what comes next at once. On a kept connection the kernel has learnt to delay
        its ACKs (request, answer, request: it waits to send one with the next request), and
        a server that writes an answer in two pieces with Nagle on holds the second until the
        first is ACKed: 40 ms per request. A new connection starts in quick-ACK mode."""
        if not self._tcp_known:
            self._tcp_known = True
            sock = self.transport.get_extra_info("socket") if self.transport is not None else None
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                self._tcp = sock
        if self._tcp is not None and QUICKACK is not None:
            with contextlib.suppress(OSError):
                self._tcp.setsockopt(socket.IPPROTO_TCP, QUICKACK, 1)

    def gone(self) -> bool:
        """Closed by the peer as far as we know (a write failed: nobody reads any more), or
        by us. An end of the stream alone is not gone: a client may still read its answers."""
        return self._lost or self._error is not None or self.transport is None or self.transport.is_closing()

    def alive(self) -> bool:
        """Open both ways as far as we know (the server has not closed it, nor have we)."""
        return (
            not self._eof
            and self._error is None
            and self.transport is not None
            and not self.transport.is_closing()
        )


async def wrap(sock: socket.socket, buffers: Buffers | None = None) -> Plain:
    """An accepted socket as a ``Plain`` (closed if that fails), holding within ``buffers``."""
    loop = asyncio.get_running_loop()
    stream = Plain(buffers=buffers)
    try:
        await loop.connect_accepted_socket(lambda: stream, sock)
    except BaseException:
        sock.close()
        raise
    return stream


async def connect(
    address: str,
    port: int,
    *,
    tls: ssl.SSLContext | None = None,
    name: str | None = None,
    buffers: Buffers | None = None,
) -> Plain:
    """A new connection to ``address:port`` (TLS verified for ``name`` with ``tls``),
    holding within ``buffers`` (the sandbox's)."""
    loop = asyncio.get_running_loop()
    stream = Plain(tls=tls is not None, buffers=buffers)
    await loop.create_connection(
        lambda: stream, address, port, ssl=tls, server_hostname=name if tls is not None else None
    )
    return stream


class ServerTLS:
    """TLS answered over a stream whose first bytes were already read (the ClientHello)."""

    def __init__(self, raw: Plain, ctx: ssl.SSLContext, initial: bytes) -> None:
        self.raw = raw
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.incoming.write(initial)

    async def _flush(self) -> None:
        data = self.outgoing.read()
        if data:
            await self.raw.send(data)

    async def _fill(self) -> bool:
        await self._flush()
        data = await self.raw.recv()
        if not data:
            self.incoming.write_eof()
            return False
        self.incoming.write(data)
        return True

    async def handshake(self) -> None:
        while True:
            try:
                self.obj.do_handshake()
                await self._flush()
                return
            except ssl.SSLWantReadError:
                if not await self._fill():
                    raise ConnectionError("the client closed during the TLS handshake") from None

    async def recv(self) -> bytes:
        while True:
            try:
                return self.obj.read(CHUNK)
            except ssl.SSLWantReadError:
                if not await self._fill():
                    return b""
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    async def send(self, data: bytes) -> None:
        self.obj.write(data)
        del data  # the encrypted copy is what waits (``Plain.send``): not the plain one too
        await self._flush()

    def release(self) -> None:
        self.raw.release()

    def close(self) -> None:
        self.raw.close()

    def gone(self) -> bool:
        return self.raw.gone()


async def within(coro: Coroutine[Any, Any, T], seconds: float) -> T:
    """``coro`` with a deadline, in the current task (``wait_for`` makes a task per call,
    which is most of what a short request costs the proxy)."""
    async with asyncio.timeout(seconds):
        return await coro
