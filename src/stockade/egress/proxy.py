"""The egress proxy of one sandbox: HTTP and HTTPS (CONNECT) to the hosts its policy allows.

It listens where only its sandbox can reach it (a Unix socket in the sandbox's run folder,
see ``docs/architecture.md``) and decides each request with ``Judge``:

* **Names, then addresses.** The host must match a rule (name, port, method). The proxy then
  resolves the name itself, once, refuses it if any answer is not a public address (unless
  allowed), and connects to an address it checked: a name that rebinds between the check
  and the connection has nothing to rebind. The sandbox has no DNS of its own.
* **Tunnels carry TLS to the name asked for.** After ``200`` to a CONNECT, the first bytes
  must be a TLS ClientHello whose SNI is the CONNECT host, the server's first answer a
  TLS ServerHello or alert (until then nothing more goes to it), and the rest of the
  client's bytes TLS records; anything else closes the tunnel. Plain HTTP goes to any
  port a rule allows, without credentials: they are added over TLS only.
* **Opened TLS** (``intercept``): for a host with a credential or with method rules, the
  proxy answers the TLS itself with a certificate from the sandbox's own CA, checks each
  request (method, ``Host``), adds the credential and makes its own verified TLS
  connection to the server. The credential's value is scrubbed from what comes back.
* **Redirects** are checked like requests: a ``3xx`` whose ``Location`` the policy would
  refuse becomes a ``403`` (the client never sees where it led).
* **Limits**: requests and bytes per minute, connections at once, and connections accepted
  per second (``Accepts``), per sandbox.

A refusal is ``403`` (``429`` for a limit, ``400`` or ``431`` for a request that cannot
be read or a name that is no DNS name, ``502`` for one not resolved in time) with a
one-line reason and the rule, in the status line, the ``X-Stockade-Rule`` header and the
body; every request, allowed or not, is an ``EgressRecord`` for the observer (the audit
trail), and a proxy left open is closed at the interpreter's exit so that none is lost then.

Hand-written on ``h11`` (HTTP/1.1 parsing, from the python-hyper project) and ``ssl``:
the decisions above sit between parsing and connecting (resolve once, connect to what
was checked; SNI before any byte goes out; scrubbing), which the proxy libraries on PyPI
(mitmproxy, proxy.py) do not expose without replacing their connection handling, and
they bring their own event loop and dozens of dependencies into the SDK's process.

Where each part lives: this module is the server (the socket, its connections, ``close``);
``_http`` one HTTP request and its answer, with ``_request`` (what a request says,
checked), ``_feed`` (the bytes given to h11 in bounded pieces), ``_scrub`` (a credential
host's answer scrubbed) and ``_records`` (each request's record, and the proxy's refusals);
``_tunnel`` CONNECT, the TLS checks and the opened TLS; ``_gate`` the decisions, limits and
records; ``_streams`` the byte streams; ``_resolve`` the resolver; ``_upstream`` the
connections kept to servers.
"""

from __future__ import annotations

import asyncio
import math
import socket
import ssl
import time
from collections.abc import Mapping
from typing import Any

from stockade import _exit
from stockade.egress._feed import load_h11
from stockade.egress._gate import EgressObserver, Gate, Window
from stockade.egress._http import Exchange
from stockade.egress._resolve import Resolver, SystemResolver
from stockade.egress._sources import SECRETS_TIMEOUT_S, secrets_in_time
from stockade.egress._streams import BUFFERED_LIMIT, Plain, wrap
from stockade.egress._tls import SandboxCA
from stockade.egress._tunnel import Tunnels
from stockade.types import EgressRecord, NetworkPolicy

__all__ = ["EgressObserver", "EgressProxy", "EgressRecord", "Resolver", "SystemResolver"]

MAX_CONNECTIONS = 128  # at once, per sandbox
# Connections accepted, per sandbox: a burst at once, then so many a second (``Accepts``).
ACCEPT_BURST = 64
ACCEPTS_PER_S = 256
ACCEPTS_PER_TURN = 8  # accepted at most per wake-up of the loop, before the other sandboxes run


class Accepts:
    """A sandbox's budget of connections accepted (a token bucket): ``burst`` at once, then
    ``per_s`` a second. Every sandbox's proxy shares one loop thread and an accepted
    connection costs it a task before it sends a byte (the per-minute limits count
    requests): a sandbox that opened and closed connections to its socket at full speed
    (7.7k a second) made every other sandbox's requests 20-40 times slower. Past the budget
    its listener is not read for a while: its connections wait in its own socket's backlog.
    A package manager's 30-50 connections at once fit the burst, and a policy that allows
    more requests than ``per_s`` a second gets as many connections."""

    def __init__(self, burst: int, per_s: float) -> None:
        self.burst = burst
        self.per_s = per_s
        self.tokens = float(burst)
        self.at = time.monotonic()

    def _fill(self) -> None:
        now = time.monotonic()
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.per_s)
        self.at = now

    def ready(self) -> bool:
        """Whether one more connection may be accepted now."""
        self._fill()
        return self.tokens >= 1.0

    def spend(self) -> None:
        self.tokens -= 1.0

    def wait_s(self, count: int) -> float:
        """How long until ``count`` connections may be accepted (at most the burst)."""
        self._fill()
        return max(0.0, min(count, self.burst) - self.tokens) / self.per_s


class EgressProxy:
    """One sandbox's proxy over its ``NetworkPolicy``. ``start`` it on a Unix socket (or
    ``start_tcp``, for tests and benchmarks) in the loop of ``stockade.egress._loop``;
    ``close`` cuts every connection at once and drops the credentials. At most
    ``max_connections`` at once (past them, the listener is not read until one ends: the
    sandbox's next connects wait in its socket's backlog), holding at most ``max_buffered``
    bytes between them (received and not yet passed on: past it, the sandbox's connections
    stop reading), and at most ``accept_burst`` accepted at once, then ``ACCEPTS_PER_S`` a
    second (or the policy's requests per second if more: ``Accepts``).
    The credentials' values are read from their sources here (``read_secrets``; it may
    block) unless the caller read them (``secrets``: ``attach`` does, within a deadline);
    ``renew`` reads them again within ``secrets_timeout_s``."""

    def __init__(
        self,
        policy: NetworkPolicy,
        *,
        observer: EgressObserver | None = None,
        resolver: Resolver | None = None,
        max_connections: int = MAX_CONNECTIONS,
        max_buffered: int = BUFFERED_LIMIT,
        accept_burst: int = ACCEPT_BURST,
        secrets: Mapping[str, str] | None = None,
        secrets_timeout_s: float = SECRETS_TIMEOUT_S,
    ) -> None:
        self.policy = policy
        resolver = resolver or SystemResolver(policy.resolve)
        self.gate = Gate(policy, observer=observer, resolver=resolver, secrets=secrets)
        self.judge = self.gate.judge
        self.max_connections = max_connections
        self.accepts = Accepts(
            accept_burst, max(ACCEPTS_PER_S, math.ceil(policy.max_requests_per_minute / 60))
        )
        self.secrets_timeout_s = secrets_timeout_s  # the sources' reads at ``renew``
        self.gate.buffers.limit = max_buffered
        intercepted = tuple(
            dict.fromkeys(
                [h for c in policy.credentials for h in c.hosts]
                + [r.host for r in self.judge.rules if r.methods]
            )
        )
        self.exchange = Exchange(self.gate)
        self.tunnels = Tunnels(self.gate, self.exchange, SandboxCA(intercepted) if intercepted else None)
        self._listener: socket.socket | None = None
        self._connections: set[asyncio.Task[None]] = set()  # every accepted connection's task
        self._resting = False  # past the accept budget: the listener waits for its timer
        self._full = False  # ``max_connections`` accepted: the listener waits for one to end
        self._tasks: set[asyncio.Task[None]] = set()  # those being served (``close`` cuts them)
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the one it listens on
        self._generation = 0  # one per user of the sandbox (``renew``): older connections are cut
        self._cut: set[asyncio.Task[None]] = set()  # cancelled by ``renew``: ended, not failed

    # -- what callers may read (the package's own parts go to ``gate`` and ``exchange``) ------

    @property
    def ca(self) -> SandboxCA | None:
        """The sandbox's CA, when some host's TLS is opened (``None`` once closed)."""
        return self.tunnels.ca

    @property
    def ca_pem(self) -> bytes | None:
        """The sandbox CA's certificate (what the sandbox must trust), if TLS is ever opened."""
        return self.ca.pem if self.ca is not None else None

    @property
    def observer(self) -> EgressObserver | None:
        return self.gate.observer

    @property
    def resolver(self) -> Resolver:
        return self.gate.resolver

    @property
    def requests(self) -> Window:
        """This sandbox's requests in the last minute."""
        return self.gate.requests

    @property
    def bytes(self) -> Window:
        """This sandbox's bytes (both ways) in the last minute."""
        return self.gate.bytes

    @property
    def observer_failures(self) -> int:
        """How many records the observer failed to take (the proxy went on)."""
        return self.gate.observer_failures

    # -- lifecycle ------------------------------------------------------------------------

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
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._accept_ready, sock)
        _exit.keep(self, _exit.PROXIES)

    def finish_at_exit(self) -> None:
        """At the interpreter's exit, a proxy its host left open (a program that ends without
        closing its sandboxes, or one that crashed) is closed (``stockade._exit``, before any
        audit log's flush). A record is told to the observer on the loop's next turn, and the
        loop's thread is a daemon, frozen once the interpreter finalizes: without this, the
        last requests' records were lost in most such exits (16 of 20 runs, measured).
        ``close`` on the proxy's loop if it still runs (its own thread: ``stockade.egress.
        _loop``; it also records what is in flight, cut, status 0), else tell the observer
        what is held."""
        if self._closed:
            return
        loop = self._loop
        if loop is not None and loop.is_running() and not loop.is_closed():
            asyncio.run_coroutine_threadsafe(self.close(), loop).result(10)
        else:
            self.gate.flush()

    def _accept_ready(self, sock: socket.socket) -> None:
        """Accept what waits, each connection into a task of its own that closes it.

        Not asyncio's ``Server`` (nor ``sock_accept``): a connection accepted but not yet set
        up when they are closed is dropped half-made, its socket closed only by the garbage
        collector, with a ``ResourceWarning`` (Python 3.11: ``Server._attach`` asserts and the
        error is swallowed; a cancelled ``sock_accept`` loses the socket it had accepted). The
        relay's warm connections arrive at a sandbox's start, so a sandbox closed right after
        it started met that. Here an accepted socket belongs to its task at once.

        A few at a time (``ACCEPTS_PER_TURN``: the listener is level-triggered, what is left
        wakes the loop again after the other sandboxes' work), within the sandbox's budget
        (``Accepts``): once it is spent the listener rests until a few are allowed again.
        With ``max_connections`` accepted it is not read until one of them ends: the next
        connects wait in the backlog, as at the relay inside, and the sandbox holds at most
        that many of the host's descriptors. (Before, each was accepted and answered 503:
        of 200 connections at once, 69 failed.)"""
        loop = asyncio.get_running_loop()
        for _ in range(ACCEPTS_PER_TURN):
            if len(self._connections) >= self.max_connections:
                self._full = True
                loop.remove_reader(sock.fileno())
                return
            if not self.accepts.ready():
                self._rest(sock, self.accepts.wait_s(ACCEPTS_PER_TURN))
                return
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors: the connection waits in the backlog a while
                self._rest(sock, 0.1)
                return
            self.accepts.spend()
            task = loop.create_task(self._connection(conn, self._generation))
            self._connections.add(task)
            task.add_done_callback(self._ended)

    def _rest(self, sock: socket.socket, delay_s: float) -> None:
        """Leave what waits in the backlog for ``delay_s``: only this sandbox's connects wait."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(sock.fileno())
        self._resting = True
        loop.call_later(delay_s, self._rested, sock)

    def _rested(self, sock: socket.socket) -> None:
        self._resting = False
        self._listen_again(sock)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._connections.discard(task)
        if self._full and len(self._connections) < self.max_connections:
            self._full = False
            if self._listener is not None:
                self._listen_again(self._listener)

    def _listen_again(self, sock: socket.socket) -> None:
        """Read the listener again, unless the budget's timer or a full proxy still holds it."""
        if not (self._closed or self._resting or self._full) and sock.fileno() >= 0:
            asyncio.get_running_loop().add_reader(sock.fileno(), self._accept_ready, sock)

    async def _connection(self, conn: socket.socket, generation: int) -> None:
        if self._closed or generation != self._generation:
            conn.close()
            return
        await self._accept(await wrap(conn, self.gate.buffers), generation)

    async def close(self) -> None:
        self._closed = True
        _exit.forget(self, _exit.PROXIES)
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
        self.exchange.upstreams.close()
        self.gate.close()  # the records still held go to the observer, then the secrets
        self.tunnels.ca = None

    async def renew(self) -> None:
        """For the sandbox's next user (a reset in place): every connection of the last user's
        cut, its requests in flight too (recorded, status 0) and those waiting in the socket's
        backlog; the connections kept to servers closed; the budgets per minute and of
        accepts afresh (one user who spent them leaves the next none of its slowness); the
        TLS contexts of the hosts it named dropped; the resolver's answers and lookups
        forgotten; the credentials' values read again from their sources (on a thread, not
        this loop: a vault may be slow; within ``secrets_timeout_s``, at most one read of a
        source in flight: ``_sources``), so a secret rotated since the sandbox started is not
        sent for its next user. A read that fails or does not end in time leaves the proxy
        holding no value and raises (``SandboxStartError``): the sandbox is not handed on.
        The policy and the CA stay: they are the sandbox's, not the user's."""
        if self._closed:
            return
        self._generation += 1  # accepted and not yet served: closed when their task runs
        self._refuse_backlog()
        tasks = list(self._tasks)
        self._cut.update(tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._cut.difference_update(tasks)
        self.exchange.upstreams.drop()
        if self.tunnels.ca is not None:
            self.tunnels.ca.forget()
        self.gate.renew()  # the last values dropped first: a failed read leaves none
        self.accepts = Accepts(self.accepts.burst, self.accepts.per_s)
        if self.policy.credentials:
            secrets = await secrets_in_time(self.policy, self.secrets_timeout_s)
            if not self._closed:  # closed meanwhile (the reset gave up): nothing to hold them for
                self.gate.use_secrets(secrets)

    def _refuse_backlog(self) -> None:
        """Close what the last user's code connected and the proxy had not accepted yet."""
        sock = self._listener
        if sock is None or sock.fileno() < 0:
            return
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:  # nothing more waiting (or out of descriptors: cut when accepted)
                return
            conn.close()

    # -- one client connection -------------------------------------------------------------

    async def _accept(self, client: Plain, generation: int) -> None:
        task = asyncio.current_task()
        assert task is not None
        if generation != self._generation:  # the last user's, accepted before ``renew``
            client.close()
            return
        if self._closed:
            client.close()
            return
        self._tasks.add(task)
        try:
            await self._serve(client)
        except (TimeoutError, OSError, EOFError, ssl.SSLError, asyncio.IncompleteReadError):
            pass  # the client or the server went away: the record says what was done
        except asyncio.CancelledError:
            # ``close`` (the sandbox killed) cut this connection: that is the end of it, not a
            # failure to report (a cancellation from elsewhere still cancels the task); so is
            # ``renew`` (the sandbox reset for its next user).
            if not self._closed and task not in self._cut:
                raise
        except Exception as err:
            if not isinstance(err, load_h11().ProtocolError):  # a client speaking nonsense: closed
                raise
        finally:
            self._tasks.discard(task)
            client.close()

    async def _serve(self, client: Plain) -> None:
        async def tunnel(conn: Any, request: Any) -> None:
            await self.tunnels.serve(conn, client, request)

        await self.exchange.serve(client, tunnel=None, on_connect=tunnel)
