"""CONNECT through a sandbox's proxy: a tunnel that carries TLS to the name it was asked for.

After ``200`` to a CONNECT the first bytes must be a TLS ClientHello whose SNI is the
CONNECT host; anything else closes the tunnel. Then either the proxy splices the bytes
both ways (the TLS is the client's and the server's), or, for a host with a credential or
with method rules, it answers the TLS itself with a certificate from the sandbox's own CA
(``intercept``) and hands each request inside to the HTTP exchange (``_http``).

A spliced tunnel must be TLS on both sides. The server speaks TLS first: the ClientHello
goes to it alone, and whatever the client sends after it waits, unread, until the server's
first bytes are a TLS ServerHello or alert (``answer_problem``); a server that answers
anything else (a Redis, SMTP or memcached server on an allowed port answering the hello
with an error line), closes, or does not answer in time gets nothing more, and the tunnel
closes. Checking the client's framing alone was not enough: a made-up record header in
front of plain text passes it, and a server that reads lines takes the header for a junk
line and runs the next. Then the client goes on carrying TLS records (``Records``): the
first bytes that are no record close the tunnel, unsent, and a header that a read ends
inside waits for the rest of it (``QUIT`` at a record's end is sent nowhere).
"""

from __future__ import annotations

import asyncio
import secrets
import ssl
from dataclasses import replace
from typing import Any

from stockade.egress._feed import HEAD_TIMEOUT_S, load_h11, next_event
from stockade.egress._gate import Gate, Refused
from stockade.egress._http import CONNECT_TIMEOUT_S, Exchange
from stockade.egress._records import Entry, cut_reason, denied, refuse
from stockade.egress._request import authority
from stockade.egress._rules import Verdict, ip_literal
from stockade.egress._streams import Plain, ServerTLS, connect, within
from stockade.egress._tls import MAX_HELLO, SandboxCA, server_name
from stockade.types import EgressRecord

# What a server has not taken of a tunnel's last bytes this long after the tunnel ended is
# dropped: a server that stops reading held the sandbox's buffer budget for as long as it
# kept the connection open.
LINGER_S = 10.0
# A TLS record's body at most (TLSCiphertext, RFC 5246 6.2.3; TLS 1.3's are smaller).
MAX_RECORD = 2**14 + 2048
RECORD_TYPES = range(20, 24)  # change_cipher_spec, alert, handshake, application_data
ALERT, HANDSHAKE, SERVER_HELLO = 21, 22, 2
ANSWER_HEAD = 6  # of a server's first bytes, what is checked: a record's header and the first of its body
# Records of one read looked at before the loop lets other connections run: ~0.25 µs each,
# and a read of 256 KiB of the smallest records is 43,000 of them (15 ms).
RECORDS_PER_TURN = 1024

__all__ = ["Tunnels"]


class Tunnels:
    """The CONNECT tunnels of one sandbox's proxy."""

    def __init__(self, gate: Gate, exchange: Exchange, ca: SandboxCA | None) -> None:
        self.gate = gate
        self.exchange = exchange
        self.ca = ca  # the sandbox's CA, when some host's TLS is opened; None after close
        # For a server to answer a tunnel's ClientHello (what the client sends meanwhile waits).
        self.answer_timeout_s = HEAD_TIMEOUT_S

    async def serve(self, conn: Any, client: Plain, request: Any) -> None:
        """Serve the CONNECT ``request`` read from ``client``; the connection ends with it.
        Its one record is told however it ends (``Entry``): a tunnel cut by close() (the
        sandbox killed) at the lookup, the hello, the connect or the splice too. A spliced
        tunnel is also told as it opens (``phase="open"``)."""
        target = request.target.decode("ascii", "replace")
        host, port = authority(target)
        with Entry(self.gate, EgressRecord(host=host, port=port, method="CONNECT")) as entry:
            await self._serve(conn, client, request, entry)

    async def _serve(self, conn: Any, client: Plain, request: Any, entry: Entry) -> None:
        h11 = load_h11()
        gate = self.gate
        host, port = entry.record.host, entry.record.port
        try:  # counted as it began (``Gate.admit``)
            if not host or not port:
                raise Refused(400, Verdict(
                    allowed=False, rule="request",
                    reason=f"bad CONNECT target {request.target.decode('ascii', 'replace')!r}",
                ))  # fmt: skip
            verdict = gate.judge.request(host, port, "CONNECT")
            entry.record = replace(entry.record, rule=verdict.rule)
            if not verdict.allowed:
                raise Refused(403, verdict)
            address = await gate.address(host, port)
        except Refused as refused:
            entry.decided = denied(entry.record, refused)
            await refuse(conn, client, refused, redact=gate.redact)
            entry.tell(entry.decided)
            return
        while not isinstance(await next_event(conn, client), h11.EndOfMessage | h11.ConnectionClosed):
            pass  # a CONNECT has no body; h11 switches protocols once its end is read
        await client.send(
            conn.send(h11.Response(status_code=200, headers=[], reason=b"Connection established"))
        )
        hello = conn.trailing_data[0]
        try:
            hello = await within(read_hello(client, hello), HEAD_TIMEOUT_S)
        except TimeoutError:
            hello = b""
        is_tls, sni = server_name(hello)
        record = entry.record = replace(entry.record, sni=sni or "")
        problem = sni_problem(host, is_tls, sni)
        if problem is not None:  # the tunnel is open: all we can do is close it
            entry.tell(replace(record, decision="deny", rule="tls (sni)", reason=problem))
            return
        if verdict.intercept:
            await self._intercept(client, (host, port, address), hello, entry)
            return
        try:
            upstream = await within(connect(address, port, buffers=gate.buffers), CONNECT_TIMEOUT_S)
        except (TimeoutError, OSError) as err:
            entry.tell(replace(record, status=502, reason=f"cannot reach {host}: {err}"))
            return
        # Told now, not only at its end: a tunnel may be held for the sandbox's whole life,
        # and the host may die before it ends. Its end record (bytes, why) has the same id.
        record = entry.record = replace(record, status=200, tunnel=secrets.token_hex(8))
        entry.opened(record)
        counts = [0, 0]
        # Why a side broke TLS, kept before the cleanup: a pump cancelled there ends the
        # client's stream, so the client may see the end (and close the proxy, cutting the
        # cleanup) before ``_splice`` returns; the record says why all the same.
        broken: list[NotTLS] = []
        try:
            await self._splice(client, upstream, hello, counts, broken)
        except BaseException as err:  # cut mid-way: what it carried until then, and why it ended
            entry.tell(carried(record, counts, broken, cut_reason(err)))
            raise
        entry.tell(carried(record, counts, broken, ""))

    async def _splice(
        self, client: Plain, upstream: Plain, first: bytes, counts: list[int], broken: list[NotTLS]
    ) -> None:
        """Send the ClientHello, wait for the server's TLS answer, then copy both ways until
        both ends are done or one is lost; ``broken`` gets why the tunnel was cut, if a side
        broke TLS (what broke it is not sent)."""
        records = Records()
        pumps: list[asyncio.Task[None]] = []
        try:
            await self._open(client, upstream, first, counts, records)
            pumps = [
                asyncio.create_task(self._pump(client, upstream, counts, 0, records)),
                asyncio.create_task(self._pump(upstream, client, counts, 1, None)),
            ]
            # An end of stream leaves the other way open (a client that sent its request and
            # shut its side down still reads the answer); a side lost ends both: the pump
            # toward a server that no longer reads waited on it for ever, and held the
            # sandbox's buffer budget with it.
            pending: set[asyncio.Task[None]] = set(pumps)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                failed = [task.exception() for task in done if not task.cancelled() and task.exception()]
                if failed:
                    broken.extend(err for err in failed if isinstance(err, NotTLS))
                    return
        except NotTLS as err:
            broken.append(err)
        finally:
            for task in pumps:
                task.cancel()
            try:
                if pumps:
                    await asyncio.gather(*pumps, return_exceptions=True)
            finally:  # cut while the pumps end (``close``): the server's connection is closed all the same
                if client.gone() or upstream.gone():
                    upstream.abort()  # nobody left to hear the rest, nor to wait for it to be sent
                else:
                    upstream.close_within(LINGER_S)

    async def _open(
        self, client: Plain, upstream: Plain, first: bytes, counts: list[int], records: Records
    ) -> None:
        """The ClientHello to the server, its TLS answer to the client, then what the client
        sent with its hello (its early data): until the server answered, the client is not
        read, so what it sends meanwhile waits in its stream (charged, within the stream's
        own cap: then it stops reading). Raises ``NotTLS`` if either side broke TLS."""
        first = await records.framed(first)
        end = 5 + (first[3] << 8 | first[4])  # the hello is one whole record (``read_hello``)
        await self._forward(first[:end], upstream, counts, 0)
        answer = await self._answer(upstream)
        upstream.release()  # the write takes its charge over
        await self._forward(answer, client, counts, 1)
        if len(first) > end:
            await self._forward(first[end:], upstream, counts, 0)

    async def _forward(self, data: bytes, dst: Plain, counts: list[int], index: int) -> None:
        counts[index] += len(data)
        self.gate.bytes.add(len(data))
        await dst.send(data)

    async def _pump(
        self, src: Plain, dst: Plain, counts: list[int], index: int, records: Records | None
    ) -> None:
        """Copy ``src`` to ``dst`` (``counts[index]`` the bytes), TLS records only where
        ``records`` follows them, until the end of ``src``."""
        try:
            while True:
                # The read in a list, popped into the write: while the write waits its copy is
                # what is held (and charged), not this one too.
                read = [await src.recv()]
                if not read[0]:
                    break
                if records is not None:
                    read[0] = await records.framed(read[0])
                    if not read[0]:  # a header's start, held back until the rest of it comes
                        continue
                size = len(read[0])
                counts[index] += size
                if not self.gate.bytes.add(size):
                    raise ConnectionError("the sandbox's bytes per minute are spent")
                src.release()  # the write takes its charge over, in this same step
                await dst.send(read.pop())
        finally:
            dst.eof()

    async def _answer(self, upstream: Plain) -> bytes:
        """The server's first bytes, once they are the start of a TLS ServerHello or alert
        (at least ``ANSWER_HEAD`` of them): the answer to a ClientHello that only a TLS
        server gives. Raises ``NotTLS`` for anything else, an end, or no answer in time."""
        data = b""
        try:
            async with asyncio.timeout(self.answer_timeout_s):
                while len(data) < ANSWER_HEAD:
                    more = await upstream.recv()
                    if not more:
                        break
                    data += more
        except TimeoutError:
            raise NotTLS(
                SERVER_RULE, f"the server did not answer the TLS ClientHello in {self.answer_timeout_s:g} s"
            ) from None
        if (problem := answer_problem(data)) is not None:
            raise NotTLS(SERVER_RULE, problem)
        return data

    async def _intercept(
        self, client: Plain, tunnel: tuple[str, int, str], hello: bytes, entry: Entry
    ) -> None:
        """Answer the tunnel's TLS as ``host`` (the sandbox's CA), then each request in it
        (each its own record: the tunnel's is theirs once the TLS is up)."""
        host = tunnel[0]
        assert self.ca is not None
        tls = ServerTLS(client, self.ca.context(host), hello)
        try:
            await within(tls.handshake(), HEAD_TIMEOUT_S)
        except (TimeoutError, ssl.SSLError, ConnectionError) as err:
            entry.tell(replace(entry.record, decision="deny", rule="tls (handshake)",
                               reason=f"the client refused the sandbox's certificate: {err}"))  # fmt: skip
            return
        entry.hand_on()
        await self.exchange.serve(tls, tunnel=tunnel)


SERVER_RULE, RECORDS_RULE = "tls (server)", "tls (records)"
NO_RECORD = "a tunnel must carry TLS; the client sent bytes that are no TLS record"


class NotTLS(ConnectionError):
    """A side of a spliced tunnel sent bytes that are no TLS (``rule``: which side; why)."""

    def __init__(self, rule: str, why: str) -> None:
        super().__init__(why)
        self.rule = rule


class Records:
    """Follows the TLS record framing of the client's side of a tunnel across its reads (a
    record spans reads, a header may be split between two): each header's content type
    (20-23), version (3.x) and length (1 to ``MAX_RECORD``: no record is empty) are checked,
    the bodies skipped. A header a read ends inside is held back (at most 4 bytes) until the
    next read completes it: sent at once, ``QUIT`` after a record reached a server that reads
    lines. ``framed`` looks at a read in place, and copies it only when it holds some back."""

    def __init__(self) -> None:
        self.left = 0  # bytes of the current record's body still to come
        self.head = b""  # the start of a header the last read ended in (under 5 bytes), unsent

    async def framed(self, data: bytes) -> bytes:
        """What may go on now of ``data``, the next bytes the client sent: a header the last
        read began first, without a header it ends inside. Raises ``NotTLS`` at the first
        bytes that break the framing (a header's start as soon as it is wrong)."""
        size = len(data)
        pos = self.left
        held = self.head
        if held:
            taken = min(5 - len(held), size)
            head = held + data[:taken]
            if len(head) < 5:
                self.head = head_checked(head)
                return b""
            self.head = b""
            length = head[3] << 8 | head[4]
            if (problem := record_problem(head[0], head[1], length)) is not None:
                raise NotTLS(RECORDS_RULE, problem)
            pos = taken + length
        looked = 0
        while pos + 5 <= size:
            length = data[pos + 3] << 8 | data[pos + 4]
            if (problem := record_problem(data[pos], data[pos + 1], length)) is not None:
                raise NotTLS(RECORDS_RULE, problem)
            pos += 5 + length
            looked += 1
            if looked % RECORDS_PER_TURN == 0:
                await asyncio.sleep(0)
        self.left = max(0, pos - size)
        if pos < size:
            self.head = head_checked(data[pos:size])
            return held + data[:pos]
        return held + data if held else data


def carried(record: EgressRecord, counts: list[int], broken: list[NotTLS], cut: str) -> EgressRecord:
    """A spliced tunnel's record once it ended: the bytes it carried each way, and why it
    ended: a side that broke TLS (its rule, the first one), else ``cut`` if it was cut."""
    record = replace(record, status=200, bytes_out=counts[0], bytes_in=counts[1])
    if broken:
        return replace(record, rule=broken[0].rule, reason=str(broken[0]))
    return replace(record, reason=cut) if cut else record


def head_checked(head: bytes) -> bytes:
    """``head``, the start of a record header (under 5 bytes), if it is right so far."""
    if head[0] not in RECORD_TYPES or (len(head) > 1 and head[1] != 3):
        raise NotTLS(RECORDS_RULE, NO_RECORD)
    return bytes(head)


def record_problem(kind: int, major: int, length: int) -> str | None:
    """What is wrong with a TLS record header of these fields, if anything."""
    if kind not in RECORD_TYPES or major != 3:
        return NO_RECORD
    if not 0 < length <= MAX_RECORD:
        return f"a tunnel must carry TLS; the client sent a TLS record of {length} bytes"
    return None


def answer_problem(data: bytes) -> str | None:
    """What is wrong with a server's first bytes as the answer to a ClientHello, if anything:
    they must begin a handshake record holding a ServerHello (a HelloRetryRequest is one
    too), or be an alert (two bytes: level 1 or 2, then what)."""
    if not data:
        return "a tunnel must carry TLS; the server closed without answering the TLS ClientHello"
    if len(data) >= ANSWER_HEAD and data[1] == 3:
        length = data[3] << 8 | data[4]
        if data[0] == HANDSHAKE and data[5] == SERVER_HELLO and 0 < length <= MAX_RECORD:
            return None
        if data[0] == ALERT and length == 2 and data[5] in (1, 2):
            return None
    return "a tunnel must carry TLS; the server answered the TLS ClientHello with bytes that are no TLS"


def sni_problem(host: str, is_tls: bool, sni: str | None) -> str | None:
    """Why a tunnel for ``host`` whose first bytes were this hello must close, if it must."""
    if not is_tls:
        return "a tunnel must carry TLS; the first bytes were not a TLS ClientHello"
    literal = ip_literal(host) is not None
    if sni is None and not literal:
        return f"the TLS ClientHello names no server; the tunnel is for {host}"
    if sni is not None and sni != host:
        return f"the TLS ClientHello asks for {sni}, the tunnel is for {host}"
    return None


async def read_hello(client: Plain, first: bytes) -> bytes:
    """The tunnel's first TLS record (the ClientHello), at most ``MAX_HELLO`` bytes."""
    data = bytearray(first)
    while len(data) < MAX_HELLO:
        if len(data) >= 5:
            if data[0] != 0x16:
                break
            if len(data) >= 5 + int.from_bytes(data[3:5], "big"):
                break
        chunk = await client.recv()
        if not chunk:
            break
        data += chunk
    return bytes(data)
