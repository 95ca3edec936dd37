"""Host side of the supervisor protocol: request/response multiplexing over one byte stream.

A reader thread decodes frames and routes them, by request id, to the caller waiting for
them; output callbacks therefore run on the caller's thread, never on the reader's.
Everything the supervisor sends is untrusted: frames are size-bounded and a malformed one
kills the channel (and the tier then kills the sandbox).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

from stockade.exceptions import ProtocolError, SandboxCrashed
from stockade.sandbox.kernel.protocol import FrameError, FrameReader, encode

Frame = tuple[dict[str, Any], bytes]
_CLOSED: Frame = ({"ev": "__closed__"}, b"")


class Stream(Protocol):
    """A bidirectional byte stream to the supervisor (pipes, a socket, a virtio port)."""

    def recv(self) -> bytes:
        """Block for the next chunk; b'' at end of stream."""

    def send(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class Channel:
    def __init__(self, stream: Stream, *, max_body: int, name: str) -> None:
        self._stream = stream
        self._reader = FrameReader(max_body=max_body)
        self._calls: dict[int, queue.SimpleQueue[Frame]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._read_loop, name=f"stockade-{name}", daemon=True)
        self._thread.start()

    @property
    def open(self) -> bool:
        return self.error is None

    def call(self, header: dict[str, Any], body: bytes = b"") -> Call:
        rid = next(self._ids)
        q: queue.SimpleQueue[Frame] = queue.SimpleQueue()
        with self._lock:
            if self.error is not None:
                raise SandboxCrashed(f"sandbox is gone: {self.error}")
            self._calls[rid] = q
        try:
            with self._send_lock:
                self._stream.send(encode({**header, "id": rid}, body))
        except OSError as exc:
            self._fail(f"cannot write to the supervisor: {exc}")
            raise SandboxCrashed(f"sandbox is gone: {self.error}") from None
        return Call(self, rid, q)

    def _forget(self, rid: int) -> None:
        with self._lock:
            self._calls.pop(rid, None)

    def _read_loop(self) -> None:
        try:
            while True:
                data = self._stream.recv()
                if not data:
                    self._fail("the supervisor exited")
                    return
                self._reader.feed(data)
                for header, body in self._reader.frames():
                    rid = header.get("id")
                    with self._lock:
                        q = self._calls.get(rid) if isinstance(rid, int) else None
                    if q is not None:
                        q.put((header, body))
        except FrameError as exc:
            self._fail(f"protocol violation: {exc}")
        except OSError as exc:
            self._fail(f"connection lost: {exc}")

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.error is None:
                self.error = reason
            calls = list(self._calls.values())
        for q in calls:
            q.put(_CLOSED)

    def close(self) -> None:
        self._fail("closed")
        with contextlib.suppress(OSError):
            self._stream.close()


class Call:
    """The frames answering one request, in order."""

    def __init__(self, channel: Channel, rid: int, q: queue.SimpleQueue[Frame]) -> None:
        self._channel = channel
        self.rid = rid
        self._q = q

    def frames(self, deadline: float | None) -> Iterator[Frame]:
        """Yield frames until a terminal one; ``TimeoutError`` past the host's deadline."""
        try:
            while True:
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    raise TimeoutError
                try:
                    frame = self._q.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError from None
                if frame is _CLOSED:
                    raise SandboxCrashed(f"sandbox is gone: {self._channel.error}")
                yield frame
                if frame[0].get("ev") in ("done", "exit", "result", "error", "ready"):
                    return
        finally:
            self._channel._forget(self.rid)

    def result(self, deadline: float | None) -> Frame:
        last: Frame | None = None
        for frame in self.frames(deadline):
            last = frame
        if last is None:  # pragma: no cover - frames() always yields a terminal frame
            raise ProtocolError("no reply")
        return last
