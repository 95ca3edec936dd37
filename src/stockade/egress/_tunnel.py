"""CONNECT through a sandbox's proxy: a tunnel that carries TLS to the name it was asked for.

After ``200`` to a CONNECT the first bytes must be a TLS ClientHello whose SNI is the
CONNECT host; anything else closes the tunnel. Then either the proxy splices the bytes
both ways (the TLS is the client's and the server's), or, for a host with a credential or
with method rules, it answers the TLS itself with a certificate from the sandbox's own CA
(``intercept``) and hands each request inside to the HTTP exchange (``_http``).

A spliced tunnel goes on carrying TLS records from the client (``Records``): a ClientHello
followed by plain text reached the server before (an inline command to a Redis, SMTP or
memcached on an allowed port). The first bytes that are no TLS record close the tunnel,
unsent.
"""

from __future__ import annotations

import asyncio
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

    async def serve(self, conn: Any, client: Plain, request: Any) -> None:
        """Serve the CONNECT ``request`` read from ``client``; the connection ends with it.
        Its one record is told however it ends (``Entry``): a tunnel cut by close() (the
        sandbox killed) at the lookup, the hello, the connect or the splice too."""
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
        counts = [0, 0]
        try:
            problem = await self._splice(client, upstream, hello, counts)
        except BaseException as err:  # cut mid-way: what it carried until then, and why it ended
            entry.tell(replace(record, status=200, bytes_out=counts[0], bytes_in=counts[1],
                               reason=cut_reason(err)))  # fmt: skip
            raise
        record = replace(record, status=200, bytes_out=counts[0], bytes_in=counts[1])
        if problem is not None:
            record = replace(record, rule="tls (records)", reason=problem)
        entry.tell(record)

    async def _splice(self, client: Plain, upstream: Plain, first: bytes, counts: list[int]) -> str | None:
        """Copy both ways until both ends are done or one is lost; why the client's side was
        cut, if it broke TLS's framing (what broke it is not sent)."""
        window = self.gate.bytes
        records = Records()

        async def pump(src: Plain, dst: Plain, index: int) -> None:
            try:
                while True:
                    # The read in a list, popped into the write: while the write waits its
                    # copy is what is held (and charged), not this one too.
                    read = [await src.recv()]
                    size = len(read[0])
                    if not size:
                        break
                    if index == 0 and (problem := await records.check(read[0])) is not None:
                        raise NotTLS(problem)
                    counts[index] += size
                    if not window.add(size):
                        raise ConnectionError("the sandbox's bytes per minute are spent")
                    src.release()  # the write takes its charge over, in this same step
                    await dst.send(read.pop())
            finally:
                dst.eof()

        pumps: list[asyncio.Task[None]] = []
        try:
            if (problem := await records.check(first)) is not None:
                return problem
            if first:
                counts[0] += len(first)
                window.add(len(first))
                await upstream.send(first)
            pumps = [
                asyncio.create_task(pump(client, upstream, 0)),
                asyncio.create_task(pump(upstream, client, 1)),
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
                    return next((str(err) for err in failed if isinstance(err, NotTLS)), None)
            return None
        finally:
            for task in pumps:
                task.cancel()
            if pumps:
                await asyncio.gather(*pumps, return_exceptions=True)
            if client.gone() or upstream.gone():
                upstream.abort()  # nobody left to hear the rest, nor to wait for it to be sent
            else:
                upstream.close_within(LINGER_S)

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


class NotTLS(ConnectionError):
    """The client's side of a spliced tunnel sent bytes that are no TLS record (why)."""


class Records:
    """Follows the TLS record framing of the client's side of a tunnel across its reads (a
    record spans reads, a header may be split between two): each header's content type
    (20-23), version (3.x) and length (1 to ``MAX_RECORD``: no record is empty) are checked,
    the bodies skipped. ``check`` looks at a read in place, without a copy."""

    def __init__(self) -> None:
        self.left = 0  # bytes of the current record's body still to come
        self.head = b""  # the start of a header the last read ended in (under 5 bytes)

    async def check(self, data: bytes) -> str | None:
        """Why ``data``, the next bytes the client sent, breaks the framing, if it does."""
        size = len(data)
        pos = self.left
        if self.head:
            taken = min(5 - len(self.head), size)
            self.head += data[:taken]
            if len(self.head) < 5:
                return None
            head, self.head = self.head, b""
            if (problem := record_problem(head[0], head[1], head[3] << 8 | head[4])) is not None:
                return problem
            pos = taken + (head[3] << 8 | head[4])
        looked = 0
        while pos + 5 <= size:
            length = data[pos + 3] << 8 | data[pos + 4]
            if (problem := record_problem(data[pos], data[pos + 1], length)) is not None:
                return problem
            pos += 5 + length
            looked += 1
            if looked % RECORDS_PER_TURN == 0:
                await asyncio.sleep(0)
        self.left = max(0, pos - size)
        self.head = bytes(data[pos:size])
        return None


def record_problem(kind: int, major: int, length: int) -> str | None:
    """What is wrong with a TLS record header of these fields, if anything."""
    if kind not in RECORD_TYPES or major != 3:
        return "a tunnel must carry TLS; the client sent bytes that are no TLS record"
    if not 0 < length <= MAX_RECORD:
        return f"a tunnel must carry TLS; the client sent a TLS record of {length} bytes"
    return None


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
