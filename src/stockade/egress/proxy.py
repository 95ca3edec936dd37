"""The egress proxy of one sandbox: HTTP and HTTPS (CONNECT) to the hosts its policy allows.

It listens where only its sandbox can reach it (a Unix socket in the sandbox's run folder,
see ``docs/architecture.md``) and decides each request with ``Judge``:

* **Names, then addresses.** The host must match a rule (name, port, method). The proxy then
  resolves the name itself, once, refuses it if any answer is not a public address (unless
  allowed), and connects to an address it checked: a name that rebinds between the check
  and the connection has nothing to rebind. The sandbox has no DNS of its own.
* **Tunnels carry TLS to the name asked for.** After ``200`` to a CONNECT, the first bytes
  must be a TLS ClientHello whose SNI is the CONNECT host; anything else closes the tunnel.
* **Opened TLS** (``intercept``): for a host with a credential or with method rules, the
  proxy answers the TLS itself with a certificate from the sandbox's own CA, checks each
  request (method, ``Host``), adds the credential and makes its own verified TLS
  connection to the server. The credential's value is scrubbed from what comes back.
* **Redirects** are checked like requests: a ``3xx`` whose ``Location`` the policy would
  refuse becomes a ``403`` (the client never sees where it led).
* **Limits**: requests and bytes per minute, and connections at once, per sandbox.

A refusal is ``403`` (``429`` for a limit) with a one-line reason and the rule, in the
status line, the ``X-Stockade-Rule`` header and the body; every request, allowed or not,
is an ``EgressRecord`` for the observer (the audit trail).

Hand-written on ``h11`` (HTTP/1.1 parsing, from the python-hyper project) and ``ssl``:
the decisions above sit between parsing and connecting (resolve once, connect to what
was checked; SNI before any byte goes out; scrubbing), which the proxy libraries on PyPI
(mitmproxy, proxy.py) do not expose without replacing their connection handling, and
they bring their own event loop and dozens of dependencies into the SDK's process.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import ssl
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from stockade.egress._rules import Judge, Verdict, ip_literal
from stockade.egress._tls import MAX_HELLO, SandboxCA, server_name
from stockade.egress._upstream import Pool, UpstreamKey
from stockade.types import Credential, EgressRecord, NetworkPolicy

__all__ = ["EgressObserver", "EgressProxy", "EgressRecord", "Resolver", "SystemResolver"]

T = TypeVar("T")
CHUNK = 256 * 1024
HEAD_LIMIT = 64 * 1024  # request or response head: bigger is refused
HEAD_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 15.0
MAX_CONNECTIONS = 128  # at once, per sandbox
QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)  # Linux
IDEMPOTENT = frozenset((b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"))
MAX_REDIRECT_BASE = 8192
RESOLVE_TTL_S = 15.0  # below most records' own TTL; getaddrinfo does not say theirs
RESOLVE_CACHE_SIZE = 1024  # names per sandbox
HOP_BY_HOP = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"proxy-authenticate",
     b"te", b"trailer", b"transfer-encoding", b"upgrade")
)  # fmt: skip


def _h11() -> Any:
    try:
        import h11
    except ImportError:  # pragma: no cover - a dependency of the egress extra
        from stockade.exceptions import ConfigurationError

        raise ConfigurationError('network allowlists need `h11`: pip install "stockade[egress]"') from None
    return h11


EgressObserver = Callable[[EgressRecord], None]


class Resolver(Protocol):
    async def resolve(self, host: str, port: int) -> list[str]:
        """The addresses of ``host`` (empty when it has none)."""
        ...


class SystemResolver:
    """The host's resolver, with ``pinned`` names answered first (``NetworkPolicy.resolve``).

    Answers are kept ``ttl_s`` (a burst of requests to one host, as ``pip install`` makes,
    asks the host's resolver once: its ``getaddrinfo`` runs in a thread, and a host without a
    caching resolver sends a query each time). Safe against rebinding: the proxy checks every
    answer each time, cached or not, and connects to an address it checked; a cache only
    keeps the answers the same for a while. Failures are not kept."""

    def __init__(
        self,
        pinned: Mapping[str, Sequence[str]] | None = None,
        *,
        ttl_s: float = RESOLVE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pinned = {k.lower().rstrip("."): list(v) for k, v in (pinned or {}).items()}
        self.ttl_s = ttl_s
        self.clock = clock
        self._cache: dict[tuple[str, int], tuple[float, list[str]]] = {}

    async def resolve(self, host: str, port: int) -> list[str]:
        if host in self.pinned:
            return list(self.pinned[host])
        if ip_literal(host) is not None:
            return [host]
        now = self.clock()
        kept = self._cache.get((host, port))
        if kept is not None and kept[0] > now:
            return list(kept[1])
        found = await self.lookup(host, port)
        if found and self.ttl_s > 0:
            if len(self._cache) >= RESOLVE_CACHE_SIZE:  # bounded: the expired go, else all
                self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                if len(self._cache) >= RESOLVE_CACHE_SIZE:
                    self._cache.clear()
            self._cache[(host, port)] = (now + self.ttl_s, list(found))
        return found

    async def lookup(self, host: str, port: int) -> list[str]:
        """Ask the host's resolver (``getaddrinfo``, in the loop's thread pool)."""
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=1)  # SOCK_STREAM
        except OSError:
            return []
        return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True, kw_only=True)
class _Target:
    """Where one request goes: the name asked for, and the address checked for it."""

    host: str
    port: int
    address: str
    scheme: str
    path: str

    @property
    def authority(self) -> str:
        return (f"[{self.host}]" if ":" in self.host else self.host) + f":{self.port}"


class _Refused(Exception):
    def __init__(self, status: int, verdict: Verdict) -> None:
        super().__init__(verdict.reason)
        self.status = status
        self.verdict = verdict


class _Window:
    """What one sandbox did in the last minute: requests, and bytes both ways."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0

    def add(self, amount: int) -> bool:
        """Count ``amount``; False once the minute's total is past the limit."""
        now = time.monotonic()
        while self.events and now - self.events[0][0] > 60.0:
            self.total -= self.events.popleft()[1]
        if self.events and now - self.events[-1][0] < 0.1:  # one entry per 100 ms at most
            t, n = self.events[-1]
            self.events[-1] = (t, n + amount)
        else:
            self.events.append((now, amount))
        self.total += amount
        return self.total <= self.limit


class _Stream(Protocol):
    async def recv(self) -> bytes: ...
    async def send(self, data: bytes) -> None: ...
    def close(self) -> None: ...


class _Plain:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def recv(self) -> bytes:
        return await self.reader.read(CHUNK)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def eof(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            if self.writer.can_write_eof():
                self.writer.write_eof()

    def close(self) -> None:
        self.writer.close()

    def quickack(self) -> None:
        """ACK what comes next at once. On a kept connection the kernel has learnt to delay
        its ACKs (request, answer, request: it waits to send one with the next request), and
        a server that writes an answer in two pieces with Nagle on holds the second until the
        first is ACKed: 40 ms per request. A new connection starts in quick-ACK mode."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6) and QUICKACK is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, QUICKACK, 1)

    def alive(self) -> bool:
        """Open both ways as far as we know (the server has not closed it, nor have we)."""
        return not self.reader.at_eof() and self.reader.exception() is None and not self.writer.is_closing()


class _ServerTLS:
    """TLS answered over a stream whose first bytes were already read (the ClientHello)."""

    def __init__(self, raw: _Plain, ctx: ssl.SSLContext, initial: bytes) -> None:
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
        await self._flush()

    def close(self) -> None:
        self.raw.close()


class _Scrubber:
    """Replaces the secrets in a stream of bytes, across chunk borders."""

    def __init__(self, secrets: Sequence[bytes]) -> None:
        self.secrets = [s for s in secrets if s]
        self.keep = max((len(s) for s in self.secrets), default=1) - 1
        self.tail = b""

    def feed(self, data: bytes) -> bytes:
        if not self.secrets:
            return data
        data = self.tail + data
        for secret in self.secrets:
            data = data.replace(secret, b"[REDACTED]")
        if self.keep and len(data) > self.keep:
            data, self.tail = data[: -self.keep], data[-self.keep :]
        elif self.keep:
            data, self.tail = b"", data
        return data

    def end(self) -> bytes:
        data, self.tail = self.tail, b""
        for secret in self.secrets:
            data = data.replace(secret, b"[REDACTED]")
        return data


class EgressProxy:
    """One sandbox's proxy over its ``NetworkPolicy``. ``start`` it on a Unix socket (or
    ``start_tcp``, for tests and benchmarks) in the loop of ``stockade.egress._loop``;
    ``close`` cuts every connection at once and drops the credentials."""

    def __init__(
        self,
        policy: NetworkPolicy,
        *,
        observer: EgressObserver | None = None,
        resolver: Resolver | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.policy = policy
        self.judge = Judge(policy)
        self.observer = observer
        self.resolver = resolver or SystemResolver(policy.resolve)
        self.max_connections = max_connections
        self.requests = _Window(policy.max_requests_per_minute)
        self.bytes = _Window(policy.max_bytes_per_minute)
        self.observer_failures = 0
        # Read once, here, on the host: the values live in this object and nowhere else.
        self._secrets: dict[str, str] = {c.name: c.source.read() for c in policy.credentials}
        intercepted = tuple(
            dict.fromkeys(
                [h for c in policy.credentials for h in c.hosts]
                + [r.host for r in self.judge.rules if r.methods]
            )
        )
        self.ca: SandboxCA | None = SandboxCA(intercepted) if intercepted else None
        self._upstream_tls: ssl.SSLContext | None = None
        self.upstreams: Pool[_Plain] = Pool()  # connections to servers, kept between this sandbox's requests
        self._listener: socket.socket | None = None
        self._connections: set[asyncio.Task[None]] = set()  # every accepted connection's task
        self._tasks: set[asyncio.Task[None]] = set()  # those being served (the limit counts them)
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def ca_pem(self) -> bytes | None:
        """The sandbox CA's certificate (what the sandbox must trust), if TLS is ever opened."""
        return self.ca.pem if self.ca is not None else None

    async def start(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
        except BaseException:
            sock.close()
            raise
        self._listen(sock)

    async def start_tcp(self, host: str = "127.0.0.1", port: int = 0) -> int:
        sock = socket.create_server((host, port))
        self._listen(sock)
        return int(sock.getsockname()[1])

    @property
    def serving(self) -> bool:
        """Whether the proxy still accepts connections (until ``close``)."""
        return self._listener is not None and not self._closed

    def _listen(self, sock: socket.socket) -> None:
        sock.listen(self.max_connections)
        sock.setblocking(False)
        self._listener = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept_ready, sock)

    def _accept_ready(self, sock: socket.socket) -> None:
        """Accept what waits, each connection into a task of its own that closes it.

        Not asyncio's ``Server`` (nor ``sock_accept``): a connection accepted but not yet set
        up when they are closed is dropped half-made, its socket closed only by the garbage
        collector, with a ``ResourceWarning`` (Python 3.11: ``Server._attach`` asserts and the
        error is swallowed; a cancelled ``sock_accept`` loses the socket it had accepted). The
        relay's warm connections arrive at a sandbox's start, so a sandbox closed right after
        it started met that. Here an accepted socket belongs to its task at once."""
        loop = asyncio.get_running_loop()
        for _ in range(self.max_connections):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors: the connection waits in the backlog a while
                loop.remove_reader(sock.fileno())
                loop.call_later(0.1, self._listen_again, sock)
                return
            task = loop.create_task(self._connection(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    def _listen_again(self, sock: socket.socket) -> None:
        if not self._closed:
            asyncio.get_running_loop().add_reader(sock.fileno(), self._accept_ready, sock)

    async def _connection(self, conn: socket.socket) -> None:
        if self._closed:
            conn.close()
            return
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=HEAD_LIMIT, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        try:
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, conn)
        except BaseException:
            conn.close()
            raise
        await self._accept(reader, asyncio.StreamWriter(transport, protocol, reader, loop))

    async def close(self) -> None:
        self._closed = True
        if self._listener is not None and self._listener.fileno() >= 0:
            asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        # Those accepted but not yet served see the proxy closed and close their connection.
        pending = [*tasks, *self._connections]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        self.upstreams.close()
        self._secrets.clear()
        self.ca = None

    # -- one client connection -------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._closed or len(self._tasks) >= self.max_connections:
            writer.write(
                b"HTTP/1.1 503 stockade: too many connections at once\r\nConnection: close\r\n"
                b"Content-Length: 0\r\n\r\n"
            )
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.close()
            return
        self._tasks.add(task)
        client = _Plain(reader, writer)
        try:
            await self._serve(client)
        except (TimeoutError, OSError, EOFError, ssl.SSLError, asyncio.IncompleteReadError):
            pass  # the client or the server went away: the record says what was done
        except asyncio.CancelledError:
            # ``close`` (the sandbox killed) cut this connection: that is the end of it, not a
            # failure to report (a cancellation from elsewhere still cancels the task).
            if not self._closed:
                raise
        except Exception as err:
            if not isinstance(err, _h11().ProtocolError):  # a client speaking nonsense: closed
                raise
        finally:
            self._tasks.discard(task)
            client.close()

    async def _serve(self, client: _Plain) -> None:
        h11 = _h11()
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT)
        while True:
            event = await _within(_next_event(conn, client), HEAD_TIMEOUT_S)
            if not isinstance(event, h11.Request):
                return
            if event.method == b"CONNECT":
                await self._connect(conn, client, event)
                return
            if not await self._forward(conn, client, event, tunnel=None):
                return
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    # -- CONNECT ---------------------------------------------------------------------------

    async def _connect(self, conn: Any, client: _Plain, request: Any) -> None:
        h11 = _h11()
        started = time.monotonic()
        target = request.target.decode("ascii", "replace")
        host, port = _authority(target)
        record = EgressRecord(host=host, port=port, method="CONNECT")
        try:
            if not host or not port:
                raise _Refused(
                    400, Verdict(allowed=False, rule="request", reason=f"bad CONNECT target {target!r}")
                )
            verdict = self.judge.request(host, port, "CONNECT")
            record = replace(record, rule=verdict.rule)
            if not verdict.allowed:
                raise _Refused(403, verdict)
            self._count_request(verdict)
            address = await self._address(host, port)
        except _Refused as refused:
            await _refuse(conn, client, refused)
            self._emit(_denied(record, refused, started))
            return
        while not isinstance(await _next_event(conn, client), h11.EndOfMessage | h11.ConnectionClosed):
            pass  # a CONNECT has no body; h11 switches protocols once its end is read
        await client.send(
            conn.send(h11.Response(status_code=200, headers=[], reason=b"Connection established"))
        )
        hello = conn.trailing_data[0]
        try:
            hello = await _within(_read_hello(client, hello), HEAD_TIMEOUT_S)
        except TimeoutError:
            hello = b""
        is_tls, sni = server_name(hello)
        record = replace(record, sni=sni or "")
        problem = self._sni_problem(host, is_tls, sni)
        if problem is not None:  # the tunnel is open: all we can do is close it
            self._emit(replace(record, decision="deny", rule="tls (sni)", reason=problem,
                               duration_s=time.monotonic() - started))  # fmt: skip
            return
        if verdict.intercept:
            await self._intercept(client, (host, port, address), hello, record, started)
            return
        try:
            up_reader, up_writer = await _within(
                asyncio.open_connection(address, port, limit=CHUNK), CONNECT_TIMEOUT_S
            )
        except (TimeoutError, OSError) as err:
            self._emit(replace(record, status=502, reason=f"cannot reach {host}: {err}",
                               duration_s=time.monotonic() - started))  # fmt: skip
            return
        upstream = _Plain(up_reader, up_writer)
        counts = [0, 0]
        try:
            await self._splice(client, upstream, hello, counts)
        finally:  # a tunnel cut by close() (the sandbox killed) is recorded too
            self._emit(replace(record, status=200, bytes_out=counts[0], bytes_in=counts[1],
                               duration_s=time.monotonic() - started))  # fmt: skip

    def _sni_problem(self, host: str, is_tls: bool, sni: str | None) -> str | None:
        if not is_tls:
            return "a tunnel must carry TLS; the first bytes were not a TLS ClientHello"
        literal = ip_literal(host) is not None
        if sni is None and not literal:
            return f"the TLS ClientHello names no server; the tunnel is for {host}"
        if sni is not None and sni != host:
            return f"the TLS ClientHello asks for {sni}, the tunnel is for {host}"
        return None

    async def _splice(self, client: _Plain, upstream: _Plain, first: bytes, counts: list[int]) -> None:

        async def pump(src: _Plain, dst: _Plain, index: int) -> None:
            try:
                while True:
                    data = await src.recv()
                    if not data:
                        break
                    counts[index] += len(data)
                    if not self.bytes.add(len(data)):
                        raise ConnectionError("the sandbox's bytes per minute are spent")
                    await dst.send(data)
            finally:
                dst.eof()

        try:
            if first:
                counts[0] += len(first)
                self.bytes.add(len(first))
                await upstream.send(first)
            results = await asyncio.gather(
                pump(client, upstream, 0), pump(upstream, client, 1), return_exceptions=True
            )
            for result in results:
                if isinstance(result, asyncio.CancelledError):
                    raise result
        finally:
            upstream.close()

    async def _intercept(
        self, client: _Plain, tunnel: tuple[str, int, str], hello: bytes, record: EgressRecord, started: float
    ) -> None:
        """Answer the tunnel's TLS as ``host`` (the sandbox's CA), then each request in it."""
        host = tunnel[0]
        h11 = _h11()
        assert self.ca is not None
        tls = _ServerTLS(client, self.ca.context(host), hello)
        try:
            await _within(tls.handshake(), HEAD_TIMEOUT_S)
        except (TimeoutError, ssl.SSLError, ConnectionError) as err:
            self._emit(replace(record, decision="deny", rule="tls (handshake)",
                               reason=f"the client refused the sandbox's certificate: {err}",
                               duration_s=time.monotonic() - started))  # fmt: skip
            return
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT)
        while True:
            event = await _within(_next_event(conn, tls), HEAD_TIMEOUT_S)
            if not isinstance(event, h11.Request):
                return
            if not await self._forward(conn, tls, event, tunnel=tunnel):
                return
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    # -- one HTTP request --------------------------------------------------------------------

    async def _forward(
        self, conn: Any, client: _Stream, request: Any, *, tunnel: tuple[str, int, str] | None
    ) -> bool:
        """Forward one request and its response; False when the connection must close."""
        started = time.monotonic()
        method = request.method.decode("ascii", "replace").upper()
        target = request.target.decode("ascii", "replace")
        if tunnel is None:
            parsed = urllib.parse.urlsplit(target)
            host = (parsed.hostname or "").lower().rstrip(".")
            literal = ip_literal(host)
            host = str(literal) if literal is not None else host
            try:
                port = (parsed.port or 80) if parsed.scheme == "http" else 0
            except ValueError:
                port = 0
            path = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
            scheme = "http"
        else:
            host, port, _ = tunnel
            path, scheme = target, "https"
        record = EgressRecord(host=host, port=port, method=method, path=_short(path))
        try:
            if tunnel is None and (parsed.scheme != "http" or not host or not port):
                raise _Refused(400, Verdict(
                    allowed=False, rule="request",
                    reason="send http:// URLs as absolute URLs, and https:// through CONNECT",
                ))  # fmt: skip
            if tunnel is not None:
                said = _header(request.headers, b"host")
                if said is not None and _authority(said, default_port=port)[0] != host:
                    raise _Refused(403, Verdict(
                        allowed=False, rule="request (host)",
                        reason=f"the Host header names {said}; this tunnel is for {host}",
                    ))  # fmt: skip
            verdict = self.judge.request(host, port, method)
            record = replace(record, rule=verdict.rule)
            if not verdict.allowed:
                raise _Refused(403, verdict)
            self._count_request(verdict)
            address = tunnel[2] if tunnel is not None else await self._address(host, port)
        except _Refused as refused:
            await _drain_body(conn, client)
            await _refuse(conn, client, refused)
            self._emit(_denied(record, refused, started))
            return refused.status != 400
        credential = verdict.credential if scheme == "https" else None  # never in clear text
        target = _Target(host=host, port=port, address=address, scheme=scheme, path=path)
        try:
            status, sent, received, keep = await self._exchange(conn, client, request, target, credential)
        except _Refused as refused:  # a redirect refused, or a limit reached mid-way
            with contextlib.suppress(Exception):
                await _refuse(conn, client, refused)
            self._emit(_denied(record, refused, started))
            return False
        except asyncio.CancelledError:
            # The proxy closed (the sandbox killed) mid-request: the request was made, with its
            # credential, so the trail keeps it, cut (status 0; its bytes were not counted).
            self._emit(replace(
                record, status=0, reason="cut: the sandbox's proxy was closed mid-request",
                credential=credential.name if credential is not None else "",
                duration_s=time.monotonic() - started,
            ))  # fmt: skip
            raise
        except (TimeoutError, OSError, ssl.SSLError) as err:
            with contextlib.suppress(Exception):
                await _refuse(conn, client, _Refused(502, Verdict(
                    allowed=True, rule=verdict.rule, reason=f"cannot reach {host}:{port}: {err}"
                )))  # fmt: skip
            self._emit(replace(record, status=502, reason=f"cannot reach {host}:{port}: {err}",
                               duration_s=time.monotonic() - started))  # fmt: skip
            return False
        self._emit(replace(
            record, status=status, bytes_out=sent, bytes_in=received,
            credential=credential.name if credential is not None else "",
            duration_s=time.monotonic() - started,
        ))  # fmt: skip
        return keep

    async def _exchange(
        self, conn: Any, client: _Stream, request: Any, target: _Target, credential: Credential | None
    ) -> tuple[int, int, int, bool]:
        """Send ``request`` (its body as it comes) to ``target`` and its response back:
        (status, bytes out, bytes in, whether the client connection may go on).

        An idempotent request without a body may go over a connection kept from an earlier
        request of this sandbox to the same place (``_upstream``); if the server had closed
        that one before answering, the request goes once more, on a new connection (nothing
        of it reached the client yet). Any other request gets a new connection: a body is
        read from the client as it is sent, so it could not be sent twice, and a POST must
        not reach a server twice."""
        h11 = _h11()
        key = UpstreamKey(
            address=target.address, port=target.port, scheme=target.scheme, host=target.host,
            credential=credential.name if credential is not None else "",
        )  # fmt: skip
        # Sent again only if it may be (RFC 9110: idempotent) and can be (no body to read twice).
        repeatable = request.method.upper() in IDEMPOTENT and not _has_body(request.headers)
        held = self.upstreams.take(key) if repeatable else None
        while True:
            if held is None:
                upstream, up = await self._open(target), None
            else:
                upstream, up = held
            reused, held, keep = up is not None, None, False
            if up is None:
                up = h11.Connection(h11.CLIENT, max_incomplete_event_size=HEAD_LIMIT)
            try:
                try:
                    sent, response = await self._send_request(
                        conn, client, request, target, credential, upstream=upstream, up=up
                    )
                except (OSError, h11.RemoteProtocolError) as err:
                    if reused and not isinstance(err, TimeoutError):
                        continue  # closed while kept (the finally closes it): again, on a new one
                    raise
                if reused and response.status_code == 408:
                    continue  # the server's "you were idle too long", sent before it closed
                status, received = await self._send_response(
                    conn, client, response, target, credential, upstream=upstream, up=up
                )
                keep = up.our_state is h11.DONE and up.their_state is h11.DONE
                return status, sent, received, True
            finally:
                if keep:
                    up.start_next_cycle()
                    self.upstreams.give(key, upstream, up)
                else:
                    upstream.close()

    async def _open(self, target: _Target) -> _Plain:
        tls = self._upstream_context() if target.scheme == "https" else None
        up_reader, up_writer = await _within(
            asyncio.open_connection(
                target.address, target.port, ssl=tls,
                server_hostname=target.host if tls is not None else None, limit=CHUNK,
            ),
            CONNECT_TIMEOUT_S,
        )  # fmt: skip
        return _Plain(up_reader, up_writer)

    def _secrets_for(self, credential: Credential | None) -> tuple[str | None, list[bytes]]:
        secret = self._secrets.get(credential.name) if credential is not None else None
        if credential is None or not secret:
            return None, []
        return secret, [secret.encode(), _credential_value(credential, secret)]

    async def _send_request(
        self,
        conn: Any,
        client: _Stream,
        request: Any,
        target: _Target,
        credential: Credential | None,
        *,
        upstream: _Plain,
        up: Any,
    ) -> tuple[int, Any]:
        """The request (head and body) to the server, and the head of its answer."""
        h11 = _h11()
        headers = _forwarded_headers(request.headers, target.host, target.port, target.scheme)
        secret, secrets = self._secrets_for(credential)
        if credential is not None and secret:
            name = credential.header.lower().encode()
            # The reply is scrubbed of the secret: it must come back as plain bytes.
            headers = [(k, v) for k, v in headers if k.lower() not in (name, b"accept-encoding")]
            headers += [(credential.header.encode(), secrets[1]), (b"Accept-Encoding", b"identity")]
        await upstream.send(
            up.send(h11.Request(method=request.method, target=target.path.encode(), headers=headers))
        )
        if conn.their_state is h11.SEND_BODY:
            sent = await self._relay_body(conn, client, up, upstream)
        else:  # read already: sent once, on a kept connection the server then closed
            await upstream.send(up.send(h11.EndOfMessage()))
            sent = 0
        upstream.quickack()
        response = await _within(_next_event(up, upstream), HEAD_TIMEOUT_S * 4)
        while isinstance(response, h11.InformationalResponse):  # 100 Continue and the like
            response = await _next_event(up, upstream)
        if not isinstance(response, h11.Response):
            raise ConnectionError("the server closed without answering")
        return sent, response

    async def _send_response(
        self,
        conn: Any,
        client: _Stream,
        response: Any,
        target: _Target,
        credential: Credential | None,
        *,
        upstream: _Plain,
        up: Any,
    ) -> tuple[int, int]:
        """The answer, checked and scrubbed, to the client: (status, body bytes received)."""
        h11 = _h11()
        _, secrets = self._secrets_for(credential)
        self._check_redirect(response, target)
        out_headers = [
            (k, _scrub_all(v, secrets)) for k, v in response.headers if k.lower() not in HOP_BY_HOP
        ]
        if secrets:  # scrubbing changes the length
            out_headers = [(k, v) for k, v in out_headers if k.lower() != b"content-length"]
        await client.send(conn.send(h11.Response(
            status_code=response.status_code, headers=out_headers, reason=response.reason
        )))  # fmt: skip
        received = await self._relay_body(up, upstream, conn, client, scrub=_Scrubber(secrets))
        return response.status_code, received

    async def _relay_body(
        self, src: Any, src_stream: _Stream, dst: Any, dst_stream: _Stream, *, scrub: _Scrubber | None = None
    ) -> int:
        """Carry one message body from one h11 connection to the other; its size."""
        h11 = _h11()
        size = 0
        while True:
            event = await _next_event(src, src_stream)
            if isinstance(event, h11.Data):
                size += len(event.data)
                self._spend(len(event.data))
                data = bytes(event.data) if scrub is None else scrub.feed(bytes(event.data))
                if data:
                    await dst_stream.send(dst.send(h11.Data(data=data)))
            elif isinstance(event, h11.EndOfMessage):
                rest = scrub.end() if scrub is not None else b""
                if rest:
                    await dst_stream.send(dst.send(h11.Data(data=rest)))
                await dst_stream.send(dst.send(h11.EndOfMessage()))
                return size
            else:
                raise ConnectionError("the connection closed mid-message")

    # -- decisions ---------------------------------------------------------------------------

    def _count_request(self, verdict: Verdict) -> None:
        if not self.requests.add(1):
            raise _Refused(429, Verdict(
                allowed=False, rule="max_requests_per_minute",
                reason=f"more than {self.policy.max_requests_per_minute} requests in a minute",
            ))  # fmt: skip

    def _spend(self, amount: int) -> None:
        if not self.bytes.add(amount):
            raise _Refused(429, Verdict(
                allowed=False, rule="max_bytes_per_minute",
                reason=f"more than {self.policy.max_bytes_per_minute} bytes in a minute",
            ))  # fmt: skip

    async def _address(self, host: str, port: int) -> str:
        """Resolve once, check every answer, and give the address to connect to."""
        found = await self.resolver.resolve(host, port)
        allowed, refusal = self.judge.addresses(host, found)
        if refusal is not None:
            raise _Refused(403, refusal)
        return allowed[0]

    def _check_redirect(self, response: Any, target: _Target) -> None:
        if not 300 <= response.status_code < 400:
            return
        location = _header(response.headers, b"location")
        if location is None:
            return
        base = f"{target.scheme}://{target.authority}{target.path[:MAX_REDIRECT_BASE]}"
        to = urllib.parse.urlsplit(urllib.parse.urljoin(base, location))
        to_host = (to.hostname or "").lower()
        try:
            to_port = to.port or (443 if to.scheme == "https" else 80)
        except ValueError:
            to_port = 0
        if to.scheme not in ("http", "https") or not to_host:
            raise _Refused(403, Verdict(allowed=False, rule="redirect", reason=f"a redirect to {location!r}"))
        verdict = self.judge.request(to_host, to_port, "CONNECT" if to.scheme == "https" else "GET")
        if not verdict.allowed:
            reason = f"a redirect to {to_host}:{to_port}: {verdict.reason}"
            raise _Refused(403, replace(verdict, rule=f"redirect: {verdict.rule}", reason=reason))

    def _upstream_context(self) -> ssl.SSLContext:
        if self._upstream_tls is None:
            ctx = ssl.create_default_context()
            if self.policy.upstream_ca:
                ctx.load_verify_locations(self.policy.upstream_ca)
            ctx.set_alpn_protocols(["http/1.1"])
            self._upstream_tls = ctx
        return self._upstream_tls

    def _emit(self, record: EgressRecord) -> None:
        secrets = [s for s in self._secrets.values() if s]
        if secrets:  # nothing the proxy reports carries a secret, whatever the code asked for
            record = replace(
                record,
                host=_scrub_text(record.host, secrets),
                path=_scrub_text(record.path, secrets),
                sni=_scrub_text(record.sni, secrets),
                reason=_scrub_text(record.reason, secrets),
                rule=_scrub_text(record.rule, secrets),
            )
        if self.observer is None:
            return
        try:
            self.observer(record)
        except Exception:  # an observer's failure must not take the sandbox's network down
            self.observer_failures += 1


# -- helpers --------------------------------------------------------------------------------


async def _within(coro: Coroutine[Any, Any, T], seconds: float) -> T:
    """``coro`` with a deadline, in the current task (``wait_for`` makes a task per call,
    which is most of what a short request costs the proxy)."""
    async with asyncio.timeout(seconds):
        return await coro


async def _next_event(conn: Any, stream: _Stream) -> Any:
    h11 = _h11()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.recv())
            continue
        if event is h11.PAUSED:
            return h11.ConnectionClosed()
        return event


async def _drain_body(conn: Any, client: _Stream) -> None:
    """Read what is left of a refused request's body (bounded), so the reply can be read."""
    h11 = _h11()
    if conn.their_state is not h11.SEND_BODY:
        return
    budget = 1024 * 1024
    while budget > 0:
        event = await _within(_next_event(conn, client), HEAD_TIMEOUT_S)
        if isinstance(event, h11.Data):
            budget -= len(event.data)
        else:
            return


async def _read_hello(client: _Plain, first: bytes) -> bytes:
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


async def _refuse(conn: Any, client: _Stream, refused: _Refused) -> None:
    h11 = _h11()
    verdict = refused.verdict
    text = f"stockade egress: {verdict.reason} (rule: {verdict.rule})"
    body = (text + "\n").encode("utf-8", "replace")
    reason = _phrase(text)
    headers = [
        (b"Content-Type", b"text/plain; charset=utf-8"),
        (b"Content-Length", str(len(body)).encode()),
        (b"X-Stockade-Rule", _phrase(verdict.rule)),
        (b"Connection", b"close"),
    ]
    if conn.our_state is not h11.SEND_RESPONSE:
        return
    with contextlib.suppress(h11.LocalProtocolError):
        await client.send(conn.send(h11.Response(status_code=refused.status, headers=headers, reason=reason)))
        await client.send(conn.send(h11.Data(data=body)))
        await client.send(conn.send(h11.EndOfMessage()))


def _phrase(text: str) -> bytes:
    """A reason phrase: visible ASCII and spaces only, short."""
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in text)[:300].encode("ascii")


def _denied(record: EgressRecord, refused: _Refused, started: float) -> EgressRecord:
    return replace(
        record,
        status=refused.status,
        decision="deny",
        rule=refused.verdict.rule,
        reason=refused.verdict.reason,
        duration_s=time.monotonic() - started,
    )


def _authority(text: str, default_port: int = 0) -> tuple[str, int]:
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


def _header(headers: Any, name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def _forwarded_headers(headers: Any, host: str, port: int, scheme: str) -> list[tuple[bytes, bytes]]:
    default = 443 if scheme == "https" else 80
    authority = (f"[{host}]" if ":" in host else host) + (f":{port}" if port != default else "")
    out = [(b"Host", authority.encode())]
    for key, value in headers:
        lower = key.lower()
        if lower in HOP_BY_HOP or lower in (b"host", b"content-length"):
            continue
        out.append((bytes(key), bytes(value)))
    for key, value in headers:
        if key.lower() == b"content-length":
            out.append((b"Content-Length", bytes(value)))
            break
    else:
        if any(k.lower() == b"transfer-encoding" for k, _ in headers):
            out.append((b"Transfer-Encoding", b"chunked"))  # h11 re-frames the body it forwards
    return out


def _has_body(headers: Any) -> bool:
    """Whether a request comes with a body (h11 has checked its framing headers)."""
    for key, value in headers:
        lower = key.lower()
        if lower == b"transfer-encoding" or (lower == b"content-length" and bytes(value).strip() != b"0"):
            return True
    return False


def _credential_value(credential: Credential, secret: str) -> bytes:
    if credential.style == "basic":
        pair = f"{credential.username}:{secret}".encode()
        return b"Basic " + base64.b64encode(pair)
    if credential.style == "bearer":
        return b"Bearer " + secret.encode()
    return secret.encode()


def _scrub_all(value: bytes, secrets: Sequence[bytes]) -> bytes:
    for secret in secrets:
        value = value.replace(secret, b"[REDACTED]")
    return bytes(value)


def _scrub_text(value: str, secrets: Sequence[str]) -> str:
    for secret in secrets:
        value = value.replace(secret, "[REDACTED]")
    return value


def _short(path: str, limit: int = 2048) -> str:
    return path if len(path) <= limit else path[:limit] + "…"
