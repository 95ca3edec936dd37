"""``stockade mcp``: the agent tools as an MCP server (the official ``mcp`` SDK), over stdio or
streamable HTTP, with a sandbox per client session.

A thin shell over ``mcp_session``: each MCP session is an agent run whose model is the client
(``McpSession``), so the policy, the limits, the kill switch, approvals and the audit trail
are the agent's own. This module only speaks the protocol:

- ``tools/list``, ``tools/call``: the toolset's tools the role allows (run_code, run_tests,
  read_file, write_file, apply_patch, list_files, git_diff); a call's observation is the
  result, an error or a denial is ``isError`` with the reason the model of a run would read;
- ``resources/list``, ``resources/read``: ``stockade://workspace/<path>`` for each file the
  policy lets the session read, ``stockade://session/diff`` (the session's changes) and
  ``stockade://session`` (its run id, for ``stockade kill`` or ``stockade runs show``); a
  read or a listing is the call of read_file, git_diff or list_files (judged, limited and
  recorded as that call), its content the call's result;
- whatever a handler raises is that request's error, never the server's end;
- an action the policy sends for approval is asked through the client when it supports
  elicitation (a yes/no form: ``elicitation/create`` on the handshake versions; on 2026-07-28,
  an ``InputRequiredResult`` whose answer comes with the client's retry of the call);
  otherwise the call waits for ``stockade approve RUN REQUEST`` (or the run viewer's button)
  for ``approval_wait_s``, and is denied, with the reason recorded, when nobody decided.

Sessions. Over stdio the process serves one client: that is the session. Over HTTP a session
is the transport's (``Mcp-Session-Id``, the handshake protocol versions); it ends when the
client deletes it, when it has been idle for ``idle_timeout_s``, or when the server stops.
The 2026-07-28 protocol has no sessions over HTTP: a client that probes for it is answered
so that it falls back to a session (``server/discover`` is refused there).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import logging
import os
import re
import stat
import sys
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, Literal, TypeVar, cast

import anyio
import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE, TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stockade import exceptions as exc
from stockade._display import visible
from stockade.policy import approval
from stockade.policy.approval import CLIENT_ACTOR, Choice
from stockade.server.mcp_session import (
    CANCELLED,
    CallResult,
    Ended,
    McpAgent,
    McpSession,
    Outcome,
    Paused,
    PendingApproval,
)

if TYPE_CHECKING:
    from stockade.server.connections import ConnectionLimits

__all__ = ["McpFace", "http_app", "serve_http", "serve_stdio"]

log = logging.getLogger("stockade.mcp")

Transport = Literal["stdio", "http"]
_Handler = TypeVar("_Handler", bound=Callable[..., Awaitable[Any]])
WORKSPACE = "stockade://workspace/"
DIFF = "stockade://session/diff"
INFO = "stockade://session"
SESSION_HEADER = "mcp-session-id"
MAX_RESOURCES = 2000  # files listed as resources (the workspace diff's own cap is larger)
_APPROVE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "approve": {
            "type": "boolean",
            "title": "Approve",
            "description": "Let the action run (false: deny it; the model is told)",
        }
    },
    "required": ["approve"],
}


def _text(text: str, *, error: bool) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=error)


def _result(outcome: Outcome) -> types.CallToolResult:
    if isinstance(outcome, CallResult):
        return _text(outcome.text, error=outcome.is_error)
    if isinstance(outcome, Ended):
        why = f": {outcome.error}" if outcome.error else ""
        return _text(
            f"this MCP session's run has ended ({outcome.status}{why}); start a new session", error=True
        )
    return _text("the call waits for an approval", error=True)  # not reached: Paused is answered first


# HTTP sessions open at once, each with its sandbox (``--max-sessions``)
MAX_SESSIONS = 16
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# One JSON-RPC message, either transport: an HTTP body over it is answered 413, a stdio line
# over it ends the session (the SDK reads a line whole: one of 200 MB took 928 MB).
MAX_MESSAGE_BYTES = DEFAULT_MAX_REQUEST_BODY_SIZE
# Host and Origin of a server on this machine alone: a loopback name, and a port checked apart
_LOOPBACK_HOST = re.compile(r"(?:127\.0\.0\.1|localhost|\[::1\])(?::([0-9]{1,5}))?")
_LOOPBACK_ORIGIN = re.compile(r"http://" + _LOOPBACK_HOST.pattern)


class McpFace:
    """The MCP server over one ``McpAgent``."""

    def __init__(
        self, agent: McpAgent, *, transport: Transport, approval_wait_s: float = 300.0,
        idle_timeout_s: float | None = 1800.0,
    ) -> None:  # fmt: skip
        self.agent = agent
        self.transport = transport
        self.approval_wait_s = approval_wait_s
        self.idle_timeout_s = idle_timeout_s
        self._used: dict[str, float] = {}  # when each session was last used (a call's end counts)
        self._calls: dict[str, int] = {}  # its calls in flight: a session in a call is not idle
        self._watched: set[str] = set()  # sessions ended with their SDK connection
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.server: Server[Any] = Server(
            "stockade",
            version=_version(),
            instructions=(
                "Tools that run code in a sandbox of their own, under a policy: every call is judged, "
                "limited and recorded in an audit trail. Read stockade://session/diff for what changed."
            ),
            on_list_tools=_answering(self._list_tools),
            on_call_tool=_answering(self._call_tool),
            on_list_resources=_answering(self._list_resources),
            on_read_resource=_answering(self._read_resource),
        )
        if transport == "http":
            self.server.add_request_handler("server/discover", types.RequestParams, self._no_discover)

    # -- sessions ------------------------------------------------------------------------------

    def _key(self, ctx: ServerRequestContext[Any, Any]) -> str:
        if self.transport == "stdio":
            return "stdio"  # one client per process
        request = ctx.request
        key = (
            request.headers.get(SESSION_HEADER)
            if request is not None and hasattr(request, "headers")
            else None
        )
        # Over HTTP a session is the handshake's: the SDK answers a request naming an id it
        # does not know with 404. A 2026-07-28 request has no session, and the SDK reads no
        # header of its: a client that named its own ids opened sandboxes past --max-sessions,
        # and another session's id reached that session's sandbox.
        if not key or ctx.session.protocol_version in MODERN_PROTOCOL_VERSIONS:
            raise MCPError(
                types.INVALID_REQUEST,
                "stockade keeps a sandbox per MCP session: connect with a session (the initialize handshake)",
            )
        return str(key)

    def _session(self, ctx: ServerRequestContext[Any, Any]) -> McpSession:
        key = self._key(ctx)
        params = ctx.session.client_params
        info = params.client_info if params is not None else None
        client = f"{info.name} {info.version}" if info is not None else "an MCP client"
        self._used[key] = time.monotonic()
        if self.transport == "http" and key not in self._watched:
            self._end_with_connection(ctx, key)
        return self.agent.session(key, client=client)

    def _end_with_connection(self, ctx: ServerRequestContext[Any, Any], key: str) -> None:
        """End session ``key``'s run when the SDK ends the session (idle, deleted, the server
        stopping): the SDK's idle timeout cut a call whose client had gone and freed the
        session's ``--max-sessions`` slot, while its sandbox lived on another idle timeout
        (two sandboxes under ``--max-sessions 1``). The SDK unwinds a connection's
        ``exit_stack`` as it ends; the handlers' context names the connection only privately,
        so without it the reaper and ``http_app``'s count of live sessions still hold."""
        stack = getattr(getattr(ctx.session, "_connection", None), "exit_stack", None)
        if not isinstance(stack, contextlib.AsyncExitStack):
            return
        self._watched.add(key)

        async def ended() -> None:
            self._watched.discard(key)
            if self.agent.find(key) is not None:
                log.info("MCP session %s ended by the transport: its run ends", key)
                await anyio.to_thread.run_sync(self.end_session, key)

        stack.push_async_callback(ended)

    @contextlib.contextmanager
    def _in_use(self, key: str) -> Iterator[None]:
        """A call of session ``key`` runs: the session is not idle until it ends (a long
        ``run_tests``, or a user taking their time over an approval)."""
        self._calls[key] = self._calls.get(key, 0) + 1
        try:
            yield
        finally:
            self._calls[key] -= 1
            if not self._calls[key]:
                del self._calls[key]
            if key in self._used:  # not ended meanwhile
                self._used[key] = time.monotonic()

    def end_session(self, key: str) -> None:
        session = self.agent.forget(key)
        self._used.pop(key, None)
        if session is not None:
            session.end()

    def start_reaper(self) -> None:
        """End HTTP sessions idle for ``idle_timeout_s`` (their sandboxes go with them)."""
        if self.idle_timeout_s is None or self._reaper is not None:
            return

        def reap() -> None:
            assert self.idle_timeout_s is not None
            while not self._stop.wait(min(30.0, self.idle_timeout_s / 4)):
                now = time.monotonic()
                for key, used in list(self._used.items()):
                    if now - used > self.idle_timeout_s and not self._calls.get(key):
                        log.info("MCP session %s idle for %.0f s: ended", key, now - used)
                        self.end_session(key)

        self._reaper = threading.Thread(target=reap, name="stockade-mcp-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        self._stop.set()
        self.agent.close()

    # -- handlers ------------------------------------------------------------------------------

    async def _no_discover(self, ctx: ServerRequestContext[Any, Any], params: types.RequestParams) -> None:
        raise MCPError(
            types.METHOD_NOT_FOUND,
            "this server keeps a sandbox per session: connect with the initialize handshake",
        )

    async def _list_tools(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[types.Tool(name=n, description=d, input_schema=s) for n, d, s in self.agent.tools]
        )

    async def _call_tool(
        self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult | types.InputRequiredResult:
        session = self._session(ctx)
        with self._in_use(self._key(ctx)):
            return await self._call(ctx, session, params.name, params.arguments or {}, params.input_responses)

    async def _call(
        self, ctx: ServerRequestContext[Any, Any], session: McpSession, name: str, args: dict[str, Any],
        responses: Any = None, *, resource: bool = False,
    ) -> types.CallToolResult | types.InputRequiredResult:  # fmt: skip
        """One call as the session's next step, its approvals asked; a ``resource`` read is the
        call of its matching tool, its approvals asked as a handshake client's are (a resource
        read has no retry to carry an answer)."""
        held = session.paused
        if held is None:
            outcome = await session.call(name, args, resource=resource, gone=_gone(ctx))
        elif resource:
            raise MCPError(
                types.INVALID_REQUEST,
                "a tool call of this session waits for its approval: answer it (retry the call) first",
            )
        elif not held.holds(name, args):
            # Calls of a session run one at a time, and the run waits on the held one: another
            # call got the held call's question, and its retry ran the held call.
            waits = held.call.name if held.call is not None else "another call"
            raise MCPError(
                types.INVALID_REQUEST,
                f"a call of {waits} in this session waits for its approval: retry that call, the same "
                "name and arguments, with the answer first (a session's calls run one at a time)",
            )
        elif responses and self._client_decides and await self._answered(session, held, responses):
            session.paused = None
            outcome = await session.resume()
        else:  # an action still waits for its answer: the session asks again
            outcome = held
        while isinstance(outcome, Paused):
            # 2026-07-28: the answer comes with the retry
            if not resource and self._client_decides and _asks_by_retry(ctx):
                session.paused = outcome
                return _input_required(outcome)
            # One deadline for the pause, whatever it asks: each question waited for in full
            # held one call 80 s under --approval-wait 8, and past --max-session-s
            wait_s = round(min(self.approval_wait_s, session.wall_left()), 3)
            deadline = anyio.current_time() + wait_s
            try:
                for pending in outcome.approvals:
                    await self._ask(ctx, session, pending, deadline=deadline, wait_s=wait_s)
            except BaseException:
                # The call was cancelled (or the asking failed) while the run waits: what is
                # undecided is denied and the run goes on, or the session's next call would
                # wait behind a decision nobody is asked for any more.
                with anyio.CancelScope(shield=True), contextlib.suppress(exc.StockadeError):
                    await anyio.to_thread.run_sync(functools.partial(session.give_up, outcome, by=CANCELLED))
                raise
            outcome = await session.resume()
        return _result(outcome)

    @property
    def _client_decides(self) -> bool:
        """Whether the MCP client is asked to decide its session's held actions: not under a role
        that cannot approve (``can_approve = false``), whose client approved its own ``rm -r src``
        through elicitation. There the call waits for ``stockade approve``, as without one."""
        return self.agent.agent.engine.role.can_approve

    async def _answered(self, session: McpSession, held: Paused, responses: Any) -> bool:
        """Record the decisions the client's retry carries; whether every request has one."""
        for pending in held.approvals:
            answer = responses.get(pending.request_id)
            if not isinstance(answer, types.ElicitResult):
                return False
            approved = answer.action == "accept" and (answer.content or {}).get("approve") is True
            choice = Choice.APPROVED if approved else Choice.DENIED
            by = _client_decider(session, answer.action)
            with contextlib.suppress(exc.ApprovalDecided):  # decided elsewhere first: that stands
                await anyio.to_thread.run_sync(functools.partial(session.decide, pending, choice, by=by))
        return True

    async def _ask(
        self, ctx: ServerRequestContext[Any, Any], session: McpSession, pending: PendingApproval, *,
        deadline: float, wait_s: float,
    ) -> None:  # fmt: skip
        """Get a decision: from the client's user (elicitation), else from whoever runs
        ``stockade approve``, by ``deadline`` (the pause's: ``wait_s`` after it began, within
        ``approval_wait_s`` and the session's wall time left); nobody: denied, and the reason
        kept. An elicitation is waited for no longer than that: a client that never answered
        held its call, its sandbox and (over HTTP) its session's slot for good, past
        ``--approval-wait`` and ``--max-session-s``. Past the deadline nobody is asked."""
        if anyio.current_time() >= deadline:
            await self._deny(session, pending, approval.unanswered(f"the pause's {wait_s:g} s had run out"))
            return
        caps = ctx.session.client_capabilities
        if (
            self._client_decides
            and caps is not None
            and caps.elicitation is not None
            and ctx.session.can_send_request
        ):
            answer: types.ElicitResult | None = None
            with anyio.move_on_after(deadline - anyio.current_time()):
                answer = await ctx.session.elicit_form(
                    message=_message(pending),
                    requested_schema=_APPROVE_SCHEMA,
                    related_request_id=ctx.request_id,
                )
            if answer is None:
                unanswered = approval.unanswered(f"the MCP client answered nothing within {wait_s:g} s")
                await self._deny(session, pending, unanswered)
                return
            approved = answer.action == "accept" and (answer.content or {}).get("approve") is True
            choice = Choice.APPROVED if approved else Choice.DENIED
            by = _client_decider(session, answer.action)
            with contextlib.suppress(exc.ApprovalDecided):  # decided elsewhere meanwhile: that stands
                await anyio.to_thread.run_sync(lambda: session.decide(pending, choice, by=by))
            return
        print(
            f"stockade mcp: {visible(pending.action)} waits for approval: "
            f"stockade approve {pending.run_id} {pending.request_id} (or deny); "
            f"{round(deadline - anyio.current_time(), 1):g} s",
            file=sys.stderr,
            flush=True,
        )
        while anyio.current_time() < deadline:
            if await anyio.to_thread.run_sync(lambda: session.decision(pending)) is not None:
                return
            await anyio.sleep(min(0.25, max(0.0, deadline - anyio.current_time())))
        await self._deny(session, pending, approval.unanswered(f"nobody answered within {wait_s:g} s"))

    @staticmethod
    async def _deny(session: McpSession, pending: PendingApproval, by: str) -> None:
        """Deny what nobody decided in time; the trail records the no as ``by``'s."""
        with contextlib.suppress(exc.ApprovalDecided):  # decided at the last moment: that stands
            await anyio.to_thread.run_sync(lambda: session.decide(pending, Choice.DENIED, by=by))

    async def _resource(self, ctx: ServerRequestContext[Any, Any], tool: str, args: dict[str, Any]) -> str:
        """The content a resource read gets through the call of ``tool`` (see ``McpSession.call``)."""
        session = self._session(ctx)
        with self._in_use(self._key(ctx)):
            result = await self._call(ctx, session, tool, args, resource=True)
        assert isinstance(result, types.CallToolResult)  # a resource read is never asked by retry
        said = result.content[0]
        text = said.text if isinstance(said, types.TextContent) else ""
        if result.is_error:
            raise MCPError(types.INVALID_PARAMS, text)
        return text

    async def _list_resources(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        # the workspace's files as list_files sees them, when the role may list them at all
        # (a denied call would count against the session's denials in a row)
        listed = await self._resource(ctx, "list_files", {}) if self.agent.allows("list_files") else "[]"
        resources = [
            types.Resource(
                uri=INFO, name="session", description="this session's run id, tier and status (JSON)",
                mime_type="application/json",
            ),
        ]  # fmt: skip
        if self.agent.allows("git_diff"):
            resources.append(
                types.Resource(
                    uri=DIFF, name="session diff", description="what this session changed in the workspace",
                    mime_type="text/x-diff",
                )
            )  # fmt: skip
        resources += [
            types.Resource(uri=WORKSPACE + urllib.parse.quote(path), name=path, mime_type="text/plain")
            for path in json.loads(listed)[:MAX_RESOURCES]
        ]
        return types.ListResourcesResult(resources=resources)

    async def _read_resource(
        self, ctx: ServerRequestContext[Any, Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        uri = str(params.uri)
        if uri == INFO:
            text, mime = json.dumps(self._session(ctx).info()), "application/json"
        elif uri == DIFF:
            text, mime = await self._resource(ctx, "git_diff", {}), "text/x-diff"
        elif uri.startswith(WORKSPACE):
            path = urllib.parse.unquote(uri.removeprefix(WORKSPACE))
            text, mime = await self._resource(ctx, "read_file", {"path": path}), "text/plain"
        else:
            raise MCPError(types.INVALID_PARAMS, f"no resource {uri!r}: use {WORKSPACE}PATH or {DIFF}")
        return types.ReadResourceResult(
            contents=[types.TextResourceContents(uri=uri, text=text, mime_type=mime)]
        )


def _answering(handler: _Handler) -> _Handler:
    """A handler whose failure is its request's error: an exception out of it ended the SDK's
    task group (a ``RunStopped``, no ``Exception``, killed the stdio process; over HTTP every
    later request of every client was answered 500), whatever the other sessions were doing."""

    @functools.wraps(handler)
    async def answer(ctx: ServerRequestContext[Any, Any], params: Any) -> Any:
        try:
            return await handler(ctx, params)
        except MCPError:
            raise
        except exc.StockadeError as error:
            raise MCPError(types.INTERNAL_ERROR, f"{type(error).__name__}: {error}") from None
        except (Exception, exc.RunStopped) as error:
            log.exception("an MCP %s request failed", getattr(handler, "__name__", "handler"))
            raise MCPError(
                types.INTERNAL_ERROR, f"the request failed: {type(error).__name__}: {error}"
            ) from None

    return cast("_Handler", answer)


def _client_decider(session: McpSession, action: str) -> str:
    """Who decided through the client's elicitation: the client (its name as it gave it, quoted
    and escaped), not a person the server knows; the trail records it as such."""
    return f"{CLIENT_ACTOR}{json.dumps(session.client)} (elicitation: {json.dumps(action)})"


# Set in an HTTP request's scope when its client disconnects (``http_app``): the SDK goes on
# serving a request whose connection closed, and its queued call kept its arguments.
_GONE = "stockade.gone"


def _gone(ctx: ServerRequestContext[Any, Any]) -> Callable[[], Awaitable[object]] | None:
    """What returns once the HTTP request of ``ctx`` went away, if it came over HTTP."""
    request = ctx.request
    scope = getattr(request, "scope", None)
    event = scope.get(_GONE) if isinstance(scope, dict) else None
    return event.wait if isinstance(event, anyio.Event) else None


def _watched(scope: Scope, receive: Receive) -> Receive:
    """``receive``, setting the scope's ``_GONE`` event once the client disconnects."""
    gone = scope[_GONE] = anyio.Event()

    async def watching() -> Message:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
        return message

    return watching


def _message(pending: PendingApproval) -> str:
    # shown to a person, who decides on it: code chose the action's words, not how they show
    action, reason = visible(pending.action), visible(pending.reason)
    return f"stockade: {action} needs your approval ({reason}; rule {pending.rule})"


def _asks_by_retry(ctx: ServerRequestContext[Any, Any]) -> bool:
    """A 2026-07-28 client that can ask its user: no server-to-client request exists there."""
    caps = ctx.session.client_capabilities
    return (
        ctx.session.protocol_version in MODERN_PROTOCOL_VERSIONS
        and caps is not None
        and caps.elicitation is not None
    )


def _input_required(paused: Paused) -> types.InputRequiredResult:
    return types.InputRequiredResult(
        input_requests={
            p.request_id: types.ElicitRequest(
                params=types.ElicitRequestFormParams(message=_message(p), requested_schema=_APPROVE_SCHEMA)
            )
            for p in paused.approvals
        },
        request_state=paused.approvals[0].run_id if paused.approvals else "paused",
    )


def _version() -> str:
    from stockade import __version__

    return __version__


async def serve_stdio(face: McpFace, *, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
    """Serve the one client on this process's stdin/stdout until it closes them. A message (a
    line) longer than ``max_message_bytes`` ends the session: ``RequestTooLarge`` once it has."""
    from mcp.server.stdio import stdio_server

    with _claimed_stdin() as wire:
        # the transport only iterates its stdin: it gets lines bounded before they are read whole
        bounded = _BoundedLines(wire, max_message_bytes)
        async with stdio_server(stdin=cast("anyio.AsyncFile[str]", bounded)) as (read, write):
            # the protocol has stdout (taken above); a stray print (a library's log line) would
            # corrupt it, so from here stdout is stderr
            real, sys.stdout = sys.stdout, sys.stderr
            try:
                await face.server.run(read, write, face.server.create_initialization_options())
            finally:
                sys.stdout = real
    if bounded.too_long:
        # its answer could not be told apart from the message's next piece: the session ended
        raise exc.RequestTooLarge(
            f"the client sent a message longer than {max_message_bytes} bytes: the session ended "
            "(over HTTP such a message is answered 413)",
            limit=max_message_bytes, fix="send smaller messages (a large file in pieces)",
        )  # fmt: skip


class _BoundedLines:
    """The lines of ``wire`` as text, each at most ``limit`` bytes; a longer one ends them
    (``too_long`` says so).

    A pipe, socket or terminal is waited on by the event loop and read only once it has bytes,
    so a stop signal cancels the wait: a thread blocked in ``readline`` could not be cancelled,
    and kept the process alive (ignoring SIGTERM) until the client closed stdin. A file (or
    anything not a descriptor) never blocks for long: it is read in a worker thread."""

    def __init__(self, wire: BinaryIO, limit: int) -> None:
        self._wire = wire
        self._limit = limit
        self._fd = _pollable(wire)
        self._buffer = bytearray()
        self._at_end = False
        self.too_long = False

    def __aiter__(self) -> _BoundedLines:
        return self

    async def __anext__(self) -> str:
        if self._fd is None:
            read = functools.partial(self._wire.readline, self._limit + 1)
            line = await anyio.to_thread.run_sync(read, abandon_on_cancel=True)
        else:
            line = await self._polled_line(self._fd)
        if not line:
            raise StopAsyncIteration
        if len(line) > self._limit and not line.endswith(b"\n"):
            self.too_long = True
            raise StopAsyncIteration
        return line.decode("utf-8", errors="replace")

    async def _polled_line(self, fd: int) -> bytes:
        """As ``readline(limit + 1)``: a line, its first ``limit + 1`` bytes, or what is left."""
        while True:
            end = self._buffer.find(b"\n", 0, self._limit + 1)
            if end >= 0 or len(self._buffer) > self._limit or self._at_end:
                take = end + 1 if end >= 0 else self._limit + 1
                line = bytes(self._buffer[:take])
                del self._buffer[:take]
                return line
            await anyio.wait_readable(fd)
            chunk = os.read(fd, _READ_BYTES)  # readable: returns at once, b"" at the end
            self._at_end = not chunk
            self._buffer += chunk


_READ_BYTES = 64 * 1024


def _pollable(wire: BinaryIO) -> int | None:
    """``wire``'s descriptor when a read of it may wait for ever (a pipe, socket or terminal)."""
    try:
        fd = wire.fileno()
        mode = os.fstat(fd).st_mode
    except (OSError, ValueError):  # not a file (tests)
        return None
    waits = stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or (stat.S_ISCHR(mode) and os.isatty(fd))
    return fd if waits else None


@contextlib.contextmanager
def _claimed_stdin() -> Iterator[BinaryIO]:
    """The client's stdin on a descriptor of its own, fd 0 on the null device meanwhile, as the
    SDK does for the stdin it opens itself: a child, or a stray read, must not take its bytes."""
    stdin = sys.stdin.buffer
    try:
        on_fd = stdin.fileno() == 0
    except (OSError, ValueError):  # not a file (tests): read it in place
        on_fd = False
    if not on_fd:
        yield stdin
        return
    import fcntl

    wire = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        # never closed: a reader thread may still be blocked on it when the session ends
        yield os.fdopen(wire, "rb", closefd=False)
    finally:
        os.dup2(wire, 0)


# A bearer token shorter than this is refused: it guards running code on this machine.
MIN_TOKEN_CHARS = 16


def http_app(
    face: McpFace, *, host: str = "127.0.0.1", path: str = "/mcp", token: str | None = None,
    max_sessions: int = MAX_SESSIONS, allowed_origins: tuple[str, ...] = (),
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
            await inner(scope, _watched(scope, receive), send)
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


_TOO_MANY = JSONResponse(
    {
        "jsonrpc": "2.0",
        "id": None,
        "error": {"code": types.INTERNAL_ERROR, "message": "Too many open sessions"},
    },
    status_code=503,
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
    connections: ConnectionLimits | None = None,
) -> None:  # fmt: skip
    """Serve ``face`` over streamable HTTP, its connections held as ``stockade serve``'s are
    (a head timeout and a cap: idle sockets took every file descriptor of the API's process)."""
    import uvicorn

    from stockade.server.connections import ConnectionLimits, guarded_protocol
    from stockade.server.serving import log_config

    limits = (connections or ConnectionLimits()).fitted()
    app = http_app(face, host=host, token=token, max_sessions=max_sessions, allowed_origins=allowed_origins)
    uvicorn.run(
        app, host=host, port=port, log_level=log_level, log_config=log_config(),
        http=guarded_protocol(limits), timeout_keep_alive=limits.keep_alive_s,
    )  # fmt: skip
