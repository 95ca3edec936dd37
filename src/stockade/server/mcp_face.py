"""``McpFace``: the MCP protocol's handlers (``tools/*``, ``resources/*``) over one ``McpAgent``,
and the life of its sessions (which request is which session, their idle reaper, their end
with the SDK's).

The transports serve it (``mcp_stdio``, ``mcp_http``); what a paused call asks, and of whom,
is its base class (``mcp_approvals``). A tool call or a resource read is a step of the
session's run (``mcp_session``); here it is only passed in, and its outcome answered.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Literal, TypeVar, cast

import anyio
import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from stockade import exceptions as exc
from stockade.server.mcp_approvals import AskingApprovals, asks_by_retry, input_required
from stockade.server.mcp_outcomes import CallResult, Ended, Outcome, Paused
from stockade.server.mcp_session import CANCELLED, McpAgent, McpSession

__all__ = ["GONE", "MAX_MESSAGE_BYTES", "SESSION_HEADER", "McpFace"]

log = logging.getLogger("stockade.mcp")

Transport = Literal["stdio", "http"]
_Handler = TypeVar("_Handler", bound=Callable[..., Awaitable[Any]])
WORKSPACE = "stockade://workspace/"
DIFF = "stockade://session/diff"
INFO = "stockade://session"
SESSION_HEADER = "mcp-session-id"
MAX_RESOURCES = 2000  # files listed as resources (the workspace diff's own cap is larger)


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


# One JSON-RPC message, either transport: an HTTP body over it is answered 413, a stdio line
# over it ends the session (the SDK reads a line whole: one of 200 MB took 928 MB).
MAX_MESSAGE_BYTES = DEFAULT_MAX_REQUEST_BODY_SIZE


class McpFace(AskingApprovals):
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
        if held is None and responses and not session.closed:
            # A retry whose call waits no more: another retry with the answer took it (two at
            # once both resumed the run, and the second's resume, left over, resumed the
            # session's next call undecided and answered with its question).
            raise MCPError(
                types.INVALID_REQUEST,
                "no call of this session waits for an answer: another retry answered it, or it "
                "ended; call again without inputResponses",
            )
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
        elif responses and self._client_decides:
            session.paused = None  # taken before anything is awaited: one retry answers it
            try:
                answered = await self._answered(session, held, responses)
            except BaseException:
                session.paused = held  # still held: a retry may answer it yet
                raise
            if answered:
                outcome = await session.resume()
            else:  # an action still waits for its answer: the session asks again
                outcome = held
        else:
            outcome = held
        while isinstance(outcome, Paused):
            # 2026-07-28: the answer comes with the retry
            if not resource and self._client_decides and asks_by_retry(ctx):
                session.paused = outcome
                return input_required(outcome)
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


# Set in an HTTP request's scope when its client disconnects (``http_app``): the SDK goes on
# serving a request whose connection closed, and its queued call kept its arguments.
GONE = "stockade.gone"


def _gone(ctx: ServerRequestContext[Any, Any]) -> Callable[[], Awaitable[object]] | None:
    """What returns once the HTTP request of ``ctx`` went away, if it came over HTTP."""
    request = ctx.request
    scope = getattr(request, "scope", None)
    event = scope.get(GONE) if isinstance(scope, dict) else None
    return event.wait if isinstance(event, anyio.Event) else None


def _version() -> str:
    from stockade import __version__

    return __version__
