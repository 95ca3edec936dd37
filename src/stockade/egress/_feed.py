"""What one side of a proxied HTTP connection sent, given to ``h11`` in bounded pieces.

The proxy's loop is shared by every sandbox, and ``h11`` parses a head or a trailer in one
go once its blank line comes: here the bytes are counted before ``h11`` parses any
(``HeadLines``: a request's head by ``next_request``, a server's by ``answer_head``) and a
body's or a trailer's are given to it at most ``HEAD_LINES`` line ends at a time (``Feed``).
The memory accounting lives here too: a read stays charged to the sandbox until the write
that carries it on takes the charge over (``Feed.passed_on``, ``write``). Separate from
the exchange (``_http``) so that what bounds the parser's cost and a sandbox's buffers can
be read, and tested, apart from what a request is sent where.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable
from typing import Any

from stockade.egress._gate import Gate, Refused
from stockade.egress._rules import Verdict
from stockade.egress._streams import Stream, within

__all__ = [
    "HEAD_LIMIT",
    "HEAD_LINES",
    "HEAD_TIMEOUT_S",
    "INFORMATIONAL_LIMIT",
    "LINE_LIMIT",
    "PIECES_PER_TURN",
    "Feed",
    "HeadLines",
    "answer_head",
    "answer_trailer_over",
    "chunk_left",
    "drain_body",
    "lines_end",
    "load_h11",
    "next_event",
    "next_request",
    "request_trailer_over",
    "write",
]

HEAD_LIMIT = 64 * 1024  # request or response head: bigger is refused
# Line ends of a request head (its request line and its closing blank line included): more
# is a 431, counted on the bytes before h11 parses any. Parsing is what a head costs the
# loop all sandboxes share: 12,500 one-line headers (`a:b`, within HEAD_LIMIT) took 14-31 ms
# of it each. Apache's LimitRequestFields is 100; browsers and HTTP libraries send a few dozen.
HEAD_LINES = 256
# A server's heads are counted the same way before h11 parses them: past HEAD_LINES lines one
# is a 502, and so are 1xx ones past INFORMATIONAL_LIMIT heads, or HEAD_LINES lines or
# HEAD_LIMIT bytes together. An answer costs the loop at most three heads' worth of lines
# (its 1xx ones, the one that went past, the final one): 16 ``103`` heads of 10,000 ``a:b``
# lines and a final one like them took 198 ms of it (349 ms for a credential's host).
INFORMATIONAL_LIMIT = 16
LINE_LIMIT = 8192  # of a request head h11 refuses, what is kept to name it (its first line)
HEAD_TIMEOUT_S = 30.0
# Pieces of one read given to h11 (``Feed``) before the loop lets other connections run: a
# piece is a parse of up to HEAD_LINES lines, ~10-25 µs; a read of short chunks full of line
# ends is ~2,000 of them, and held the shared loop ~50 ms when only events were counted.
PIECES_PER_TURN = 128


@functools.cache
def load_h11() -> Any:
    """The ``h11`` module (imported on first use: it comes with the egress extra)."""
    try:
        import h11
    except ImportError:  # pragma: no cover - a dependency of the egress extra
        from stockade.exceptions import ConfigurationError

        raise ConfigurationError('network allowlists need `h11`: pip install "stockade[egress]"') from None
    return h11


async def write(stream: Stream, out: list[bytes], feed: Feed | None = None) -> None:
    """``out``'s pieces to ``stream`` in one write, taken from it first, which takes over
    the charge of the read they came from (``feed``'s, once all of it is: a decoded reply's
    pieces leave while their read is still being decoded, and it stays charged): while it
    waits, what it wrote is charged (``Plain.send``), and is all that is held of them (the
    joined bytes are the write's alone: no name here holds them)."""
    if feed is not None:
        feed.passed_on()  # in the step of the write itself: nothing waits uncharged between
    await stream.send(joined(out))


def joined(out: list[bytes]) -> bytes:
    data = b"".join(out)
    out.clear()
    return data


class HeadLines:
    """The lines of a request head and its bytes, counted on the bytes as they come (up to
    the blank line that ends it, as h11 finds it), before h11 parses any of them; and
    whether a line of it is folded (``folded``: it begins with a space or a tab)."""

    BLANK = re.compile(rb"\n\r?\n")
    FOLD = re.compile(rb"\n[ \t]")

    def __init__(self) -> None:
        self.lines = 0
        self.size = 0
        self.ended = False
        self.folded = False
        self._tail = b""  # the last bytes seen: a blank line may straddle two reads

    def feed(self, data: bytes) -> int:
        """Count ``data``'s part of the head; the bytes of it that were the head's."""
        if self.ended or not data:
            return 0
        if not self.size and (data[:1] == b"\n" or data[:2] == b"\r\n"):
            self.ended = True  # a head that begins blank: h11 refuses it without parsing a line
            return 0
        seen = self._tail + bytes(data)  # all of it: h11 parses a head that came whole, however long
        found = self.BLANK.search(seen)
        end = found.end() if found is not None else len(seen)
        start = len(self._tail)
        self.lines += seen.count(b"\n", start, max(start, end))
        self.folded = self.folded or self.FOLD.search(seen, 0, end) is not None
        self.ended = found is not None
        taken = max(0, end - start)
        self.size += taken
        self._tail = seen[-2:]
        return taken


@functools.cache
def _lines(count: int) -> re.Pattern[bytes]:
    return re.compile(rb"(?:[^\n]*\n){%d}" % count)


def lines_end(data: bytes, count: int, start: int = 0) -> int:
    """Where ``data``'s first ``count`` lines from ``start`` end (all of it, if it has fewer)."""
    found = _lines(count).match(data, start)
    return found.end() if found is not None else len(data)


def chunk_left(conn: Any) -> int:
    """The bytes of the chunk h11 is inside that are still to come: it takes them as data,
    parsing no line (0 between chunks, in the trailer, or if this h11 does not say).

    Read from h11's chunked reader: h11 has no public word for it, and only its own count
    can say where its lines start again. Without it a chunked body of line ends went to
    h11 256 bytes at a time (9 MB/s, a 256 KiB read a 40-50 ms step of the shared loop)."""
    reader = getattr(conn, "_reader", None)
    left = getattr(reader, "_bytes_in_chunk", 0)
    if not isinstance(left, int) or getattr(reader, "_reading_trailer", True):
        return 0
    return max(left, 0)


class Feed:
    """What one side of a connection sent that its h11 connection has not been given yet,
    given to h11 at most ``HEAD_LINES`` line ends at a time, once it asks for more.

    h11 parses a trailer (the header lines after a chunked body's last chunk) in one go
    when its blank line comes, however many lines it has (within ``HEAD_LIMIT``): 12,000
    ``a:b`` lines held the loop every sandbox shares ~20 ms a message. Given in pieces,
    h11 holds no more than ``HEAD_LINES`` line ends unparsed when it asks for more, or
    the message is refused (``over``); a body's bytes it turns into events as they come,
    and holds none of them. A body of a known length (``sized``) has no lines to parse:
    it is given as it comes, up to its end (cut in lines, a body of short text lines went
    through at a third of its speed), and so is the rest of a chunk h11 is inside
    (``chunk_left``). Heads are given whole, once counted (``next_request``,
    ``answer_head``): a feed carries the bytes after them."""

    def __init__(self, conn: Any, stream: Stream, over: Callable[[], Refused], held: bytes = b"") -> None:
        self.conn = conn
        self.stream = stream
        self.over = over  # the refusal of a message whose trailer is too long
        # What is held is ``_data[_at:]``: a read is cut into pieces by moving ``_at``, never by
        # copying what is left of it (a 256 KiB read of line ends is 1024 pieces: re-slicing it
        # each time copied 128 MiB in one step of the shared loop, and carried 9 MB/s).
        self._data = held
        self._at = 0
        self._pieces = 0  # given of the held bytes since the loop last served the others
        self.length: int | None = None  # what is left of a body of a known length

    @property
    def held(self) -> bool:
        """Whether something came that h11 was not given yet."""
        return self._at < len(self._data)

    def hold(self, data: bytes) -> None:
        """``data`` is what came that h11 was not given: it goes before the next read."""
        self._data, self._at = data, 0

    def sized(self, headers: Any) -> None:
        """The next body is the length ``headers`` say (h11 checked them), if they say one."""
        length = 0
        for key, value in headers:
            if key.lower() == b"transfer-encoding":
                length = 0  # chunked: its framing and trailer are lines
                break
            if key.lower() == b"content-length":
                length = int(bytes(value))
        self.length = length or None

    def take(self) -> bytes:
        data = self._data[self._at :] if self._at else self._data
        self.hold(b"")
        return data

    def passed_on(self) -> None:
        """What h11 was given has gone on (or is parsed): the read it came from counts no
        more against the sandbox's budget (``Plain.recv``), unless some of it waits here."""
        if not self.held:
            self.stream.release()

    async def recv(self) -> bytes:
        """What is held, else the next read (``b""``: the other side's end)."""
        return self.take() or await self.stream.recv()

    async def more(self) -> None:
        """h11 asked for more: the next piece (no read, while something is held)."""
        unread = 0
        if self.length is None:
            unread = self.conn.trailing_data[0].count(b"\n")
            if unread >= HEAD_LINES:  # it waits for the end of as many lines: a trailer too long
                raise self.over()
        if not self.held:
            self.hold(await self.stream.recv())
            if not self._data:
                self.conn.receive_data(b"")  # the end: h11 tells whether a message was cut by it
                return
        elif self._pieces >= PIECES_PER_TURN:
            self._pieces = 0
            await asyncio.sleep(0)
        self._pieces += 1
        data, start = self._data, self._at
        if self.length is not None:  # bytes past the body stay here: the next head, to count
            cut = min(len(data), start + self.length)
            self.length = (self.length - (cut - start)) or None
        elif chunk := chunk_left(self.conn):  # a chunk's bytes are data to h11, not lines
            cut = min(len(data), start + chunk)
        else:
            cut = lines_end(data, HEAD_LINES - unread, start)
        self._at = cut
        if cut == len(data):  # all h11's now (it copies what it is given): not held twice
            self.hold(b"")
        self.conn.receive_data(data[start:cut] if start or cut < len(data) else data)

    def give_back(self) -> None:
        """What is held to h11 itself (a tunnel's first bytes, which it does not parse)."""
        if self.held:
            self.conn.receive_data(self.take())


def request_trailer_over() -> Refused:
    return Refused(431, Verdict(
        allowed=False, rule="request (size)", reason=f"a request trailer of more than {HEAD_LINES} lines",
    ))  # fmt: skip


def answer_trailer_over() -> Refused:
    return Refused(502, Verdict(
        allowed=False, rule="reply (size)", reason=f"an answer trailer of more than {HEAD_LINES} lines",
    ))  # fmt: skip


async def next_request(feed: Feed, line: bytearray, gate: Gate) -> Any:
    """``next_event`` for a request's head, keeping what came of it in ``line`` until its
    first line end (at most ``LINE_LIMIT``): what a refusal of an unreadable head can name.

    The request is counted once its first bytes came (``Gate.admit``: ``Refused``, ``429``,
    past the sandbox's rate, before h11 parses any of it), its head's bytes as they come
    (``max_bytes_per_minute``), and its lines before h11 parses them: past ``HEAD_LINES``
    h11 never sees it (a ``RemoteProtocolError``, ``431``). h11 is given the head only;
    what came after it (its body, its trailer) stays in ``feed`` for h11 to get in pieces."""
    h11 = load_h11()
    conn = feed.conn
    head = HeadLines()
    data = conn.trailing_data[0]  # h11 has it already: the end of the last piece it was given
    given = bool(data)
    admitted = False
    while True:
        if not given:
            data = await feed.recv()
            if not data and not admitted:
                return h11.ConnectionClosed()
            if len(line) < LINE_LIMIT and b"\n" not in line:
                line += data[: LINE_LIMIT - len(line)]
        if not admitted:
            gate.admit()
            admitted = True
        taken = head.feed(data)
        gate.bytes.add(taken)
        if head.lines > HEAD_LINES:
            raise h11.RemoteProtocolError("too many lines in the request head", error_status_hint=431)
        if not given:
            if head.ended and not head.size:  # a head that begins blank: h11 refuses it at once
                taken = len(data)
            feed.hold(data[taken:])
            conn.receive_data(data[:taken])
        given = False
        event = conn.next_event()
        if event is h11.NEED_DATA:
            continue
        if event is h11.PAUSED:
            return h11.ConnectionClosed()
        return event


async def next_event(conn: Any, stream: Stream) -> Any:
    h11 = load_h11()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.recv())
            continue
        if event is h11.PAUSED:
            return h11.ConnectionClosed()
        return event


async def answer_head(up: Any, stream: Stream, rest: bytes) -> tuple[Any, bytes, HeadLines]:
    """The next head of a server's answer (an h11 event: a ``Response``, an
    ``InformationalResponse``, else ``ConnectionError``), the bytes that came after it
    (``rest``, before: what came after the last one), and its count.

    h11 is given the head only once it came whole and was counted (``HeadLines``): past
    ``HEAD_LINES`` lines or ``HEAD_LIMIT`` bytes, or with a folded line, it is a ``502`` and
    h11 parses none of it.
    The bytes after it stay here: they may be another head, to count in turn."""
    h11 = load_h11()
    head = HeadLines()
    data = rest
    while True:
        if not data:
            data = await stream.recv()
            if not data:
                up.receive_data(b"")  # the end: h11 tells a close before a head, or inside one
                break
        taken = head.feed(data)
        if head.lines > HEAD_LINES or head.size > HEAD_LIMIT:
            limit = (
                f"of more than {HEAD_LINES} lines"
                if head.lines > HEAD_LINES
                else f"longer than {HEAD_LIMIT} bytes"
            )
            raise Refused(502, Verdict(allowed=False, rule="reply (size)", reason=f"an answer head {limit}"))
        if head.folded:
            # h11 joins a folded line to the one before with a space (RFC 9112, 5.2), so a
            # value split there passed the scrub: "Bearer Tok", then " -Zq9x...". RFC 9112
            # lets a proxy answer 502 instead; no server need fold since RFC 7230 (2014).
            raise Refused(502, Verdict(
                allowed=False, rule="reply (syntax)", reason="an answer head with a folded line (obs-fold)",
            ))  # fmt: skip
        if head.ended and not taken:  # a head that begins blank: h11 refuses it at once
            taken = len(data)
        up.receive_data(data[:taken])
        data = data[taken:]
        if head.ended:
            break
    event = up.next_event()
    if not isinstance(event, h11.InformationalResponse | h11.Response):
        raise ConnectionError("the server closed without answering")
    return event, data, head


async def drain_body(feed: Feed) -> None:
    """Read what is left of a refused request's body (bounded), so the reply can be read;
    none if the client waits for a ``100 Continue`` before it sends one (it gets the refusal).
    A trailer too long ends it: the connection closes after the refusal."""
    h11 = load_h11()
    conn = feed.conn
    if conn.their_state is not h11.SEND_BODY or conn.they_are_waiting_for_100_continue:
        return
    budget = 1024 * 1024
    while budget > 0:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                await within(feed.more(), HEAD_TIMEOUT_S)
            except Refused:
                return
        elif isinstance(event, h11.Data):
            budget -= len(event.data)
        else:
            return
