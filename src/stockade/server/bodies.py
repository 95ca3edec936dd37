"""Request bodies, bounded before anything parses them.

FastAPI reads a JSON route's whole body into memory before parsing it, whatever its size: a
200 MB body was held, then parsed into millions of objects, before the 422 said it was
wrong. ``BodyCap`` sits in front of every route and refuses a body over the service's
``max_request_bytes`` with a 413 problem (``RequestTooLarge``): at once when its
``Content-Length`` says so, else as soon as the bytes that arrived pass the cap, never
reading the rest. The routes whose body is the data itself (a file's content, an archive;
marked ``raw_body``) read it as it arrives with a cap of their own (``read_body``), and the
middleware leaves them alone.

A request outside ``/v1`` needs no token (the viewer's sign-in form, its cookie's forms), so
nothing vouches for its sender before its body is read: its cap is ``ANONYMOUS_BODY_BYTES``,
what a form of the viewer takes, not the 16 MiB of a tenant's JSON.

Why not FastAPI's own ``max_body_size``: when a body declares a size over it, Starlette's
limiter replaces whatever the app answers with a ``text/plain`` 413, and every error of this
API is an RFC 9457 problem document that the client turns back into a typed error.

A JSON body within the cap may still parse into far more than its size: each value is a
Python object (an empty list is 56 bytes for the 3 of ``[],``), and 16 MiB of ``[],`` took
~350 MB and seconds of the event loop inside ``json.loads``, before the schema refused it.
``JSONRoute`` counts a body's values before FastAPI parses it (``json_values``, in C, in
time linear in the body) and refuses one of more than ``MAX_JSON_VALUES`` with the API's
422: every request model takes far fewer (its lists and maps are bounded in ``schemas``).
What is left is parsed on the event loop, as FastAPI does: the count takes ~20 ms of a 16
MiB body and the parse at most ~60 ms (floats of 60 digits), and a thread would not free the
loop meanwhile, ``json.loads`` holding the GIL from start to end (another thread's 1 ms
sleep waited as long).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio.to_thread
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stockade import exceptions as exc
from stockade.sandbox._channel import json_values
from stockade.server import problems
from stockade.server.deps import recheck
from stockade.server.guard import needs_token

if TYPE_CHECKING:
    from fastapi import Request

    from stockade.server.tenants import Principal

__all__ = ["ANONYMOUS_BODY_BYTES", "MAX_JSON_VALUES", "BodyCap", "JSONRoute", "raw_body", "read_body"]

Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])

_RAW = "__stockade_raw_body__"
# the body of a request that needs no token (a viewer's form: a token, a decision, a CSRF value)
ANONYMOUS_BODY_BYTES = 64 * 1024
# The values of one JSON body as ``json_values`` counts them (a string and the comma before
# it are two): an argv as long as the kernel takes (2 MiB / 9 bytes an argument: 233,016)
# and what else a request holds. Parsed, they are a few tens of MB at most (an empty object,
# the largest, is 64 bytes and a pointer for the 2 counted of ``{},``).
MAX_JSON_VALUES = 1 << 19


def raw_body(endpoint: Endpoint) -> Endpoint:
    """Marks a route that reads its own body with ``read_body`` (and its own cap)."""
    setattr(endpoint, _RAW, True)
    return endpoint


async def read_body(request: Request, limit: int, caller: Principal) -> bytes:
    """The request body, refused past ``limit`` bytes while it arrives (413). Once it has all
    arrived, the token is asked again (``recheck``): an upload is minutes long at the slowest
    rate the service takes, and one whose token was taken out meanwhile landed (a workspace
    stored 3 s after its token was refused everywhere else)."""
    declared = _declared(request.headers.get("content-length"))
    if declared is not None and declared > limit:
        raise exc.FileTooLarge(f"the upload declares {declared:,} bytes, over the cap of {limit:,}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise exc.FileTooLarge(f"the upload is over the cap of {limit:,} bytes")
        chunks.append(chunk)
    await anyio.to_thread.run_sync(lambda: recheck(request, caller))
    return b"".join(chunks)


def _declared(value: str | None) -> int | None:
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


class JSONRoute(APIRoute):
    """A route whose JSON body is refused (422) before it is parsed when it holds more than
    ``MAX_JSON_VALUES`` values. The body is read here (FastAPI reads it again from the
    request's cache); a route without a body model (``raw_body``) reads its own, as it comes."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def bounded(request: Request) -> Response:
            body = await request.body()
            values = json_values(body, MAX_JSON_VALUES)
            if values > MAX_JSON_VALUES:
                raise RequestValidationError([{
                    "type": "too_many_values", "loc": ("body",),
                    "msg": f"the body holds over {MAX_JSON_VALUES:,} JSON values ({values:,}), "
                    "more than any request of the API takes",
                }])  # fmt: skip
            return await handler(request)

        return bounded


class BodyCap:
    """Every request's body at most ``limit`` bytes, but for the routes among ``routes``
    marked ``raw_body``."""

    def __init__(self, app: ASGIApp, *, limit: int, routes: Iterable[BaseRoute]) -> None:
        self.app = app
        self.limit = limit
        self._raw = [r for r in routes if getattr(getattr(r, "endpoint", None), _RAW, False)]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or any(r.matches(scope)[0] is Match.FULL for r in self._raw):
            await self.app(scope, receive, send)
            return
        limit = self.limit if needs_token(str(scope.get("path", ""))) else ANONYMOUS_BODY_BYTES
        headers = dict(scope.get("headers") or [])
        declared = _declared(headers.get(b"content-length", b"").decode("latin-1") or None)
        if declared is not None and declared > limit:
            await self._refuse(scope, send, f"declares {declared:,} bytes", limit)
            return
        if not declared and b"transfer-encoding" not in headers:
            # no body to read (a GET): asking for it would let the server read the socket again,
            # whatever the client has pipelined behind this request (``server/connections.py``)
            await self.app(scope, receive, send)
            return
        # Read here up to the cap (the route would read all of it anyway), then handed on.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the route hears it too
                await self.app(scope, _replay(message, receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(scope, send, "is longer", limit)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay(whole, receive), send)

    async def _refuse(self, scope: Scope, send: Send, what: str, limit: int) -> None:
        error = exc.RequestTooLarge(
            f"the request's body {what}, over the service's cap of {limit:,} bytes for a request",
            limit=limit,
            fix="send a file's content as a request of its own (PUT /v1/sandboxes/{id}/files/content)"
            if limit == self.limit
            else "a request outside /v1 takes a form's body, no more",
        )
        problem = problems.from_error(error, str(scope.get("path", "")))
        headers = [(b"content-type", b"application/problem+json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": problem.status, "headers": headers})
        await send({"type": "http.response.body", "body": problem.content(), "more_body": False})


def _replay(first: Message, receive: Receive) -> Receive:
    """A ``receive`` that gives ``first``, then the client's own messages."""
    pending = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
