"""CONNECT through a sandbox's proxy: a tunnel that carries TLS to the name it was asked for.

After ``200`` to a CONNECT the first bytes must be a TLS ClientHello whose SNI is the
CONNECT host; anything else closes the tunnel. Then either the proxy splices the bytes
both ways (the TLS is the client's and the server's), or, for a host with a credential or
with method rules, it answers the TLS itself with a certificate from the sandbox's own CA
(``intercept``) and hands each request inside to the HTTP exchange (``_http``).
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
            await self._splice(client, upstream, hello, counts)
        except BaseException as err:  # cut mid-way: what it carried until then, and why it ended
            entry.tell(replace(record, status=200, bytes_out=counts[0], bytes_in=counts[1],
                               reason=cut_reason(err)))  # fmt: skip
            raise
        entry.tell(replace(record, status=200, bytes_out=counts[0], bytes_in=counts[1]))

    async def _splice(self, client: Plain, upstream: Plain, first: bytes, counts: list[int]) -> None:
        window = self.gate.bytes

        async def pump(src: Plain, dst: Plain, index: int) -> None:
            try:
                while True:
                    # The read in a list, popped into the write: while the write waits its
                    # copy is what is held (and charged), not this one too.
                    read = [await src.recv()]
                    size = len(read[0])
                    if not size:
                        break
                    counts[index] += size
                    if not window.add(size):
                        raise ConnectionError("the sandbox's bytes per minute are spent")
                    src.release()  # the write takes its charge over, in this same step
                    await dst.send(read.pop())
            finally:
                dst.eof()

        pumps: list[asyncio.Task[None]] = []
        try:
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
                if any(not task.cancelled() and task.exception() is not None for task in done):
                    break
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
