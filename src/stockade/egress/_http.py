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
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from stockade.egress._feed import (
    HEAD_LIMIT,
    HEAD_LINES,
    HEAD_TIMEOUT_S,
    INFORMATIONAL_LIMIT,
    LINE_LIMIT,
    Feed,
    HeadLines,
    answer_head,
    answer_trailer_over,
    drain_body,
    load_h11,
    next_request,
    request_trailer_over,
    write,
)
from stockade.egress._gate import MAX_REDIRECT_BASE, Gate, Refused
from stockade.egress._records import Entry, Progress, cut_short, denied, refuse, short
from stockade.egress._request import (
    HOP_BY_HOP,
    check_override,
    checked_path,
    forwarded_headers,
    has_body,
    head_size,
    header,
    request_line,
    target_parts,
    unreadable_verdict,
)
from stockade.egress._rules import Verdict
from stockade.egress._scrub import Reply, Scrubber, reply_decoder, scrubbed_head
from stockade.egress._streams import CHUNK, Plain, Stream, connect, within
from stockade.egress._upstream import Pool, UpstreamKey
from stockade.types import Credential, EgressRecord

__all__ = ["ANSWER_TIMEOUT_S", "CONNECT_TIMEOUT_S", "Exchange", "Target"]

ANSWER_TIMEOUT_S = 4 * HEAD_TIMEOUT_S  # from a request sent to its answer's final head
CONNECT_TIMEOUT_S = 15.0
# Body pieces (h11 events) handled before the loop lets other connections run: a read of
# 256 KiB in 1-byte chunks is 40,000 events, a tenth of a second of the shared loop.
EVENTS_PER_TURN = 1024
IDEMPOTENT = frozenset((b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"))


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
