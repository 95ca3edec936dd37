"""One HTTP request through a sandbox's proxy: checked, sent to its server, its answer back.

``Exchange.forward`` serves a request read from the client, whether it came as an absolute
``http://`` URL or inside a tunnel whose TLS the proxy opened (``_tunnel``): the policy's
verdict first (``Gate``), then the request re-framed by ``h11`` to the address that was
checked, the credential added on the way out and scrubbed from what comes back, a redirect
the policy would refuse turned into a ``403``, and one ``EgressRecord`` for the request
with its status and the bytes of both bodies, counted as they go (``Progress``): a request
that ends early is recorded with what of it went.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import ssl
import time
import urllib.parse
import zlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from stockade.egress._gate import MAX_REDIRECT_BASE, Forms, Gate, Refused, redacted
from stockade.egress._rules import Verdict, ip_literal
from stockade.egress._streams import CHUNK, Plain, Stream, connect, within
from stockade.egress._upstream import Pool, UpstreamKey
from stockade.types import Credential, EgressRecord

__all__ = [
    "CONNECT_TIMEOUT_S",
    "HEAD_LIMIT",
    "HEAD_LINES",
    "HEAD_TIMEOUT_S",
    "Entry",
    "Exchange",
    "Progress",
    "Target",
    "authority",
    "cut_reason",
    "cut_short",
    "denied",
    "load_h11",
    "next_event",
    "refuse",
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
ANSWER_TIMEOUT_S = 4 * HEAD_TIMEOUT_S  # from a request sent to its answer's final head
CONNECT_TIMEOUT_S = 15.0
# Body pieces (h11 events) handled before the loop lets other connections run: a read of
# 256 KiB in 1-byte chunks is 40,000 events, a tenth of a second of the shared loop.
EVENTS_PER_TURN = 1024
# Pieces of one read given to h11 (``Feed``) before the loop lets other connections run: a
# piece is a parse of up to HEAD_LINES lines, ~10-25 µs; a read of short chunks full of line
# ends is ~2,000 of them, and held the shared loop ~50 ms when only events were counted.
PIECES_PER_TURN = 128
IDEMPOTENT = frozenset((b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"))
HOP_BY_HOP = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"proxy-authenticate",
     b"te", b"trailer", b"transfer-encoding", b"upgrade")
)  # fmt: skip


@functools.cache
def load_h11() -> Any:
    """The ``h11`` module (imported on first use: it comes with the egress extra)."""
    try:
        import h11
    except ImportError:  # pragma: no cover - a dependency of the egress extra
        from stockade.exceptions import ConfigurationError

        raise ConfigurationError('network allowlists need `h11`: pip install "stockade[egress]"') from None
    return h11


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where one request goes: the name asked for, and the address checked for it."""

    host: str
    port: int
    address: str
    scheme: str
    path: str

    @property
    def authority(self) -> str:
        return (f"[{self.host}]" if ":" in self.host else self.host) + f":{self.port}"


class Progress:
    """What of one HTTP request has gone each way so far, kept by the relay as it goes: a
    request that ends early (a redirect or an answer refused, a limit hit mid-body, either
    side gone, the proxy closed) is recorded with what went, not as if nothing had."""

    def __init__(self, credential: str) -> None:
        self.credential = credential  # the name of the one the request's head carries, if any
        self.sent = False  # the head went to the server (with the credential)
        self.bytes_out = 0  # body bytes passed on to the server
        self.answer = 0  # the server's final status, once its head came
        self.passed = 0  # that status, once its head was passed on to the client
        self.bytes_in = 0  # body bytes of the answer passed on to the client

    def went(self, size: int) -> None:
        """A write to the server: the head first, then ``size`` bytes of the body."""
        self.sent = True
        self.bytes_out += size

    def came(self, size: int) -> None:
        """A write to the client: the answer's head first, then ``size`` bytes of its body."""
        self.passed = self.answer
        self.bytes_in += size

    def onto(self, record: EgressRecord) -> EgressRecord:
        """``record`` with the bytes that went, and the credential's name once a head carried it."""
        return replace(
            record,
            bytes_out=self.bytes_out,
            bytes_in=self.bytes_in,
            credential=self.credential if self.sent else "",
        )


class Entry:
    """One request's ``EgressRecord``, told exactly once however the request ends.

    ``tell`` it when the request ends as it should. Until then ``record`` holds what is known
    (host, rule, SNI) and, as a ``with`` block, the entry tells that if the request ends any
    other way, at any await (the proxy closed or reset at a lookup, a TLS hello, a connect,
    a reply; the client gone): why, with what of it went (``progress``, once an HTTP
    request is sent: its bytes, its credential, the server's status if the client got it;
    status 0 before), so a cut is in the trail too. ``decided`` is a record settled before
    its last awaits (a refusal still to be sent): told as it is if what follows is cut."""

    def __init__(self, gate: Gate, record: EgressRecord) -> None:
        self.gate = gate
        self.record = record
        self.progress: Progress | None = None
        self.decided: EgressRecord | None = None
        self.started = time.monotonic()
        self.told = False

    def tell(self, record: EgressRecord) -> None:
        if not self.told:
            self.told = True
            self.gate.emit(replace(record, duration_s=time.monotonic() - self.started))

    def hand_on(self) -> None:
        """The record is others' now (each request inside a tunnel whose TLS the proxy opened)."""
        self.told = True

    def __enter__(self) -> Entry:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> None:
        if self.told or err is None:
            return
        if self.decided is not None:
            self.tell(self.decided)
        elif self.progress is not None:
            self.tell(
                replace(self.progress.onto(self.record), status=self.progress.passed, reason=cut_reason(err))
            )
        else:
            self.tell(replace(self.record, status=0, reason=cut_reason(err)))


def cut_reason(err: BaseException) -> str:
    """Why a request ended before its record was told (the kind, not the message: h11's quote bytes)."""
    if isinstance(err, asyncio.CancelledError):
        return "cut: the sandbox's proxy was closed mid-request"
    return f"cut: the connection ended mid-request ({type(err).__name__})"


class Scrubber:
    """Replaces a secret's forms (``Forms``, in any letter case) in a stream of bytes, across
    chunk borders: the last bytes of a chunk, which may begin a form the next one ends, wait
    for it as they came (looked at again with it, never a second time once replaced)."""

    def __init__(self, forms: Forms) -> None:
        self.forms = forms
        self.keep = max(forms.longest - 1, 0)
        self.tail = b""

    def feed(self, data: bytes) -> bytes:
        data = self.tail + data
        runs = self.forms.runs(data)
        cut = max(len(data) - self.keep, 0)  # a form that begins before it ends in ``data``
        for start, end in runs:
            if start < cut < end:  # a run the cut would split goes whole
                cut = end
        self.tail = data[cut:]
        return redacted(data[:cut], [run for run in runs if run[1] <= cut])

    def end(self) -> bytes:
        data, self.tail = self.tail, b""
        return self.forms.scrub(data)


DECODED = frozenset(("gzip", "x-gzip", "deflate"))  # codings undone to scrub a credential host's reply
# The gzip members one ``Decoder.feed`` starts before it gives the loop a turn: each is a new
# decompressor, ~1 µs, and a read of 256 KiB holds 13,000 empty ones (a body anyone may
# upload to a credential's host, an object store, and ask for back).
MEMBERS_PER_TURN = 256
# What of a read a decompressor is given at once: at a member's end it copies what is left
# (``unused_data``), so a read of many members cost its size once a member (50 ms, 15 so).
DECODER_INPUT = 16 * 1024


class Decoder:
    """Undoes a ``Content-Encoding`` (gzip, deflate) as the body comes, in pieces of at most
    ``CHUNK``: a credential host's reply the proxy must read to scrub (it asked for none).
    Every byte of the body is decoded or the reply cut (``ConnectionError``), none dropped:
    gzip members one after another (RFC 1952, 2.2; the zeros some pad with between them
    skipped, as Python's ``gzip`` does) are each decoded, where only the first was before;
    bytes after a deflate stream's end are an error. An empty piece is the loop's turn for
    the others (``MEMBERS_PER_TURN``)."""

    def __init__(self, coding: str) -> None:
        self.deflate = coding == "deflate"
        self.started = False
        self.members = 0
        self.wbits = zlib.MAX_WBITS | (16 if not self.deflate else 0)
        self.obj = zlib.decompressobj(self.wbits)

    def feed(self, data: bytes) -> Iterator[bytes]:
        if self.deflate and not self.started and data:
            self.started = True
            if data[0] & 0x0F != 8:  # "deflate" is zlib-wrapped (RFC 9110, 8.4.1.2); some send it raw
                self.obj = zlib.decompressobj(-zlib.MAX_WBITS)
        try:
            for at in range(0, len(data), DECODER_INPUT):
                yield from self._inflate(data[at : at + DECODER_INPUT])
        except zlib.error:
            raise ConnectionError("a compressed reply that does not decompress") from None

    def _inflate(self, data: bytes) -> Iterator[bytes]:
        while data:
            if self.obj.eof:  # a member ended, and bytes follow it
                if self.deflate:
                    raise ConnectionError("a compressed reply with bytes after its end")
                data = data.lstrip(b"\0")
                if not data:
                    return
                self.obj = zlib.decompressobj(self.wbits)
                self.members += 1
                if self.members % MEMBERS_PER_TURN == 0:
                    yield b""
            piece = self.obj.decompress(data, CHUNK)
            data = self.obj.unconsumed_tail or self.obj.unused_data
            if piece:
                yield piece

    def end(self) -> bytes:
        try:
            return self.obj.flush()
        except zlib.error:
            raise ConnectionError("a compressed reply that does not decompress") from None


class Reply:
    """What a credential host's reply body becomes on its way to the code: decoded if the
    server encoded it anyway, then scrubbed of the secret's forms; decoded bytes count
    against the sandbox's bytes per minute (``spend``), so a compression bomb is a ``429``."""

    def __init__(self, scrubber: Scrubber, decoder: Decoder | None, spend: Callable[[int], None]) -> None:
        self.scrubber = scrubber
        self.decoder = decoder
        self.spend = spend

    def feed(self, data: bytes) -> Iterator[bytes]:
        """What goes to the code of ``data``, in pieces; an empty one is a turn for the others."""
        if self.decoder is None:
            if scrubbed := self.scrubber.feed(data):
                yield scrubbed
            return
        for piece in self.decoder.feed(data):
            if not piece:
                yield piece
                continue
            self.spend(len(piece))
            if scrubbed := self.scrubber.feed(piece):
                yield scrubbed

    def end(self) -> bytes:
        rest = b""
        if self.decoder is not None:
            rest = self.decoder.end()
            self.spend(len(rest))
        return self.scrubber.feed(rest) + self.scrubber.end()


class Exchange:
    """The HTTP requests of one sandbox's proxy, and its connections kept to servers."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.upstreams: Pool[Plain] = Pool()  # connections to servers, kept between this sandbox's requests
        self.head_timeout_s = HEAD_TIMEOUT_S  # for a request's head to come whole
        self.answer_timeout_s = ANSWER_TIMEOUT_S  # for a server's final head, 1xx ones included

    async def serve(
        self,
        client: Stream,
        *,
        tunnel: tuple[str, int, str] | None,
        on_connect: Callable[[Any, Any], Awaitable[None]] | None = None,
    ) -> None:
        """Each request of one client connection (plain, or the TLS inside a ``tunnel``) in
        turn, while both sides keep it open; a ``CONNECT`` goes to ``on_connect`` (plain only),
        which then owns the connection."""
        h11 = load_h11()
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT)
        feed = Feed(conn, client, request_trailer_over)
        while True:
            line = bytearray(conn.trailing_data[0][:LINE_LIMIT])  # the next request's, if here
            try:
                event = await within(next_request(feed, line, self.gate), self.head_timeout_s)
            except Refused as over:  # past the rate: answered, and closed unread
                await self.unreadable(conn, client, over, bytes(line), tunnel=tunnel)
                return
            except h11.RemoteProtocolError as err:
                await self.unreadable(
                    conn, client, Refused(*unreadable_verdict(err)), bytes(line), tunnel=tunnel
                )
                return
            except TimeoutError:
                if line:  # a head begun and not ended (a connection idle before one is no request)
                    await self.unreadable(
                        conn, client, Refused(*unreadable_verdict(None)), bytes(line), tunnel=tunnel
                    )
                return
            if not isinstance(event, h11.Request):
                return
            if head_size(event) > HEAD_LIMIT:
                # h11 bounds a head only while it is incomplete: one that came whole in one
                # read (up to a read's 256 KiB) is measured here.
                too_long = h11.RemoteProtocolError("request head too long", error_status_hint=431)
                await self.unreadable(
                    conn, client, Refused(*unreadable_verdict(too_long)), bytes(line), tunnel=tunnel
                )
                return
            if client.gone():
                # A request pipelined behind one whose answer found the client gone (its code
                # ended, the sandbox reset for its next user): what is buffered goes nowhere.
                return
            if on_connect is not None and event.method == b"CONNECT":
                feed.give_back()  # the tunnel's first bytes, where the tunnel looks for them
                await on_connect(conn, event)
                return
            feed.sized(event.headers)
            feed.passed_on()  # the head is h11's, parsed: its read no longer counts
            if not await self.forward(feed, event, tunnel=tunnel):
                return
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
            # The next request may be here already (pipelined): the other connections, other
            # sandboxes' too, get the loop first, as if it had had to come.
            await asyncio.sleep(0)

    async def unreadable(
        self,
        conn: Any,
        client: Stream,
        refused: Refused,
        line: bytes,
        *,
        tunnel: tuple[str, int, str] | None,
    ) -> None:
        """Answer and record a request whose head was not read: one h11 refused to read (a
        ``400``, ``431`` for one too long, ``408`` for one not whole in time:
        ``unreadable_verdict``), or one past the sandbox's rate (``429``, not read at all);
        nothing of it goes anywhere. The record names what the request line names, if it
        came and is one; the reason is ours, never h11's message (which quotes the bytes)."""
        method, target = request_line(line)
        host, port, path = target_parts(target, tunnel)
        with Entry(self.gate, EgressRecord(host=host, port=port, method=method, path=short(path))) as entry:
            entry.decided = denied(entry.record, refused)
            with contextlib.suppress(Exception):  # the client may be gone: the record stays
                await refuse(conn, client, refused, redact=self.gate.redact)
            entry.tell(entry.decided)

    async def forward(self, feed: Feed, request: Any, *, tunnel: tuple[str, int, str] | None) -> bool:
        """Forward one request (read from ``feed``) and its response; False when the
        connection must close."""
        method = request.method.decode("ascii", "replace").upper()
        target = request.target.decode("ascii", "replace")
        host, port, path = target_parts(target, tunnel)
        with Entry(self.gate, EgressRecord(host=host, port=port, method=method, path=short(path))) as entry:
            return await self._forward(feed, request, entry, tunnel=tunnel)

    async def _forward(
        self, feed: Feed, request: Any, entry: Entry, *, tunnel: tuple[str, int, str] | None
    ) -> bool:
        conn, client = feed.conn, feed.stream
        gate = self.gate
        method, host, port = entry.record.method, entry.record.host, entry.record.port
        path = target_parts(request.target.decode("ascii", "replace"), tunnel)[2]
        scheme = "http" if tunnel is None else "https"
        try:  # counted as it began (``Gate.admit``), refused or not: each is a record
            path = checked_path(request, method, host, port, path, tunnel=tunnel)
            verdict = gate.judge.request(host, port, method)
            entry.record = replace(entry.record, path=short(path), rule=verdict.rule)
            if not verdict.allowed:
                raise Refused(403, verdict)
            check_override(request.headers, verdict, host)
            address = tunnel[2] if tunnel is not None else await gate.address(host, port)
        except Refused as refused:
            entry.decided = denied(entry.record, refused)
            await drain_body(feed)
            await refuse(conn, client, refused, redact=gate.redact)
            entry.tell(entry.decided)
            return refused.status != 400
        credential = verdict.credential if scheme == "https" else None  # never in clear text
        # From here the request goes out: what of it went (its bytes, its credential once its
        # head did) is counted as it goes, so a request cut or refused mid-way names it too.
        record = entry.record
        progress = entry.progress = Progress(credential.name if credential is not None else "")
        aim = Target(host=host, port=port, address=address, scheme=scheme, path=path)
        try:
            status, keep = await self._exchange(feed, request, aim, credential, progress=progress)
        except Refused as refused:  # a redirect refused, an encoding not undone, a limit mid-way
            entry.decided = cut_short(record, progress, refused)
            with contextlib.suppress(Exception):
                await refuse(conn, client, refused, redact=gate.redact)
            entry.tell(entry.decided)
            return False
        except (TimeoutError, OSError, ssl.SSLError, load_h11().ProtocolError) as err:
            if conn.their_state is load_h11().ERROR:  # the client's body broke its own framing
                broken = Refused(400, Verdict(
                    allowed=False, rule="request (framing)", reason="a body that breaks its framing",
                ))  # fmt: skip
                entry.decided = cut_short(record, progress, broken)
                with contextlib.suppress(Exception):
                    await refuse(conn, client, broken, redact=gate.redact)
                entry.tell(entry.decided)
                return False
            # h11's messages quote the bytes they refused: only that the answer was unreadable
            why = "the server's answer is not HTTP/1.1" if isinstance(err, load_h11().ProtocolError) else err
            if not progress.sent:
                reason = f"cannot reach {host}:{port}: {why}"
            elif client.gone():  # the code closed its side mid-request (read what it wanted, or gave up)
                reason = f"the client went away: {why}"
            else:
                reason = f"{host}:{port} failed: {why}"
            failed = Refused(502, Verdict(allowed=True, rule=verdict.rule, reason=reason))
            entry.decided = cut_short(record, progress, failed)
            with contextlib.suppress(Exception):
                await refuse(conn, client, failed, redact=gate.redact)
            entry.tell(entry.decided)
            return False
        entry.tell(replace(progress.onto(record), status=status))
        return keep

    async def _exchange(
        self,
        feed: Feed,
        request: Any,
        target: Target,
        credential: Credential | None,
        *,
        progress: Progress,
    ) -> tuple[int, bool]:
        """Send ``request`` (its body as it comes) to ``target`` and its response back,
        counting what went in ``progress``: (status, whether the client connection may go on).

        An idempotent request without a body may go over a connection kept from an earlier
        request of this sandbox to the same place (``_upstream``); if the server had closed
        that one before answering, the request goes once more, on a new connection (nothing
        of it reached the client yet). Any other request gets a new connection: a body is
        read from the client as it is sent, so it could not be sent twice, and a POST must
        not reach a server twice."""
        h11 = load_h11()
        key = UpstreamKey(
            address=target.address, port=target.port, scheme=target.scheme, host=target.host,
            credential=credential.name if credential is not None else "",
        )  # fmt: skip
        # Sent again only if it may be (RFC 9110: idempotent) and can be (no body to read twice).
        repeatable = request.method.upper() in IDEMPOTENT and not has_body(request.headers)
        held = self.upstreams.take(key) if repeatable else None
        while True:
            if held is None:
                upstream, up = await self._open(target), None
            else:
                upstream, up = held
            reused, held, keep, ended = up is not None, None, False, False
            if up is None:
                up = h11.Connection(h11.CLIENT, max_incomplete_event_size=HEAD_LIMIT)
            try:
                try:
                    response, rest = await self._send_request(
                        feed, request, target, credential, progress=progress, upstream=upstream, up=up
                    )
                except (OSError, h11.RemoteProtocolError) as err:
                    if reused and not isinstance(err, TimeoutError):
                        continue  # closed while kept (the finally closes it): again, on a new one
                    raise
                if reused and response.status_code == 408:
                    continue  # the server's "you were idle too long", sent before it closed
                answer = Feed(up, upstream, answer_trailer_over, held=rest)
                rest = b""  # the feed's, which lets it go once h11 has it: not held here all along
                answer.sized(response.headers)
                status = await self._send_response(
                    feed, response, target, credential, progress=progress, answer=answer
                )
                # Bytes the server sent past its answer would be read as the next one's
                # head, uncounted (``answer_head``): such a connection is not kept.
                keep = (
                    up.our_state is h11.DONE and up.their_state is h11.DONE
                    and not up.trailing_data[0] and not answer.held
                )  # fmt: skip
                ended = True
                return status, True
            finally:
                if keep:
                    up.start_next_cycle()
                    self.upstreams.give(key, upstream, up)
                elif ended:
                    upstream.close()
                else:  # cut (the sandbox killed, a limit, an error): no TLS goodbye to wait for
                    upstream.abort()

    async def _open(self, target: Target) -> Plain:
        tls = self.gate.upstream_context() if target.scheme == "https" else None
        return await within(
            connect(target.address, target.port, tls=tls, name=target.host, buffers=self.gate.buffers),
            CONNECT_TIMEOUT_S,
        )

    async def _send_request(
        self,
        feed: Feed,
        request: Any,
        target: Target,
        credential: Credential | None,
        *,
        progress: Progress,
        upstream: Plain,
        up: Any,
    ) -> tuple[Any, bytes]:
        """The request (head and body, read from ``feed``) to the server, and the head of
        its answer with the bytes that came after it, not given to h11 yet."""
        h11 = load_h11()
        conn, client = feed.conn, feed.stream
        headers = forwarded_headers(request.headers, target.host, target.port, target.scheme)
        secret, secrets = self.gate.secrets_for(credential)
        if credential is not None and secret:
            name = credential.header.lower().encode()
            # The reply is scrubbed of the secret: it must come back as plain bytes.
            headers = [(k, v) for k, v in headers if k.lower() not in (name, b"accept-encoding")]
            headers += [(credential.header.encode(), secrets[1]), (b"Accept-Encoding", b"identity")]
        head = up.send(h11.Request(method=request.method, target=target.path.encode(), headers=headers))
        self.gate.spend(0)  # its head was counted as it came (``next_request``)
        if conn.their_state is h11.SEND_BODY:
            if conn.they_are_waiting_for_100_continue:
                # The request is judged and its server reached: the client may send its body.
                # The proxy answers ``Expect`` itself (``forwarded_headers`` keeps it from the
                # server, whose 100 would come only after the body, as a 1xx not passed on).
                await client.send(
                    conn.send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue"))
                )
            await self._relay_body(feed, up, upstream, head=head, count=progress.went)
        else:  # read already (no body; or sent once, on a kept connection the server then closed)
            await upstream.send(head + up.send(h11.EndOfMessage()))
            progress.went(0)
        upstream.quickack()
        try:
            return await within(self._final_head(up, upstream), self.answer_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no answer in {self.answer_timeout_s:g} s") from None

    async def _final_head(self, up: Any, upstream: Plain) -> tuple[Any, bytes]:
        """The head of the server's final answer, after the 1xx ones (``100 Continue`` and
        the like, not passed on), each counted before h11 parses it (``answer_head``) and
        bounded together (``INFORMATIONAL_LIMIT``); a 1xx one counts against the bytes per
        minute here (the final one, in ``_send_response``): a server sending ``102`` without
        end would else cost the loop without limit. Between heads the loop serves the others."""
        h11 = load_h11()
        early = HeadLines()  # the 1xx heads' lines and bytes, together
        rest = b""  # what came after the last head, not yet given to h11
        for _ in range(INFORMATIONAL_LIMIT + 1):
            response, rest, counted = await answer_head(up, upstream, rest)
            if isinstance(response, h11.Response):
                return response, rest  # the body's first bytes, for h11 in pieces (``Feed``)
            self.gate.spend(counted.size)
            early.lines += counted.lines
            early.size += counted.size
            if early.lines > HEAD_LINES or early.size > HEAD_LIMIT:
                break
            await asyncio.sleep(0)
        raise Refused(502, Verdict(
            allowed=False, rule="reply (informational)",
            reason=(
                f"more than {INFORMATIONAL_LIMIT} informational (1xx) answers to one request, "
                f"or more than {HEAD_LINES} lines or {HEAD_LIMIT} bytes of them"
            ),
        ))  # fmt: skip

    async def _send_response(
        self,
        feed: Feed,
        response: Any,
        target: Target,
        credential: Credential | None,
        *,
        progress: Progress,
        answer: Feed,
    ) -> int:
        """The answer (its body read from ``answer``), checked and scrubbed, to the client
        (``feed``'s side): its status."""
        h11 = load_h11()
        conn, client = feed.conn, feed.stream
        progress.answer = response.status_code  # a refusal of it from here says what the server answered
        self.gate.spend(head_size(response))
        if 300 <= response.status_code < 400:
            base = f"{target.scheme}://{target.authority}{target.path[:MAX_REDIRECT_BASE]}"
            self.gate.check_redirect(response.status_code, header(response.headers, b"location"), base)
        # h11 gives header names lowercased (and each value checked): compared as they come.
        reason, reply = response.reason, None
        forms = self.gate.forms_for(credential)  # None exactly when there is nothing to scrub
        if forms is not None:  # scrubbing (and decoding) changes the length
            decoder = reply_decoder(response.headers, target.host)
            out_headers, reason = scrubbed_head(response.headers, response.reason, forms)
            reply = Reply(Scrubber(forms), decoder, self.gate.spend)
        else:
            out_headers = [(k, v) for k, v in response.headers if k not in HOP_BY_HOP]
        head = conn.send(h11.Response(status_code=response.status_code, headers=out_headers, reason=reason))
        await self._relay_body(answer, conn, client, reply=reply, head=head, count=progress.came)
        return int(response.status_code)

    @staticmethod
    async def _pass_on(
        body: list[bytes], dst: Any, dst_stream: Stream, out: list[bytes], reply: Reply | None
    ) -> None:
        """``body``'s pieces, joined once and taken from it, framed for ``dst`` into ``out``
        (through ``reply`` if any); a decoded reply goes out piece by piece, so a small
        compressed body is never held whole."""
        h11 = load_h11()
        data = b"".join(body)
        body.clear()  # the pieces go: only the joined copy stays (the pieces were h11's copies)
        if reply is None:
            out.append(dst.send(h11.Data(data=data)))
            return
        for piece in reply.feed(data):
            if not piece:  # the decoder's turn for the others (``MEMBERS_PER_TURN``)
                await asyncio.sleep(0)
                continue
            out.append(dst.send(h11.Data(data=piece)))
            if reply.decoder is not None:
                await write(dst_stream, out)

    async def _relay_body(
        self,
        feed: Feed,
        dst: Any,
        dst_stream: Stream,
        *,
        count: Callable[[int], None],
        reply: Reply | None = None,
        head: bytes = b"",
    ) -> None:
        """Carry one message body from one h11 connection (``feed``'s) to the other, after ``head`` (the
        message's head, already framed for ``dst``), telling ``count`` after each write to
        ``dst`` the body bytes (as read from ``src``) it carried: what went is known at
        every point the relay may end, not only when it returns.

        What is already here goes out in one write: the head with the body's first bytes,
        the last bytes with the message's end. Each write is a wake-up of the reader (on
        gVisor, of the relay and then of the code, each a few syscalls of 20-50 µs there);
        nothing waits for bytes that have not come (the head goes alone then: holding it
        for its body, when a server writes them apart, was measured and gained nothing).
        The pieces are kept in lists and joined once per write, never added one to another
        (a body in 1-byte chunks made that quadratic, and stalled every sandbox's proxy on
        the shared loop); and every ``EVENTS_PER_TURN`` pieces the loop serves the others.
        h11 gets what came in pieces of bounded lines (``Feed``): the next one with no
        write in between, while what came is not all given (every ``PIECES_PER_TURN``
        of them, the loop serves the others).

        While a write waits, the relay holds one copy of what it carries, the one written:
        the pieces h11 made and the joined body are let go first. The read they came from
        is charged to the sandbox until the write takes the charge over (``write``,
        ``Plain.send``); held across the wait, each copy was uncounted."""
        h11 = load_h11()
        src = feed.conn
        out: list[bytes] = [head] if head else []  # framed for dst, not yet sent
        body: list[bytes] = []  # read from src, not yet framed (one h11 Data for all of it)
        held = events = 0
        framed = 0  # body bytes in ``out``
        while True:
            event = src.next_event()
            if isinstance(event, h11.Data):
                self.gate.spend(len(event.data))
                body.append(event.data)  # h11's own copy (a bytearray): joined once, below
                held += len(event.data)
                events += 1
                if held < CHUNK and events < EVENTS_PER_TURN:
                    continue
                event = h11.Data  # not the piece: ``body`` has it, until it is joined
            elif event is h11.NEED_DATA and feed.held:  # what came is not all h11's yet
                await feed.more()
                continue
            elif event is not h11.NEED_DATA and not isinstance(event, h11.EndOfMessage):
                # the connection closed (h11 ``ConnectionClosed``, or ``PAUSED`` past its end)
                raise ConnectionError("the connection closed mid-message")
            if body:  # joined once: a body of tiny chunks costs what its bytes cost
                size, held = held, 0
                await self._pass_on(body, dst, dst_stream, out, reply)
                if out:
                    framed += size
                else:  # a decoded reply went out piece by piece (or is held to decode)
                    count(size)
            if isinstance(event, h11.EndOfMessage):
                rest = reply.end() if reply is not None else b""
                if rest:
                    out.append(dst.send(h11.Data(data=rest)))
                out.append(dst.send(h11.EndOfMessage()))
                await write(dst_stream, out, feed)
                count(framed)
                return
            if out:
                await write(dst_stream, out, feed)
                count(framed)
                framed = 0
            if event is h11.NEED_DATA:
                await feed.more()
            elif events >= EVENTS_PER_TURN:  # one read of tiny chunks is many events: let others run
                events = 0
                await asyncio.sleep(0)


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


async def refuse(conn: Any, client: Stream, refused: Refused, *, redact: Callable[[str], str]) -> None:
    """Answer the request ourselves: the status, the reason and the rule that refused it,
    through ``redact`` (``Gate.redact``): a reason may hold what a server sent."""
    h11 = load_h11()
    verdict = refused.verdict
    text = redact(f"stockade egress: {verdict.reason} (rule: {verdict.rule})")
    body = (text + "\n").encode("utf-8", "replace")
    reason = phrase(text)
    headers = [
        (b"Content-Type", b"text/plain; charset=utf-8"),
        (b"Content-Length", str(len(body)).encode()),
        (b"X-Stockade-Rule", phrase(redact(verdict.rule))),
        (b"Connection", b"close"),
    ]
    if conn.our_state not in (h11.SEND_RESPONSE, h11.IDLE):  # IDLE: a head h11 could not read
        return
    with contextlib.suppress(h11.LocalProtocolError):
        await client.send(conn.send(h11.Response(status_code=refused.status, headers=headers, reason=reason)))
        await client.send(conn.send(h11.Data(data=body)))
        await client.send(conn.send(h11.EndOfMessage()))


def phrase(text: str) -> bytes:
    """A reason phrase: visible ASCII and spaces only, short."""
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in text)[:300].encode("ascii")


def cut_short(record: EgressRecord, progress: Progress, refused: Refused) -> EgressRecord:
    """The record of a request that went out and that the proxy ended early (``refused``:
    a redirect or an answer refused, a limit hit mid-body, a body that broke its framing,
    a side gone): as it was judged if its head never reached the server (``denied``, or
    ``allow`` for a server that could not be reached). Else the server had it:
    ``allow``, with the bytes that went and the credential, the status the client got (the
    server's, if its head was passed on), and the rule and reason that ended it, after
    what the server answered, if it did (a ``302`` refused says both)."""
    if not progress.sent:
        nothing = denied(progress.onto(record), refused)
        return replace(nothing, decision="allow") if refused.verdict.allowed else nothing
    after = f"the server answered {progress.answer}, then " if progress.answer else "sent, then "
    return replace(
        progress.onto(record),
        status=progress.passed or refused.status,
        decision="allow",
        rule=refused.verdict.rule,
        reason=after + refused.verdict.reason,
    )


def denied(record: EgressRecord, refused: Refused) -> EgressRecord:
    return replace(
        record,
        status=refused.status,
        decision="deny",
        rule=refused.verdict.rule,
        reason=refused.verdict.reason,
    )


REQUEST_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+) ([\x21-\x7e]+) HTTP/\d\.\d\r?\n")


def request_line(data: bytes) -> tuple[str, str]:
    """(method, target) of ``data``'s first line if it is a request line, else (``""``, ``""``)."""
    found = REQUEST_LINE.match(data)
    if found is None:
        return "", ""
    return found[1].decode("ascii").upper(), found[2].decode("ascii")


def target_parts(target: str, tunnel: tuple[str, int, str] | None) -> tuple[str, int, str]:
    """(host, port, path) a request's target names: an absolute ``http://`` URL (port 0 for
    another scheme), or a path inside the ``tunnel`` (host, port, address)."""
    if tunnel is not None:
        return tunnel[0], tunnel[1], target
    if not target:
        return "", 0, ""
    try:
        parsed = urllib.parse.urlsplit(target)
    except ValueError:  # brackets that hold no IPv6 address, and the like: no URL, a 400
        return "", 0, target
    host = (parsed.hostname or "").lower().rstrip(".")
    literal = ip_literal(host)
    host = str(literal) if literal is not None else host
    try:
        port = (parsed.port or 80) if parsed.scheme == "http" else 0
    except ValueError:
        port = 0
    path = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
    return host, port, path


def checked_path(
    request: Any, method: str, host: str, port: int, path: str, *, tunnel: tuple[str, int, str] | None
) -> str:
    """The path to send ``request`` to, once its shape is one the proxy forwards; else
    ``Refused`` (``400``, ``403`` for a ``Host`` that is not the tunnel's)."""
    framings = [k for k, _ in request.headers if k in (b"transfer-encoding", b"content-length")]
    if len(set(framings)) > 1:
        # Two framings: read one way here and the other by a server, the bytes after the
        # body would be a request nobody judged (RFC 9112, 6.3: "ought to be handled as
        # an error"). No client sends both.
        raise Refused(400, Verdict(
            allowed=False, rule="request (framing)",
            reason="a request with both Content-Length and Transfer-Encoding",
        ))  # fmt: skip
    if method == "CONNECT":  # a tunnel is opened on the proxy's own connection, not inside one
        raise Refused(400, Verdict(
            allowed=False, rule="request (method)",
            reason="CONNECT inside a tunnel: open each tunnel through the proxy itself",
        ))  # fmt: skip
    if tunnel is not None:
        # Inside a tunnel the server reads the host from an absolute target, not from
        # Host (RFC 9112, 3.2.2): only the tunnel's own origin, sent as a path.
        inside = tunnel_path(request.target.decode("ascii", "replace"), tunnel)
        if inside is None:
            raise Refused(400, Verdict(
                allowed=False, rule="request (target)",
                reason=f"inside a tunnel to {host}:{port} the target must be a path (or https://{host}:{port}/...)",
            ))  # fmt: skip
        path = inside
    if tunnel is None and (not host or not port):  # port 0: not an http:// URL
        raise Refused(400, Verdict(
            allowed=False, rule="request",
            reason="send http:// URLs (that parse) as absolute URLs, and https:// through CONNECT",
        ))  # fmt: skip
    if tunnel is not None:
        said = header(request.headers, b"host")
        if said is not None and authority(said, default_port=port)[0] != host:
            raise Refused(403, Verdict(
                allowed=False, rule="request (host)",
                reason=f"the Host header names {said}; this tunnel is for {host}",
            ))  # fmt: skip
    return path


# Headers by which many servers (and frameworks: Rails, Laravel, Google and Azure APIs) let a
# request say it is another method, for clients that can only send GET and POST.
METHOD_OVERRIDES = (b"x-http-method-override", b"x-http-method", b"x-method-override")


def check_override(headers: Any, verdict: Verdict, host: str) -> None:
    """``Refused`` (``403``, the rule's) for a request to a host whose rule names methods
    that says, in a method-override header, it is a method the rule does not name."""
    if not verdict.methods:
        return
    for key, value in headers:
        name = bytes(key).lower()
        if name not in METHOD_OVERRIDES:
            continue
        for part in bytes(value).decode("latin-1").upper().split(","):
            said = part.strip()
            if said and said not in verdict.methods:
                # only a method's name is quoted: a header's value could be anything, a secret too
                shown = said if said.isalpha() and len(said) <= 16 else "another method"
                raise Refused(403, replace(verdict, allowed=False, reason=(
                    f"{shown} (said by {name.decode()}) to {host} is not allowed "
                    f"(allowed: {', '.join(verdict.methods)})"
                )))  # fmt: skip


def tunnel_path(target: str, tunnel: tuple[str, int, str]) -> str | None:
    """The origin-form target (a path) for a request inside ``tunnel``: ``target`` itself if
    it is one, the path of an absolute ``https://`` target naming the tunnel's own host and
    port; ``None`` for anything else (another host, another scheme, ``*``, a bare name)."""
    if target.startswith("/"):
        return target
    try:
        parsed = urllib.parse.urlsplit(target)
        port = parsed.port or 443
    except ValueError:
        return None
    host = (parsed.hostname or "").lower().rstrip(".")
    literal = ip_literal(host)
    host = str(literal) if literal is not None else host
    if parsed.scheme.lower() != "https" or parsed.username is not None or parsed.password is not None:
        return None
    if (host, port) != (tunnel[0], tunnel[1]) or parsed.fragment:
        return None
    return (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")


def unreadable_verdict(err: Any) -> tuple[int, Verdict]:
    """The status and the reason for a request head h11 refused (``None``: one that did not
    come whole in time). h11's own message quotes
    the bytes it refused (a header's value could be anything, a secret too): only its kind
    is kept."""
    message = str(err).lower()
    if err is None:
        status, rule, reason = 408, "request (timeout)", "the request's head did not end in time"
    elif getattr(err, "error_status_hint", 400) == 431 and "lines" in message:
        status, rule, reason = 431, "request (size)", f"a request head of more than {HEAD_LINES} lines"
    elif getattr(err, "error_status_hint", 400) == 431:
        status, rule, reason = 431, "request (size)", f"a request head longer than {HEAD_LIMIT} bytes"
    elif "content-length" in message:
        status, rule, reason = 400, "request (framing)", "two Content-Length values, or one that is no number"
    elif "transfer-encoding" in message:
        status, rule, reason = 400, "request (framing)", "a Transfer-Encoding other than chunked"
    elif "closed" in message:
        status, rule, reason = 400, "request (syntax)", "the connection ended inside the request's head"
    else:
        status, rule, reason = 400, "request (syntax)", "not HTTP/1.1 (the request line or a header)"
    return status, Verdict(allowed=False, rule=rule, reason=reason)


def authority(text: str, default_port: int = 0) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) as (host, port); (``""``, 0) when it does not parse."""
    text = text.strip()
    try:
        parsed = urllib.parse.urlsplit("//" + text)
        host = (parsed.hostname or "").lower().rstrip(".")
        port = parsed.port or default_port
    except ValueError:
        return "", 0
    literal = ip_literal(host)
    return (str(literal) if literal is not None else host), port


def header(headers: Any, name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def forwarded_headers(headers: Any, host: str, port: int, scheme: str) -> list[tuple[bytes, bytes]]:
    default = 443 if scheme == "https" else 80
    name = (f"[{host}]" if ":" in host else host) + (f":{port}" if port != default else "")
    out = [(b"Host", name.encode())]
    for key, value in headers:
        lower = key.lower()
        if lower in HOP_BY_HOP or lower in (b"host", b"content-length"):
            continue
        if lower == b"expect" and bytes(value).strip().lower() == b"100-continue":
            continue  # answered by the proxy (``Exchange._send_request``)
        out.append((bytes(key), bytes(value)))
    # One framing, the one h11 read the body by (Transfer-Encoding beats Content-Length; a
    # request with both is refused before this), and h11 re-frames the body it forwards.
    if any(k.lower() == b"transfer-encoding" for k, _ in headers):
        out.append((b"Transfer-Encoding", b"chunked"))
        return out
    for key, value in headers:
        if key.lower() == b"content-length":
            out.append((b"Content-Length", bytes(value)))
            break
    return out


def reply_decoder(headers: Any, host: str) -> Decoder | None:
    """How to undo a credential host's ``Content-Encoding`` (the proxy asked for none:
    compressed, the secret would pass the scrub): every coding it names, in every such
    header (a list, or the header twice: a client applies them all), ``identity`` aside.
    ``Refused`` (``502``) unless that is none or one the proxy undoes: two codings (even
    gzip twice) are refused, not undone in turn."""
    codings = [
        coding.strip().lower()
        for key, value in headers if key.lower() == b"content-encoding"
        for coding in bytes(value).decode("latin-1").split(",")
    ]  # fmt: skip
    codings = [c for c in codings if c not in ("", "identity")]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in DECODED:  # named, not quoted: a server may echo there
        raise Refused(502, Verdict(
            allowed=False, rule="reply (encoding)",
            reason=f"{host} answered in a Content-Encoding other than one gzip or deflate: not scrubbable",
        ))  # fmt: skip
    return Decoder(codings[0])


def head_size(event: Any) -> int:
    """About the bytes of a request's or a response's head as it came (h11 keeps its parts,
    not its bytes): its first line, and each header line with its ``": "`` and line end (so
    a head within ``HEAD_LIMIT`` has at most 16,384 header lines)."""
    first = 15 + len(event.reason) if hasattr(event, "reason") else 12 + len(event.method) + len(event.target)
    return first + sum(len(k) + len(v) + 4 for k, v in event.headers)


def has_body(headers: Any) -> bool:
    """Whether a request comes with a body (h11 has checked its framing headers)."""
    for key, value in headers:
        lower = key.lower()
        if lower == b"transfer-encoding" or (lower == b"content-length" and bytes(value).strip() != b"0"):
            return True
    return False


def scrubbed_head(headers: Any, reason: bytes, forms: Forms) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """A credential host's answer head for the code: its headers (but those the proxy frames
    itself) and its reason (a server can put anything there too) without the secret's forms,
    in any letter case. A name cannot hold "[REDACTED]" (no token): a header whose name holds
    a form goes. One scan of all the values and one of all the names (h11 allows no line end
    in either), not one per header (10,000 one-byte values and 18 forms: 9 ms of the loop,
    0.6 ms so). A folded value never gets here (``answer_head``)."""
    kept = [
        (bytes(k), bytes(v)) for k, v in headers
        if k not in HOP_BY_HOP and k not in (b"content-length", b"content-encoding")
    ]  # fmt: skip
    if forms.holds(b"\n".join(k for k, _ in kept)):
        kept = [(k, v) for k, v in kept if not forms.holds(k)]
    joined = b"\n".join([*(v for _, v in kept), bytes(reason)])
    *values, said = forms.scrub(joined).split(b"\n")
    return [(k, v) for (k, _), v in zip(kept, values, strict=True)], said


def short(path: str, limit: int = 2048) -> str:
    return path if len(path) <= limit else path[:limit] + "…"
