"""Before a request's body: its token, and the time its body may take.

Every ``/v1`` route needs a token, and FastAPI checks it (``deps.authenticate``) only once it
has read and parsed the body: a client without one held ~15 MiB of the server's memory per
connection for as long as it liked (20 connections sending a 15 MiB body but its last byte:
142 -> 422 MB, until they closed; the last byte then got its 401). ``RequestGuard``, in
front of everything, answers a ``/v1`` request whose ``Authorization`` names no token the
service knows with its 401 from the headers alone, never reading a byte of its body, and
closes the connection. The rate limit and the role's checks stay with the routes.

A body then has a deadline, for tenants too: it must have come whole within ``grace_s``
plus its size at ``min_rate`` bytes a second (a body that stalls, or trickles, is answered
408 ``RequestTimeout`` and its connection closed). Once the body is whole, nothing is timed:
a command's output streams as long as it runs.

``BodyDeadline`` is that deadline alone, for an app that has no tenants (``stockade mcp``
over HTTP, whose stalled bodies held its every client off).

The request's head (its line and headers) is timed by the connection itself
(``server/connections.py``): this ASGI layer sees a request only once its head came.

A tenant's bodies are held in memory from their first byte to the end of their request, and
the deadline above lets a body of 64 MiB take 17 minutes: each is counted against its
tenant's ``bodies_mb`` (``server/held.py``), the ``Content-Length`` it declares from the
start, what comes past that as it comes; the request that would pass it is refused with a
429 (``QuotaExceeded``, ``quota = "bodies_mb"``): from its headers when it declares too much,
else as soon as its bytes pass, never reading the rest.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stockade import exceptions as exc
from stockade.server import problems
from stockade.server.held import CHUNK, HeldBytes

if TYPE_CHECKING:
    from stockade.server.service import Service
    from stockade.server.tenants import Tenant

__all__ = ["BodyDeadline", "RequestGuard", "needs_token"]


def needs_token(path: str) -> bool:
    """Whether every route at ``path`` needs an API token (all of ``/v1``)."""
    return path == "/v1" or path.startswith("/v1/")


class RequestGuard:
    """ASGI middleware: a ``/v1`` request without a known token is 401 before its body is read;
    every request's body is timed (408 past its deadline), and counted against its tenant's
    ``bodies_mb`` (429 past it)."""

    def __init__(
        self, app: ASGIApp, *, service: Service, grace_s: float, min_rate: float, held: HeldBytes
    ) -> None:
        self.app = app
        self.service = service
        self.grace_s = grace_s
        self.min_rate = min_rate
        self.held = held

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from stockade.server.deps import principal_of  # FastAPI's: not loaded by BodyDeadline's users

        tenant: Tenant | None = None
        if needs_token(scope.get("path", "")):
            authorization = _header(scope, b"authorization")
            try:
                tenant = principal_of(self.service.tenants, authorization).tenant
            except exc.AuthenticationError as error:
                await _answer(send, error, scope)
                return
        body = _TimedBody(receive, send, scope, self.grace_s, self.min_rate)
        if tenant is not None:
            body.count_against(self.held, tenant)
        try:
            if body.refused is not None:  # it declares more than its tenant's share has left
                await _answer(send, body.refused, scope)
                return
            await self.app(scope, body.receive, body.send)
        finally:
            body.give_back()


class BodyDeadline:
    """ASGI middleware: every request's body is timed, as ``RequestGuard`` times it (408 and
    the connection closed past its deadline; the app then hears ``http.disconnect``)."""

    def __init__(self, app: ASGIApp, *, grace_s: float, min_rate: float) -> None:
        self.app = app
        self.grace_s = grace_s
        self.min_rate = min_rate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = _TimedBody(receive, send, scope, self.grace_s, self.min_rate)
        await self.app(scope, body.receive, body.send)


class _TimedBody:
    """The ``receive`` and ``send`` of one request whose body has a deadline."""

    def __init__(self, receive: Receive, send: Send, scope: Scope, grace_s: float, min_rate: float) -> None:
        self._receive = receive
        self._send = send
        self._scope = scope
        self._grace_s = grace_s
        self._min_rate = min_rate
        self._start = time.monotonic()
        self._size = 0
        self._whole = False  # the body came: no deadline any more
        self._started = False  # the app's answer began
        self._answered = False  # we answered 408: what the app sends is dropped
        self._bodies: HeldBytes | None = None
        self._tenant: Tenant | None = None
        self._counted = 0  # bytes counted against the tenant's bodies_mb, given back at the end
        self._head: Message | None = None  # a response's start, held back for its body
        self.refused: exc.QuotaExceeded | None = None

    def count_against(self, bodies: HeldBytes, tenant: Tenant) -> None:
        """The body is ``tenant``'s: what it declares is counted now (``refused`` when over),
        what arrives past that as it arrives."""
        self._bodies, self._tenant = bodies, tenant
        declared = _header(self._scope, b"content-length")
        size = int(declared) if declared.isascii() and declared.isdigit() else 0
        try:
            bodies.take(tenant, size)
        except exc.QuotaExceeded as error:
            self.refused = error
        else:
            self._counted = size

    def give_back(self) -> None:
        if self._bodies is not None and self._tenant is not None:
            self._bodies.give_back(self._tenant, self._counted)
        self._counted = 0

    def _count(self) -> None:
        """The bytes come past what was counted: counted too, or the request refused (429)."""
        if self._bodies is None or self._tenant is None or self._size <= self._counted:
            return
        self._bodies.take(self._tenant, self._size - self._counted)
        self._counted = self._size

    def _deadline(self) -> float:
        return self._start + self._grace_s + self._size / self._min_rate

    async def receive(self) -> Message:
        if self._answered:
            return {"type": "http.disconnect"}
        if self._whole:
            message: Message = await self._receive()
            return message
        with anyio.move_on_after(max(0.0, self._deadline() - time.monotonic())):
            message = await self._receive()
            if message["type"] == "http.request":
                self._size += len(message.get("body", b""))
                self._whole = not message.get("more_body", False)
                try:
                    self._count()
                except exc.QuotaExceeded as error:
                    await self._refuse(error)
                    return {"type": "http.disconnect"}
            return message
        await self._time_out()
        return {"type": "http.disconnect"}  # the app hears what a client that left says

    async def send(self, message: Message) -> None:
        if self._answered:
            return
        if self._bodies is not None and message["type"] == "http.response.start" and _large(message):
            self._head = message  # sent with its body: a whole one is counted first
            return
        head, self._head = self._head, None
        whole = message["type"] == "http.response.body" and not message.get("more_body", False)
        if head is None or not whole or self._bodies is None or self._tenant is None:
            if head is not None:  # a streamed body: its route counts it (HeldResponse)
                await self._send_now(head)
            await self._send_now(message)
            return
        # A whole body (a listing, a stat, any JSON answer): held until the socket has it,
        # counted meanwhile; past the share, the 429 goes in its place
        body = bytes(message.get("body", b""))
        try:
            self._bodies.take(self._tenant, len(body), what="a response")
        except exc.QuotaExceeded as error:
            await self._refuse(error)
            return
        try:
            await self._send_now(head)
            # in pieces: the server waits for the socket to take what it has before it takes
            # the next, so the last send returns once all but the last piece is out
            for start in range(0, len(body), CHUNK):
                await self._send_now({"type": "http.response.body", "body": body[start : start + CHUNK],
                                      "more_body": True})  # fmt: skip
            await self._send_now({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._bodies.give_back(self._tenant, len(body))

    async def _send_now(self, message: Message) -> None:
        self._started = True
        await self._send(message)

    async def _time_out(self) -> None:
        await self._refuse(exc.RequestTimeout(
            f"the request's body came too slowly: {self._size:,} bytes in "
            f"{time.monotonic() - self._start:.0f} s; a body must come within {self._grace_s:g} s, "
            f"then at {self._min_rate:,.0f} bytes a second at least",
            fix="send the body at once, or at the rate the server takes",
        ))  # fmt: skip

    async def _refuse(self, error: exc.StockadeError) -> None:
        """``error`` answered in the app's place (unless its answer began), the connection
        closed, and the rest of the body left unread."""
        self._answered = True
        if self._started:  # no answer of ours fits in it: uvicorn closes a response left unfinished
            return
        await _answer(self._send, error, self._scope)


def _large(start: Message) -> bool:
    """A response that says it is longer than a piece (a stream, which says no length, is its
    route's to count: its head goes at once, before its first line)."""
    for key, value in start.get("headers") or ():
        if bytes(key).lower() == b"content-length":
            length = bytes(value)
            return length.isdigit() and int(length) > CHUNK
    return False


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers") or ():
        if bytes(key).lower() == name:
            return bytes(value).decode("latin-1")
    return ""


async def _answer(send: Send, error: exc.StockadeError, scope: Scope) -> None:
    """``error`` as its problem document, then the connection closed: the body it did not
    read is not read."""
    problem = problems.from_error(error, str(scope.get("path", "")))
    content = problem.content()
    headers = [(b"content-type", b"application/problem+json"), (b"connection", b"close"),
               (b"content-length", str(len(content)).encode())]  # fmt: skip
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in problem.headers.items()]
    await send({"type": "http.response.start", "status": problem.status, "headers": headers})
    await send({"type": "http.response.body", "body": content, "more_body": False})
