"""Host side of the supervisor protocol: request/response multiplexing over one byte stream.

A reader thread decodes frames and routes them, by request id, to the caller waiting for
them; output callbacks therefore run on the caller's thread, never on the reader's.
Everything the supervisor sends is untrusted: frames are size-bounded and a malformed one
kills the channel (and the tier then kills the sandbox). JSON from the supervisor is bounded
in values as well as in bytes before it is parsed (``loads_bounded``): a few bytes of JSON
can make a hundred bytes of Python objects.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import re
import select
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from stockade.exceptions import InvalidArgument, ProtocolError, SandboxClosed, SandboxCrashed
from stockade.sandbox._interrupt import CUT
from stockade.sandbox.supervisor.protocol import (
    HMAC_SHA256,
    MAX_EXEC_ARGV,
    MAX_EXEC_RECORDS,
    MAX_HEADER,
    PREFIX,
    FrameError,
    FrameReader,
    Seal,
    encode,
    over_cap,
)

Frame = tuple[dict[str, Any], bytes]
_CLOSED: Frame = ({"ev": "__closed__"}, b"")
_CUT: Frame = ({"ev": "__cut__"}, b"")  # the awaiting task was cancelled (``_interrupt``)

# A header is a handful of keys; its strings may be long (paths in messages), its structure
# is small, but for the execs a command's exit reports: up to MAX_EXEC_RECORDS records of
# {path, argv, verdict, rule}, each at most 2 * MAX_EXEC_ARGV + 16 values as json_values counts.
MAX_HEADER_VALUES = 1024 + MAX_EXEC_RECORDS * (2 * MAX_EXEC_ARGV + 16)
_STRUCTURE = b",:[{"
_STRING = re.compile(rb'"[^"]*"')  # once escaped quotes are gone; one byte class: a fast loop
_FEW_STRINGS = 64


class JSONTooLarge(ValueError):
    pass


def json_values(raw: bytes, limit: int) -> int:
    """An upper bound on the JSON values ``raw`` makes; exact when the quick one is over ``limit``.

    Every value but the first follows a ``,``, ``:`` or ``[``, and every string has two
    quotes, so counting those bytes bounds what a parser allocates, whatever it is given
    (an invalid text fails at its first error, after parsing a valid prefix, counted too).
    The quick bound counts inside strings as well; the exact one only outside them, so that
    text full of commas is one value. Both run in C, in time linear in ``raw``.
    """
    quick = sum(raw.count(c) for c in _STRUCTURE) + raw.count(b'"') // 2
    if quick <= limit:
        return quick
    # Without escaped backslashes and quotes, every quote left opens or closes a string.
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in raw else raw
    strings = text.count(b'"') // 2
    if strings > limit:
        return strings
    if strings > _FEW_STRINGS:
        skeleton = _STRING.sub(b"", text)
        return strings + sum(skeleton.count(c) for c in _STRUCTURE)
    # Few strings (a flood of empty values): count between them, without copying the text.
    count, pos = strings, 0
    while pos >= 0:
        opening = text.find(b'"', pos)
        count += sum(text.count(c, pos, len(text) if opening < 0 else opening) for c in _STRUCTURE)
        closing = text.find(b'"', opening + 1) if opening >= 0 else -1
        pos = closing + 1 if closing >= 0 else -1
    return count


def loads_bounded(raw: bytes, *, max_bytes: int, max_values: int) -> Any:
    """``json.loads`` for untrusted text: ``JSONTooLarge`` (a ValueError) before parsing
    more than ``max_bytes`` or about ``max_values`` values.

    ASCII only, as the supervisor writes it (non-ASCII characters escaped): one character
    outside Latin-1 would otherwise make Python hold the whole text at four bytes a character,
    and UTF-16 would hide quotes and backslashes from the count. An escape does the same
    (``\\ud83d\\ude00``): ``max_bytes`` bounds the text parsed (``text_bytes``), not only the JSON.
    """
    if len(raw) > max_bytes:
        raise JSONTooLarge(f"{len(raw)} bytes of JSON, over the {max_bytes} allowed")
    if over_cap(raw, max_bytes):  # an escape past U+FFFF (one emoji) in 100 MB of JSON: 400 MB of text
        raise JSONTooLarge(f"{len(raw)} bytes of JSON whose text takes more than the {max_bytes} allowed")
    values = json_values(raw, max_values)
    if values > max_values:
        raise JSONTooLarge(f"over {max_values} JSON values in {len(raw)} bytes")
    return json.loads(raw.decode("ascii"))


# A send that moves no byte for this long is to a peer that stopped reading (a guest whose
# vCPU never runs again, a stopped supervisor, a paused container): the channel fails, not the
# caller's thread blocked for ever in a write.
LIVENESS_S = 10.0


class Stalled(TimeoutError):
    """No byte of a send moved for ``LIVENESS_S``: the supervisor stopped reading."""


def send_all(fd: int, write: Callable[[memoryview], int], data: bytes, deadline: float | None) -> None:
    """Write ``data`` with ``write``, which never blocks (it raises ``BlockingIOError``, or
    writes part), waiting on ``fd`` while it is full, for ``Stream.send``."""
    view = memoryview(data)
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    moved = time.monotonic()
    while view:
        try:
            written = write(view)
        except BlockingIOError:
            written = 0
        now = time.monotonic()
        if written:
            view, moved = view[written:], now
            continue
        if deadline is not None and now >= deadline:
            raise TimeoutError(f"{len(view)} bytes not sent by the deadline")
        if now >= moved + LIVENESS_S:
            raise Stalled(f"no byte of {len(view)} could be sent in {LIVENESS_S:g}s")
        end = moved + LIVENESS_S if deadline is None else min(moved + LIVENESS_S, deadline)
        poller.poll(max(1, int((end - now) * 1000) + 1))


def _parse_header(raw: bytes) -> Any:
    return loads_bounded(raw, max_bytes=MAX_HEADER, max_values=MAX_HEADER_VALUES)


class Stream(Protocol):
    """A bidirectional byte stream to the supervisor (pipes, a socket, a virtio port)."""

    def recv(self) -> bytes:
        """Block for the next chunk; b'' at end of stream."""

    def send(self, data: bytes, deadline: float | None = None) -> None:
        """Write all of ``data``: ``Stalled`` once no byte moved for ``LIVENESS_S``,
        ``TimeoutError`` past ``deadline`` (``time.monotonic()``); part of it may be written."""

    def close(self) -> None: ...


class Channel:
    def __init__(
        self, stream: Stream, *, max_body: int, name: str, on_stall: Callable[[], None] | None = None
    ) -> None:
        """``on_stall`` ends the sandbox when a send stalled (``Stalled``): the supervisor is
        frozen or hung, and left alive it would hold what it holds on the host for ever."""
        self._stream = stream
        self._on_stall = on_stall
        self._reader = FrameReader(max_body=max_body, parse_header=_parse_header)
        self._calls: dict[int, queue.SimpleQueue[Frame]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self.error: str | None = None
        self.closed = False  # ``close`` failed it first: its calls end with SandboxClosed
        self.cut: str | None = None  # why a send of ours was cut short, if one was (``error`` too)
        self._seal: Seal | None = None  # what we send is sealed (protocol.Seal), once set
        self._thread = threading.Thread(target=self._read_loop, name=f"stockade-{name}", daemon=True)
        self._thread.start()

    def seal(
        self, key: bytes, *, sent: int = 0, received: int = 0, send_key: bool = True, mac: str = HMAC_SHA256
    ) -> None:
        """From here on, every frame both ways carries its seal under ``key`` (protocol.Seal),
        made with ``mac`` (the one the supervisor named). ``send_key``: the supervisor is
        waiting for it (right after its ``ready``); a sandbox restored from memory has it
        already, with the counts the snapshot kept."""
        with self._send_lock:
            # the reader first: whatever the supervisor sends once it has the key is sealed
            self._reader.seal = Seal(key, b"S", received, head=True, mac=mac)
            if send_key:
                self._send(key, None, "seal")
            self._seal = Seal(key, b"H", sent, mac=mac)

    def seal_state(self) -> tuple[bytes, int, int, str] | None:
        """The key, how many frames each way were sealed (sent, received) and the MAC, or None
        where frames are not: what a memory snapshot keeps for the supervisor it restores."""
        reader = self._reader.seal
        if self._seal is None or reader is None:
            return None
        return bytes(self._seal.key), self._seal.count, reader.count, self._seal.mac

    @property
    def open(self) -> bool:
        return self.error is None

    def call(self, header: dict[str, Any], body: bytes = b"", deadline: float | None = None) -> Call:
        """Send a request; its answer comes through the ``Call``. The send ends by ``deadline``
        (``TimeoutError``) or as soon as no byte of it moved for ``LIVENESS_S``
        (``SandboxCrashed``, ``unresponsive``); either leaves the channel failed."""
        cut = CUT.get()
        if cut is not None:  # cancelled between two requests: the next one is not sent
            cut.deliver()
        rid = next(self._ids)
        frame = encode({**header, "id": rid}, body)
        head = PREFIX.unpack_from(frame)[0]
        if head > MAX_HEADER:
            # The supervisor would take it for a broken peer and end the sandbox: a caller's
            # mistake (a megabyte command line) must not cost it its sandbox.
            raise InvalidArgument(
                f"the {header.get('op', '')} request is {head} bytes of arguments, over the {MAX_HEADER} "
                "a request may carry",
                argument="request",
                fix="pass large input through stdin or a file (the kernel runs no command whose "
                "arguments and environment pass 2 MiB, nor with one argument over 128 KiB)",
            )
        q: queue.SimpleQueue[Frame] = queue.SimpleQueue()
        with self._lock:
            if self.cut is not None:
                raise SandboxClosed(f"sandbox is closed: {self.cut}")
            if self.error is not None:
                raise self.ended()
            self._calls[rid] = q
        op = str(header.get("op", ""))
        try:
            with self._send_lock:  # tags are counted in the order frames are written
                if self.error is not None:  # failed while we waited for the lock (a stalled send)
                    raise self.ended()
                self._send(frame + self._seal.tag(frame) if self._seal is not None else frame, deadline, op)
        except (SandboxCrashed, SandboxClosed, TimeoutError):
            self._forget(rid)
            raise
        except BaseException as exc:
            # Cut mid-frame (Ctrl-C, an exception raised into this thread): what is on the wire
            # may be half a frame, which the supervisor would join to the next request. Nothing
            # more can be said on this channel; the interruption goes on to the caller.
            self.cut = (
                f"the host's send of a {op} request was interrupted "
                f"({type(exc).__name__}) and left its channel to the supervisor unusable"
            )
            self._fail(self.cut)
            raise
        return Call(self, rid, q)

    def _send(self, data: bytes, deadline: float | None, op: str) -> None:
        """Under ``_send_lock``. Whatever fails mid-frame fails the channel: what is on the
        wire may be half a frame, which the supervisor would join to the next one."""
        try:
            self._stream.send(data, deadline)
        except Stalled as exc:
            self._fail(f"the supervisor stopped reading: frozen or hung ({exc})")
            if self._on_stall is not None:
                self._on_stall()
            if self.closed:  # closed while the send waited
                raise self.ended() from None
            raise SandboxCrashed(f"sandbox is gone: {self.error}", cause="unresponsive") from None
        except TimeoutError:
            self._fail(f"the {op} request was not sent by its deadline: the supervisor read too slowly")
            raise
        except OSError as exc:  # closed under the send by ``close``, or the supervisor is gone
            self._fail(f"cannot write to the supervisor: {exc}")
            raise self.ended() from None

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
            if self._reader.seal is not None and "seal" in str(exc):
                exc = FrameError(f"{exc}: something in the sandbox wrote to the supervisor's channel")
            self._fail(f"protocol violation: {exc}")
        except OSError as exc:
            self._fail(f"connection lost: {exc}")

    def _fail(self, reason: str, *, closing: bool = False) -> None:
        with self._lock:
            if self.error is None:
                self.error = reason
                self.closed = closing
            calls = list(self._calls.values())
        for q in calls:
            q.put(_CLOSED)

    def ended(self) -> SandboxClosed | SandboxCrashed:
        """What a call on the failed channel raises: ``SandboxClosed`` where the host closed
        it (its own ``close``, from any thread, or a pool taking a member back), before
        anything else failed it; ``SandboxCrashed`` where the sandbox died under the call."""
        if self.closed:
            return SandboxClosed("sandbox is closed: the host closed it while the call ran; create a new one")
        return SandboxCrashed(f"sandbox is gone: {self.error}")

    def close(self) -> None:
        self._fail("closed", closing=True)
        with contextlib.suppress(OSError):
            self._stream.close()


class Call:
    """The frames answering one request, in order."""

    def __init__(self, channel: Channel, rid: int, q: queue.SimpleQueue[Frame]) -> None:
        self._channel = channel
        self.rid = rid
        self._q = q
        self._later = 0.0  # what ``extend`` moved the deadline of ``frames`` by

    def extend(self, seconds: float) -> None:
        """Move the deadline ``frames`` waits under later by ``seconds`` (the call waited that
        long for someone else: a human asked about one of its execs)."""
        self._later += max(0.0, seconds)

    def frames(self, deadline: float | None) -> Iterator[Frame]:
        """Yield frames until a terminal one; ``TimeoutError`` past the host's deadline (as
        ``extend`` moved it); ``Interrupted`` once the task this thread runs for is cancelled."""
        cut = CUT.get()
        try:
            if cut is not None:
                cut.watch(self._q, _CUT)
            while True:
                timeout = None if deadline is None else deadline + self._later - time.monotonic()
                if timeout is not None and timeout <= 0:
                    raise TimeoutError
                try:
                    frame = self._q.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError from None
                if frame is _CLOSED:
                    raise self._channel.ended()
                if frame is _CUT:
                    if cut is not None:
                        cut.deliver()
                    continue  # raised already, by an earlier wait of the same call
                yield frame
                if frame[0].get("ev") in ("done", "exit", "result", "error", "ready", "hello"):
                    return
        finally:
            if cut is not None:
                cut.forget(self._q)
            self._channel._forget(self.rid)

    def result(self, deadline: float | None) -> Frame:
        last: Frame | None = None
        for frame in self.frames(deadline):
            last = frame
        if last is None:  # pragma: no cover - frames() always yields a terminal frame
            raise ProtocolError("no reply")
        return last
