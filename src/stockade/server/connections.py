"""The HTTP connections ``stockade serve`` accepts: how many, and how long one may take to say
what it wants.

uvicorn keeps a connection that has sent nothing, or a request's head a line at a time, open
for as long as the client likes: its keep-alive timeout starts only after a response. Bare
idle connections from a client without a token took the server from 41 to 20,000 file
descriptors (its limit), and a tenant's ``POST /v1/sandboxes`` then failed; a server out of
descriptors opens neither sandboxes nor its database. Hence ``guarded_protocol``, uvicorn's
h11 protocol with two additions:

* a **head timeout**: a connection must deliver a request's whole head (its line and
  headers, at most h11's 16 KiB) within ``head_timeout_s`` of opening, or of its previous
  response; else it is closed. uvicorn 0.55 has no such timeout (``timeout_keep_alive`` is
  disarmed by the first byte of the next request), so it is added here, where the protocol
  sees the head complete; the body's own deadline is ``server/guard.py``'s.
* a **connection cap**: past ``max_connections`` open at once, a new connection is answered
  503 and closed at once. Not uvicorn's ``limit_concurrency``: that answers 503 only once a
  request's head has come, and keeps an idle connection open meanwhile, which is the attack.
* a **bound on what is read ahead**: h11 keeps whatever the socket gives it and bounds only an
  event not yet whole (a head, 16 KiB), not whole requests pipelined behind the one being
  answered; uvicorn reads from the socket again each time a request asks for its body or is
  answered. One connection pipelining ``GET /v1/workspaces`` without reading the answers took
  855 MiB of the server's memory in 15 s (RSS 784 -> 1651 MB) for ~100 bytes of it used per
  answer. The socket is now read only while h11 holds at most ``READ_AHEAD_BYTES``: past it the
  client waits in its own socket's buffers until the requests before are answered.

What remains is a flood from many clients: each under the cap's share, together they hold the
cap, and a tenant's new connection is refused until they time out. Spreading a cap per
client address, and TLS, are a reverse proxy's job in front of ``stockade serve``.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

from stockade import exceptions as exc

__all__ = ["READ_AHEAD_BYTES", "ConnectionLimits", "GuardedH11Protocol", "guarded_protocol"]

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
# What h11 may hold of a connection's requests not yet answered before its socket is no longer
# read; a read takes up to 256 KiB more, so a connection holds ~320 KiB at most
READ_AHEAD_BYTES = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class ConnectionLimits:
    """``stockade serve``'s figures for its HTTP connections (``--head-timeout``,
    ``--keep-alive-timeout``, ``--max-connections``)."""

    head_timeout_s: float = 10.0
    keep_alive_s: int = 5
    max_connections: int = 1000

    def __post_init__(self) -> None:
        if not (self.head_timeout_s > 0 and self.keep_alive_s > 0 and self.max_connections > 0):
            raise exc.ConfigurationError(
                "the head timeout, the keep-alive timeout and max_connections must be positive"
            )

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
        return ConnectionLimits(
            head_timeout_s=self.head_timeout_s, keep_alive_s=self.keep_alive_s, max_connections=max(1, room)
        )


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


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head timeout, a connection cap (``limits``) and a bound on
    what it reads ahead of the request being answered."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    _warned: ClassVar[list[float]] = [0.0]  # when the cap was last logged, a warning per 10 s
    _head_timer: asyncio.TimerHandle | None = None
    _waiting: object = None  # the request cycle the head timer waits to see replaced

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _BoundedFlow(transport, self._buffered)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(transport)
            return
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
        finished = self.cycle
        super().on_response_complete()
        # the next request's head is timed too, unless one was already pipelined behind
        if not self.transport.is_closing() and self.cycle is finished:
            self._time_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _buffered(self) -> int:
        """The bytes h11 holds and has not yet turned into events (whole requests pipelined
        behind the one being answered, the start of the next one). Read from h11's own buffer:
        its public ``trailing_data`` copies it."""
        return len(self.conn._receive_buffer)

    def _refuse(self, transport: asyncio.Transport) -> None:
        now = time.monotonic()
        if now - self._warned[0] > _WARN_EVERY_S:
            self._warned[0] = now
            log.warning("%d connections open: new ones are refused", self.limits.max_connections)
        transport.write(_REFUSED)
        transport.close()

    def _time_head(self) -> None:
        self._stop_timer()
        self._waiting = self.cycle
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)

    def _stop_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """``GuardedH11Protocol`` with ``limits`` (give it as uvicorn's ``http``)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
