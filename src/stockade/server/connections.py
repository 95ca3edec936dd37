"""The HTTP connections ``stockade serve`` accepts: how many, and how long one may take to say
what it wants.

uvicorn keeps a connection that has sent nothing, or a request's head a line at a time, open
for as long as the client likes: its keep-alive timeout starts only after a response. Bare
idle connections from a client without a token took the server from 41 to 20,000 file
descriptors (its limit), and a tenant's ``POST /v1/sandboxes`` then failed; a server out of
descriptors opens neither sandboxes nor its database. Hence ``guarded_protocol``, uvicorn's
h11 protocol with these additions:

* a **head timeout**: a connection must deliver a request's whole head (its line and
  headers, at most h11's 16 KiB) within ``head_timeout_s`` of opening, or of its previous
  response; else it is closed. uvicorn 0.55 has no such timeout (``timeout_keep_alive`` is
  disarmed by the first byte of the next request), so it is added here, where the protocol
  sees the head complete; the body's own deadline is ``server/guard.py``'s.
* a **connection cap**: past ``max_connections`` open at once, a new connection is answered
  503 and closed at once. Not uvicorn's ``limit_concurrency``: that answers 503 only once a
  request's head has come, and keeps an idle connection open meanwhile, which is the attack.
* a **share per address**: one client address (an IPv6 one by its /64, the block a host is
  given) holds at most ``per_address`` of them (an eighth of the cap unless told), loopback as
  any other; one more from it is answered 503 and closed. 1,100 connections from one address
  that each sent a head a line a second, re-opened as they were closed, held the cap of 1,000,
  and a client with a valid token was answered 503 for as long as they lasted.
* **room made from heads that keep the cap waiting**: at the cap, a new connection closes the
  one that has waited longest for its request's head (opened, or idle since its last answer)
  rather than being refused: a head sent whole comes in a round trip, so slow heads from any
  number of addresses give way to the clients that say what they want, as nginx closes its
  idle keep-alive connections when it runs out of them. With none waiting, the one stalled
  longest on a client that does not read its answer (below) is reset instead. A connection
  whose head has come and that is not stalled (a body being read, an answer or an event
  stream being sent as fast as its client reads) is never closed for room; with only those
  open, a new one is refused.
* a **send timeout**: a connection whose answer the client does not read is cut. One that
  pipelined ``GET /openapi.json`` (46 KB, no token needed) and never read held its slot for
  ever: the next request's answer waited in uvicorn's ``drain()``, which has no deadline, its
  head had come so it was never closed for room, and the kernel queued ~3.8 MiB for it (its
  send buffer grows to ``tcp_wmem``'s 4 MiB); 90 of them from nine addresses held a cap of 80
  and an honest client was 503 at every probe for 40 s. Now, while uvicorn's write buffer is
  over its high mark (64 KiB) the connection is *stalled*: if its client reads none of it for
  ``send_timeout_s`` it is reset (an RST: the unsent bytes are dropped, where ``abort()`` alone
  leaves them queued behind a FIN), counted from its last read as nginx's ``send_timeout`` is,
  so a slow reader of a large answer is not cut. A request pipelined behind an answer the
  client has not read starts only once it has (nor do the head and keep-alive timers: the
  client is still reading). The kernel itself drops a connection whose sent bytes stay
  unacknowledged (a zero window too) for twice ``send_timeout_s`` (``TCP_USER_TIMEOUT``): an
  answer left in a closed socket sat in FIN-WAIT-1 with ~0.9 MiB unsent. The send buffer is
  ``SEND_BUFFER_BYTES`` (the kernel doubles it), so a stalled connection holds ~0.5 MiB of
  kernel memory rather than ~3.8 MiB.
* a **bound on what is read ahead**: h11 keeps whatever the socket gives it and bounds only an
  event not yet whole (a head, 16 KiB), not whole requests pipelined behind the one being
  answered; uvicorn reads from the socket again each time a request asks for its body or is
  answered. One connection pipelining ``GET /v1/workspaces`` without reading the answers took
  855 MiB of the server's memory in 15 s (RSS 784 -> 1651 MB) for ~100 bytes of it used per
  answer. The socket is now read only while h11 holds at most ``READ_AHEAD_BYTES``: past it the
  client waits in its own socket's buffers until the requests before are answered.

What remains is a flood from many addresses of requests whose heads come whole and whose
bodies trickle at the minimum rate (``server/guard.py``): those are not closed for room. A
connection rate per address, and TLS, are a reverse proxy's job; behind one, every connection
comes from its address, so ``per_address`` must be raised to the cap (``stockade serve
--max-connections-per-address``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import resource
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

from stockade import exceptions as exc

__all__ = [
    "PER_ADDRESS_SHARE", "READ_AHEAD_BYTES", "SEND_BUFFER_BYTES", "ConnectionLimits", "GuardedH11Protocol",
    "address_of", "guarded_protocol",
]  # fmt: skip

log = logging.getLogger("stockade.server")

# fds that stay free for sandboxes, the database, the snapshot store: half the process's limit
# at least, whatever ``max_connections`` asks for
_FDS_KEPT = 0.5
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: 35\r\n\r\n"
    b"too many connections: retry shortly"
)
_WARN_EVERY_S = 10.0
# one address's share of the cap unless told: a few busy clients behind one NAT fit in it, and
# eight addresses are needed to hold the cap with connections that are not closed for room
PER_ADDRESS_SHARE = 8
# What h11 may hold of a connection's requests not yet answered before its socket is no longer
# read; a read takes up to 256 KiB more, so a connection holds ~320 KiB at most
READ_AHEAD_BYTES = 64 * 1024
# A connection's kernel send buffer (SO_SNDBUF; the kernel doubles it and stops growing it).
# Grown as Linux does, to tcp_wmem's 4 MiB, one client that does not read holds ~3.8 MiB of
# the host's TCP memory, and 1,000 of them more than its tcp_mem allows all its sockets. 512 KiB
# in flight still carry ~40 Mbit/s at 100 ms round trip, ~400 at 10 ms.
SEND_BUFFER_BYTES = 256 * 1024


@dataclass(frozen=True, kw_only=True)
class ConnectionLimits:
    """The figures for the HTTP connections of ``stockade serve`` and ``stockade mcp``
    (``--head-timeout``, ``--keep-alive-timeout``, ``--send-timeout``, ``--max-connections``,
    ``--max-connections-per-address``). ``max_per_address`` None: an eighth of the cap.

    ``send_timeout_s``: how long a client may read none of an answer that waits for it
    (uvicorn's buffer over its high mark and not shrinking, or the kernel's bytes not
    acknowledged) before its connection is reset; an event stream's as any. Counted from the
    last read, as nginx's ``send_timeout`` (60 s) is between two writes: a slow client of a
    large answer is not cut. 30 s: this API's clients read as they receive, and one that stops
    holds ~0.5 MiB of kernel memory meanwhile (at the cap, it is closed for room)."""

    head_timeout_s: float = 10.0
    keep_alive_s: int = 5
    send_timeout_s: float = 30.0
    max_connections: int = 1000
    max_per_address: int | None = None

    def __post_init__(self) -> None:
        figures = (
            self.head_timeout_s, self.keep_alive_s, self.send_timeout_s, self.max_connections,
            self.per_address,
        )  # fmt: skip
        if not all(figure > 0 for figure in figures):
            raise exc.ConfigurationError(
                "the head, keep-alive and send timeouts, max_connections and max_per_address must be positive"
            )

    @property
    def per_address(self) -> int:
        """The connections one address may hold at once (at most the cap)."""
        if self.max_per_address is None:
            return max(1, self.max_connections // PER_ADDRESS_SHARE)
        return min(self.max_per_address, self.max_connections)

    def fitted(self) -> ConnectionLimits:
        """These limits with ``max_connections`` at most half the process's file descriptors
        (``RLIMIT_NOFILE``), so that the rest stay for sandboxes and the database."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        room = int(soft * _FDS_KEPT) if soft != resource.RLIM_INFINITY else self.max_connections
        if self.max_connections <= room:
            return self
        log.warning(
            "--max-connections %d lowered to %d: half of this process's %d file descriptors "
            "(ulimit -n) stay for sandboxes and the database",
            self.max_connections, room, soft,
        )  # fmt: skip
        return dataclasses.replace(self, max_connections=max(1, room))


class _BoundedFlow(FlowControl):
    """uvicorn's flow control, that resumes reading only while ``buffered()`` is at most
    ``READ_AHEAD_BYTES``: a request that asks for its body, or one answered, no longer lets one
    more read in whatever h11 already holds."""

    def __init__(self, transport: asyncio.Transport, buffered: Callable[[], int]) -> None:
        super().__init__(transport)
        self._buffered = buffered

    def resume_reading(self) -> None:
        if self._buffered() <= READ_AHEAD_BYTES:
            super().resume_reading()


def address_of(client: tuple[str, int] | None) -> str | None:
    """The address whose share a connection from ``client`` counts in: its IP, an IPv6 one by
    its /64 (a host is given a whole one; an IPv4 one mapped into IPv6 as itself). None: no
    address (a Unix socket's peer)."""
    if client is None:
        return None
    try:
        ip = ipaddress.ip_address(client[0])
    except ValueError:
        return client[0]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class _Held:
    """The connections one server holds: how many from each address, those waiting for a
    request's head and those stalled on a client that does not read, longest first."""

    def __init__(self) -> None:
        self.open: set[GuardedH11Protocol] = set()
        self.by_address: Counter[str] = Counter()
        self.waiting: dict[GuardedH11Protocol, None] = {}  # ordered: oldest first
        self.stalled: dict[GuardedH11Protocol, None] = {}  # ordered: oldest first
        self.warned: dict[str, float] = {}  # when each kind of warning was last logged

    def admit(self, connection: GuardedH11Protocol) -> None:
        self.open.add(connection)
        if connection.address is not None:
            self.by_address[connection.address] += 1

    def release(self, connection: GuardedH11Protocol) -> None:
        self.waiting.pop(connection, None)
        self.stalled.pop(connection, None)
        if connection not in self.open:
            return
        self.open.discard(connection)
        if connection.address is not None:
            self.by_address[connection.address] -= 1
            if not self.by_address[connection.address]:
                del self.by_address[connection.address]

    def make_room(self) -> bool:
        """Close the connection that has waited longest for a request's head, else reset the one
        stalled longest on a client that does not read: False if there is neither (every one
        open is reading a body or sending an answer its client reads)."""
        if self.waiting:
            oldest = next(iter(self.waiting))
            self.release(oldest)
            oldest.close_for_room()
            return True
        if self.stalled:
            oldest = next(iter(self.stalled))
            self.release(oldest)
            _reset(oldest.transport)
            return True
        return False

    def warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self.warned.get(kind, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self.warned[kind] = now
            log.warning(message, *args)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head timeout, a send timeout, a connection cap and a share
    of it per address (``limits``), and a bound on what it reads ahead of the request being
    answered."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    held: ClassVar[_Held] = _Held()  # the server's: ``guarded_protocol`` gives each its own
    address: str | None = None
    _head_timer: asyncio.TimerHandle | None = None
    _waiting: object = None  # the request cycle the head timer waits to see replaced
    _send_timer: asyncio.TimerHandle | None = None
    _unsent = 0  # uvicorn's write buffer when the send timer was last armed
    _unread: bool = False  # an answer completed while stalled: what follows waits for it to be read

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _BoundedFlow(transport, self._buffered)
        held, limits = self.held, self.limits
        _bound_sending(transport, limits.send_timeout_s)
        address = address_of(self.client)
        if address is not None and held.by_address[address] >= limits.per_address:
            held.warn(
                "address", "%s holds %d connections (--max-connections-per-address): new ones from "
                "it are refused", address, limits.per_address,
            )  # fmt: skip
            self._refuse(transport)
            return
        if len(held.open) >= limits.max_connections:
            if not held.make_room():
                held.warn("cap", "%d connections open: new ones are refused", limits.max_connections)
                self._refuse(transport)
                return
            held.warn(
                "room", "%d connections open: the one waiting longest for a request's head, or stalled "
                "longest on a client that does not read, is closed for each new one", limits.max_connections,
            )  # fmt: skip
        self.address = address
        held.admit(self)
        self._time_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._buffered() > READ_AHEAD_BYTES:
            # uvicorn may have resumed the transport itself, its flow still marked paused
            self.flow.read_paused = True
            self.transport.pause_reading()
        if self._head_timer is not None and self.cycle is not self._waiting:
            self._stop_timer()  # a new request's head came whole

    def on_response_complete(self) -> None:
        if self.flow.write_paused and not self.transport.is_closing():
            # the client has not read this answer: a request it pipelined behind waits, and so
            # do the head and keep-alive timers (a slow reader is still reading); the send
            # timeout runs meanwhile
            self._unread = True
            return
        finished = self.cycle
        super().on_response_complete()
        # the next request's head is timed too, unless one was already pipelined behind
        if not self.transport.is_closing() and self.cycle is finished:
            self._time_head()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._stop_send_timer()
        self._time_sending()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_send_timer()
        if self._unread:
            self._unread = False
            self.on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        self._stop_send_timer()
        self.held.release(self)
        super().connection_lost(exc)

    def close_for_room(self) -> None:
        """Closed, its head not come, for a new connection past the cap."""
        self._stop_timer()
        if not self.transport.is_closing():
            self.transport.close()

    def _buffered(self) -> int:
        """The bytes h11 holds and has not yet turned into events (whole requests pipelined
        behind the one being answered, the start of the next one). Read from h11's own buffer:
        its public ``trailing_data`` copies it."""
        return len(self.conn._receive_buffer)

    def _refuse(self, transport: asyncio.Transport) -> None:
        transport.write(_REFUSED)
        transport.close()

    def _time_head(self) -> None:
        self._stop_timer()
        self._waiting = self.cycle
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)
        if self in self.held.open:  # last of those waiting
            self.held.waiting[self] = None

    def _stop_timer(self) -> None:
        self.held.waiting.pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _stop_send_timer(self) -> None:
        self.held.stalled.pop(self, None)
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _time_sending(self) -> None:
        """Give the client ``send_timeout_s`` to read some of what waits for it (the last of
        those stalled for room, since it read)."""
        self._unsent = self.transport.get_write_buffer_size()
        self._send_timer = self.loop.call_later(self.limits.send_timeout_s, self._send_timed_out)
        if self in self.held.open:
            self.held.stalled.pop(self, None)
            self.held.stalled[self] = None

    def _send_timed_out(self) -> None:
        self._send_timer = None
        if self.transport.get_write_buffer_size() < self._unsent:
            self._time_sending()  # it reads, however slowly: a whole answer may take longer
            return
        self.held.stalled.pop(self, None)
        self.held.warn(
            "send", "a client read none of its answer for %s s (--send-timeout): its connection is reset",
            self.limits.send_timeout_s,
        )  # fmt: skip
        _reset(self.transport)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self.held.waiting.pop(self, None)
        if not self.transport.is_closing():
            self.transport.close()


def _bound_sending(transport: asyncio.Transport, send_timeout_s: float) -> None:
    """Cap a TCP connection's kernel send buffer, and have the kernel drop it when what was sent
    stays unacknowledged (a zero window too) for twice ``send_timeout_s`` (Linux's
    ``TCP_USER_TIMEOUT``): after the protocol's own timer, which resets it so that its client
    knows, and where the protocol no longer sees it (a connection closed, its answer unread)."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)  # Linux only
        if user_timeout is not None:
            sock.setsockopt(socket.IPPROTO_TCP, user_timeout, max(1, int(2 * send_timeout_s * 1000)))


def _reset(transport: asyncio.Transport) -> None:
    """Close with an RST (``abort()`` alone sends a FIN behind what is unsent): what the client
    did not read is dropped at once, and it knows."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """``GuardedH11Protocol`` with ``limits`` (give it as uvicorn's ``http``)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "held": _Held()})
