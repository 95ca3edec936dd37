"""The host's end of the microVM's egress port: streams over one virtio-serial port.

The guest has no network device; its relay (``supervisor/egressmux.py``, ``MuxRelay``) carries
each connection to its loopback port 3128 as a stream over a virtio-serial port of its own,
whose host end is one half of a socketpair given to QEMU. Here each stream becomes one
connection to the sandbox's proxy socket, like the other tiers' connections. The frames
and their flow control are the guest's (see there): at most ``WINDOW`` bytes of a stream
are in flight each way, so neither end buffers more than that per stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass, field

__all__ = ["Mux"]

OPEN, DATA, EOF, CLOSE, ACK, HELLO = 1, 2, 3, 4, 5, 6
WINDOW = 256 * 1024
HEADER = 9
CHUNK = 64 * 1024
MAX_STREAMS = 64


def _frame(kind: int, sid: int, payload: bytes = b"") -> bytes:
    return bytes((kind,)) + sid.to_bytes(4, "big") + len(payload).to_bytes(4, "big") + payload


def _violation(sid: int, what: str) -> str:
    """A frame the guest's relay never sends: its supervisor is no longer ours, so the port
    ends (every stream of the sandbox), not only the stream. Dropping the stream alone would
    bound memory as well, but leave a peer known to lie free to open the next stream and do
    it again; every stream of the port comes from that same peer, so none of them is worth
    serving on. An honest relay cannot trip these checks: the host's
    count of a stream only lags the guest's (its ACKs are still on their way), never leads."""
    return f"stream {sid}: {what}"


@dataclass
class _Stream:
    sid: int
    inbox: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)  # None: EOF
    held: int = 0  # bytes from the guest not yet written to the proxy and acknowledged
    eof: bool = False  # the guest's EOF came: nothing more of it may
    credit: int = WINDOW
    more_credit: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class Mux:
    """Serves the guest's streams on ``port`` (our end of the socketpair) with connections to
    the proxy's Unix socket ``target``. ``run`` until the port closes or ``close``."""

    def __init__(self, port: socket.socket, target: str) -> None:
        self.port = port
        self.target = target
        self.streams: dict[int, _Stream] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self.violation: str | None = None  # why the port was ended, if the guest broke the protocol

    def start(self) -> None:
        """On the egress loop (from ``_loop.call``)."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._drop_all()
        if self._writer is None:  # never started: the socket is still ours alone
            with contextlib.suppress(OSError):
                self.port.close()
            return
        # The transport owns the socket: it takes it off the loop's selector, then closes it.
        # Closed under it first, its number could go to the next socket the loop watches
        # before the stale entry left the selector (another sandbox's proxy then failed to
        # start: FileNotFoundError from epoll).
        self._writer.close()
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(self._writer.wait_closed(), 5)

    async def _run(self) -> None:
        reader, self._writer = await asyncio.open_connection(sock=self.port, limit=1 << 20)
        try:
            while True:
                header = await reader.readexactly(HEADER)
                size = int.from_bytes(header[5:9], "big")
                if size > 4 * CHUNK:  # the relay sends at most one chunk: anything else is noise
                    self.violation = f"a frame of {size} bytes"
                    return
                payload = await reader.readexactly(size) if size else b""
                self.violation = self._on_frame(header[0], int.from_bytes(header[1:5], "big"), payload)
                if self.violation is not None:
                    return
                # What we answered (ACK, CLOSE) must reach the guest before we read on: a
                # guest that never reads its end stalls here instead of growing our buffer.
                await self._writer.drain()
                # A turn of the loop per frame: frames already buffered are read without one,
                # and the loop is every sandbox's; the tasks an OPEN made (and a CLOSE ended)
                # run now, not after a megabyte of OPEN/CLOSE pairs piled up 50 000 of them.
                await asyncio.sleep(0)
        except (asyncio.IncompleteReadError, OSError):
            return
        finally:
            self._drop_all()
            self._writer.close()

    def _on_frame(self, kind: int, sid: int, payload: bytes) -> str | None:
        """Acts on one frame of the guest; returns why the port must end, if it must."""
        if kind == HELLO:  # a fresh relay (the sandbox was reset): nothing of before goes on
            self._drop_all()
            return None
        if kind == OPEN:
            if sid in self.streams or len(self.streams) >= MAX_STREAMS:
                self._send(_frame(CLOSE, sid))
                return None
            opened = self.streams[sid] = _Stream(sid)
            opened.tasks.append(asyncio.get_running_loop().create_task(self._serve(opened)))
            return None
        stream = self.streams.get(sid)
        if stream is None:  # a stream we dropped: what was in flight for it goes nowhere
            return None
        if kind == DATA:
            if stream.eof:
                return _violation(sid, "data after its EOF")
            if stream.held + len(payload) > WINDOW:
                return _violation(sid, f"{stream.held + len(payload)} bytes held, past a window of {WINDOW}")
            stream.held += len(payload)
            stream.inbox.put_nowait(payload)
        elif kind == EOF:
            if stream.eof:
                return _violation(sid, "a second EOF")
            stream.eof = True
            stream.inbox.put_nowait(None)
        elif kind == ACK and len(payload) == 4:
            stream.credit += int.from_bytes(payload, "big")
            if stream.credit > WINDOW:
                return _violation(sid, "credit for bytes never sent")
            stream.more_credit.set()
        elif kind == CLOSE:
            self._drop(stream, tell=False)
        return None

    async def _serve(self, stream: _Stream) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(self.target, limit=CHUNK)
        except OSError:
            self._drop(stream, tell=True)
            return
        try:
            await asyncio.gather(self._to_proxy(stream, writer), self._to_guest(stream, reader))
        except (OSError, ConnectionError):
            self._drop(stream, tell=True)
            return
        finally:
            writer.close()
        self._drop(stream, tell=True)

    async def _to_proxy(self, stream: _Stream, writer: asyncio.StreamWriter) -> None:
        while True:
            data = await stream.inbox.get()
            if data is None:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
            stream.held -= len(data)
            self._send(_frame(ACK, stream.sid, len(data).to_bytes(4, "big")))

    async def _to_guest(self, stream: _Stream, reader: asyncio.StreamReader) -> None:
        while True:
            while stream.credit <= 0:
                stream.more_credit.clear()
                await stream.more_credit.wait()
            data = await reader.read(min(CHUNK, stream.credit))
            if not data:
                self._send(_frame(EOF, stream.sid))
                return
            stream.credit -= len(data)
            self._send(_frame(DATA, stream.sid, data))
            if self._writer is not None:
                await self._writer.drain()

    def _send(self, data: bytes) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(data)

    def _drop(self, stream: _Stream, *, tell: bool) -> None:
        if self.streams.pop(stream.sid, None) is None:
            return
        current = asyncio.current_task()
        for task in stream.tasks:
            if task is not current:
                task.cancel()
        if tell:
            self._send(_frame(CLOSE, stream.sid))

    def _drop_all(self) -> None:
        for stream in list(self.streams.values()):
            self._drop(stream, tell=False)
