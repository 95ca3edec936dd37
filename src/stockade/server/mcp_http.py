"""``stockade mcp`` over streamable HTTP: the SDK's app behind the checks a server reachable
by more than one client needs (a bearer token, Host and Origin matched whole, headers given
once, at most ``max_sessions`` sandboxes), and a session's end ending its run.

Apart from the protocol (``mcp_face``): what is refused here never reaches the SDK.
"""

from __future__ import annotations

import hmac
import re
from typing import TYPE_CHECKING

import anyio
import mcp_types as types
from mcp.server.transport_security import TransportSecuritySettings
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stockade import exceptions as exc
from stockade.server.body_limits import BODY_TIMEOUT_S, MIN_BODY_RATE
from stockade.server.guard import BodyDeadline
from stockade.server.mcp_cost import message_cost, too_costly
from stockade.server.mcp_face import GONE, MAX_MESSAGE_BYTES, SESSION_HEADER, McpFace

if TYPE_CHECKING:
    from stockade.server.connections import ConnectionLimits

__all__ = ["LOOPBACK", "MAX_BODIES_BYTES", "MAX_SESSIONS", "MIN_TOKEN_CHARS", "http_app", "serve_http"]

# HTTP sessions open at once, each with its sandbox (``--max-sessions``)
MAX_SESSIONS = 16
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Host and Origin of a server on this machine alone: a loopback name, and a port checked apart
_LOOPBACK_HOST = re.compile(r"(?:127\.0\.0\.1|localhost|\[::1\])(?::([0-9]{1,5}))?")
_LOOPBACK_ORIGIN = re.compile(r"http://" + _LOOPBACK_HOST.pattern)

# A bearer token shorter than this is refused: it guards running code on this machine.
MIN_TOKEN_CHARS = 16
# The request bodies held at once, every connection's together, by their bytes as they come
# and, once whole, what they take parsed (``message_cost``): a body of up to 4 MiB on each of
# the 1,000 connections allowed held 4 GB
MAX_BODIES_BYTES = 64 << 20


def http_app(
    face: McpFace, *, host: str = "127.0.0.1", path: str = "/mcp", token: str | None = None,
    max_sessions: int = MAX_SESSIONS, allowed_origins: tuple[str, ...] = (),
    body_timeout_s: float = BODY_TIMEOUT_S, min_body_rate: float = MIN_BODY_RATE,
) -> ASGIApp:  # fmt: skip
    """The streamable HTTP app: the SDK's, and the end of a session (``DELETE``) ends its run.
    With ``token``, every request must carry ``Authorization: Bearer <token>`` (401 otherwise).

    At most ``max_sessions`` sessions at once (each holds a sandbox: the SDK's default, 10,000,
    let one token holder start a sandbox per session; a request that would open one more is
    answered 503). A request from a web page (an ``Origin`` header) is refused (403) unless its
    origin is in ``allowed_origins``, or, when ``host`` is this machine alone, is this server's
    own (``http://127.0.0.1:PORT``, ``localhost``, ``[::1]``); there its ``Host`` must name this
    server too (421 otherwise), against DNS rebinding. MCP clients that are programs send no
    Origin. A ``DELETE`` ends the session's run only when the SDK ended the session (2xx).

    A POST's body must come whole within ``body_timeout_s``, then at ``min_body_rate`` bytes a
    second (``server/guard.py``): a slower one is answered 408, its connection closed, and its
    bytes leave the bodies held (16 connections stalled 4 MiB each into them, and every other
    client was answered 503 until they closed).

    The token is checked here, not with the SDK's bearer middleware: that one is the resource
    server of an OAuth authorization server (its metadata routes name an issuer), and a static
    shared secret has none to name."""
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise exc.InvalidArgument(
            f"the MCP token has {len(token)} characters: at least {MIN_TOKEN_CHARS}",
            argument="token",
            fix="make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'",
        )
    if max_sessions < 1:
        raise exc.InvalidArgument(
            f"max_sessions is {max_sessions}", argument="max_sessions", fix="give 1 or more"
        )
    loopback = host in LOOPBACK
    inner = face.server.streamable_http_app(
        streamable_http_path=path,
        host=host,
        session_idle_timeout=face.idle_timeout_s,
        max_sessions=max_sessions,
        max_request_body_size=MAX_MESSAGE_BYTES,
        # on this machine alone the SDK's own checks stay, the origins allowed added to them
        # (they match by prefix: ours, below, match whole)
        transport_security=TransportSecuritySettings(
            allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
            allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*", *allowed_origins],
        )
        if loopback
        else None,
    )
    posted = BodyDeadline(
        _bodies_within(inner, MAX_BODIES_BYTES), grace_s=body_timeout_s, min_rate=min_body_rate
    )
    face.start_reaper()
    expected = None if token is None else f"bearer {token}".encode()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await inner(scope, receive, send)
            return
        refused = _refusal(scope, expected=expected, loopback=loopback, allowed_origins=allowed_origins)
        if refused is not None:
            await refused(scope, receive, send)
            return
        if scope.get("method") == "POST":
            if SESSION_HEADER not in Headers(scope=scope) and face.agent.live() >= max_sessions:
                # A session the SDK let go may hold its sandbox a while yet (its run ending):
                # the SDK counts only its own, and let a new session in beside it.
                await _TOO_MANY(scope, receive, send)
                return
            await posted(scope, _watched(scope, receive), send)
            return
        if scope.get("method") != "DELETE":
            await inner(scope, receive, send)
            return
        answered: list[int] = []

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                answered.append(message["status"])
            await send(message)

        await inner(scope, receive, sending)
        # Only a DELETE the SDK carried out ends the run: one it refused (a wrong Host, Origin or
        # path) left its session open, and the client's next call got a new sandbox.
        key = Headers(scope=scope).get(SESSION_HEADER)
        if key and scope.get("path") == path and answered and 200 <= answered[0] < 300:
            await anyio.to_thread.run_sync(face.end_session, key)

    return app


def _bodies_within(app: ASGIApp, limit: int) -> ASGIApp:
    """``app``, given a request once its body is read, the bodies of the requests in ``app``
    together at most ``limit`` (each is held until its request is answered): its bytes as they
    come, and once whole what it takes parsed. One past that is answered 503, with
    ``Retry-After``, before more of it is read or it is parsed; one that alone would take more
    than ``MAX_MESSAGE_COST`` parsed is answered 413. A body longer than a message may be is
    passed on unread when it says so (``Content-Length``), else once that much is read, for
    ``app`` to refuse (413). A request whose client left (or whose body was cut, past its
    deadline) is not passed on: its bytes leave the total at once."""
    held = 0

    async def bounded(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal held
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_MESSAGE_BYTES:
            await app(scope, receive, send)
            return
        size = taken = 0  # the body's bytes read; what is counted of it in ``held``
        read: list[Message] = []
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                read.append(message)
                more = len(message.get("body", b""))
                size += more
                whole = not message.get("more_body") or size > MAX_MESSAGE_BYTES
                if whole and size <= MAX_MESSAGE_BYTES:  # the SDK parses it: what that takes
                    cost = message_cost(b"".join(m.get("body", b"") for m in read))
                    if (why := too_costly(cost)) is not None:
                        await _too_costly(why)(scope, receive, send)
                        return
                    more += cost
                if held + more > limit:
                    await _BUSY(scope, receive, send)
                    return
                held, taken = held + more, taken + more
                if whole:
                    break
            await app(scope, _replaying(read, receive), send)
        finally:
            held -= taken

    return bounded


def _replaying(read: list[Message], receive: Receive) -> Receive:
    """``receive``, after the messages already ``read`` of it (taken from ``read``: once the
    app has them, only its copy holds their bytes)."""

    async def replaying() -> Message:
        return read.pop(0) if read else await receive()

    return replaying


def _watched(scope: Scope, receive: Receive) -> Receive:
    """``receive``, setting the scope's ``GONE`` event once the client disconnects."""
    gone = scope[GONE] = anyio.Event()

    async def watching() -> Message:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
        return message

    return watching


_TOO_MANY = JSONResponse(
    {
        "jsonrpc": "2.0",
        "id": None,
        "error": {"code": types.INTERNAL_ERROR, "message": "Too many open sessions"},
    },
    status_code=503,
)
_BUSY = JSONResponse(
    {
        "jsonrpc": "2.0",
        "id": None,
        "error": {"code": types.INTERNAL_ERROR, "message": "Too many request bodies at once: retry shortly"},
    },
    status_code=503,
    headers={"Retry-After": "1"},
)


def _too_costly(why: str) -> JSONResponse:
    return JSONResponse(
        {"jsonrpc": "2.0", "id": None, "error": {"code": types.INVALID_REQUEST, "message": why}},
        status_code=413,
    )


_FOREIGN_PAGE = JSONResponse(
    {"error": "Forbidden", "detail": "a request from a web page whose origin is not allowed"}, status_code=403
)


def _refusal(
    scope: Scope, *, expected: bytes | None, loopback: bool, allowed_origins: tuple[str, ...]
) -> JSONResponse | None:
    """The answer to an HTTP request refused before the SDK sees it, if it is."""
    if _repeated(scope, (b"authorization", SESSION_HEADER.encode(), b"host", b"origin")):
        # The SDK reads a header's first copy and a dict of them its last: a DELETE naming
        # its own session first and another's last ended the other one.
        return JSONResponse(
            {
                "error": "Bad Request",
                "detail": f"give Authorization, {SESSION_HEADER}, Host and Origin once each",
            },
            status_code=400,
        )
    if loopback and (refused := _not_this_server(scope, allowed_origins)) is not None:
        return refused
    headers = dict(scope.get("headers") or [])
    if expected is not None:
        scheme, _, credential = headers.get(b"authorization", b"").partition(b" ")
        # the scheme's case is free (RFC 9110)
        if not hmac.compare_digest(scheme.lower() + b" " + credential, expected):
            return JSONResponse(
                {
                    "error": "Unauthorized",
                    "detail": "this MCP endpoint needs Authorization: Bearer <token>",
                },
                status_code=401,
                headers={"WWW-Authenticate": 'Bearer realm="stockade mcp"'},
            )
    origin = headers.get(b"origin")
    if not loopback and origin is not None and origin.decode("latin-1") not in allowed_origins:
        return _FOREIGN_PAGE
    return None


def _not_this_server(scope: Scope, allowed_origins: tuple[str, ...]) -> JSONResponse | None:
    """The refusal of a request whose Host, or Origin, is not this server on this machine.

    The SDK's check matches a prefix (``127.0.0.1:*`` let in ``Host: 127.0.0.1:80@evil.example``
    and ``Origin: http://127.0.0.1:1.evil.example``); here the whole value is matched, with this
    server's own port (a page another local server serves is another origin)."""
    server = scope.get("server")
    port = server[1] if server and server[1] else None
    headers = Headers(scope=scope)
    if not _names_this_server(_LOOPBACK_HOST, headers.get("host", ""), port):
        return JSONResponse(
            {"error": "Misdirected Request", "detail": "the Host header does not name this server"},
            status_code=421,
        )
    origin = headers.get("origin")
    if origin is None or origin in allowed_origins or _names_this_server(_LOOPBACK_ORIGIN, origin, port):
        return None
    return _FOREIGN_PAGE


def _names_this_server(form: re.Pattern[str], value: str, port: int | None) -> bool:
    """Whether ``value`` is, whole, a loopback name with this server's port (80 when none is
    given; any, when the server's own is unknown)."""
    match = form.fullmatch(value.lower())
    if match is None:
        return False
    return port is None or int(match.group(1) or 80) == port


def _repeated(scope: Scope, names: tuple[bytes, ...]) -> bool:
    """Whether a request carries one of ``names`` (lower-case) more than once."""
    seen = [name.lower() for name, _ in scope.get("headers") or []]
    return any(seen.count(name) > 1 for name in names)


def serve_http(
    face: McpFace, *, host: str, port: int, token: str | None = None, log_level: str = "warning",
    max_sessions: int = MAX_SESSIONS, allowed_origins: tuple[str, ...] = (),
    connections: ConnectionLimits | None = None, body_timeout_s: float = BODY_TIMEOUT_S,
    min_body_rate: float = MIN_BODY_RATE,
) -> None:  # fmt: skip
    """Serve ``face`` over streamable HTTP, its connections held as ``stockade serve``'s are
    (a head timeout and a cap: idle sockets took every file descriptor of the API's process),
    and its bodies timed as they are (``http_app``)."""
    import uvicorn

    from stockade.server.connections import ConnectionLimits, guarded_protocol
    from stockade.server.serving import log_config

    limits = (connections or ConnectionLimits()).fitted()
    app = http_app(
        face, host=host, token=token, max_sessions=max_sessions, allowed_origins=allowed_origins,
        body_timeout_s=body_timeout_s, min_body_rate=min_body_rate,
    )  # fmt: skip
    uvicorn.run(
        app, host=host, port=port, log_level=log_level, log_config=log_config(),
        http=guarded_protocol(limits), timeout_keep_alive=limits.keep_alive_s,
    )  # fmt: skip
