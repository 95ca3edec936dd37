"""The MCP protocol shell (``McpFace``) through the official client, in process, over the shipped
fakes: tools and resources listed and read, calls as the agent's steps, approvals asked through
elicitation (a server request on the handshake versions, an InputRequiredResult on 2026-07-28)
or waited for, and a session without one refused over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx2
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.session import ClientRequestContext
from mcp.shared.exceptions import MCPError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stockade.agent import RunLimits
from stockade.assembly import AgentConfig
from stockade.audit import AuditLog, MemoryStore
from stockade.exceptions import ApprovalRequired, InvalidArgument
from stockade.policy import Policy
from stockade.policy.approval import WITHDRAWN, ApprovalRequest, Choice
from stockade.policy.schema import CommandRules, Decisions, ModelRegistry, PathRules, Role, TrustRules
from stockade.sandbox.ops import RunCommand
from stockade.server.mcp_face import McpFace, _answering
from stockade.server.mcp_http import http_app
from stockade.server.mcp_session import MODEL_NAME, McpAgent, McpSession
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.types import CommandResult, Trust

POLICY = Policy(
    trust=TrustRules(level=Trust.TRUSTED),
    paths=PathRules(deny=("secrets/**",)),
    commands=CommandRules(approve=("rm -r",)),
    models=ModelRegistry(approved=(MODEL_NAME,)),
)


def face(
    tmp_path: Path, *, wait_s: float = 5.0, transport: str = "stdio", policy: Policy = POLICY,
    role: str | None = None, rate_per_minute: int | None = None, rate_period_s: float = 60.0,
    limits: RunLimits | None = None,
) -> McpFace:  # fmt: skip
    config = AgentConfig(
        model=MODEL_NAME,
        limits=limits or RunLimits(),
        policy=policy,
        role=role,
        rate_per_minute=rate_per_minute,
        rate_period_s=rate_period_s,
        backend=FakeBackend(MemoryWorkspace(), tier="process"),
        audit=AuditLog(MemoryStore(), flush_interval_s=None),
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
    )
    return McpFace(McpAgent(config), transport=transport, approval_wait_s=wait_s)  # type: ignore[arg-type]


def text(result: types.CallToolResult) -> str:
    block = result.content[0]
    assert isinstance(block, types.TextContent)
    return block.text


def yes_to(word: str) -> object:
    async def answer(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult | types.ErrorData:
        return types.ElicitResult(action="accept", content={"approve": word in params.message})

    return answer


@pytest.mark.parametrize("mode", ["legacy", "auto"])
def test_a_session_through_the_protocol(tmp_path: Path, mode: str) -> None:
    server = face(tmp_path)

    async def session() -> None:
        async with Client(server.server, mode=mode, elicitation_callback=yes_to("keep")) as client:  # type: ignore[arg-type]
            tools = {t.name for t in (await client.list_tools()).tools}
            assert "apply_patch" in tools and "run_tests" in tools
            wrote = await client.call_tool("write_file", {"path": "a.txt", "content": "hi <b>\n"})
            assert not wrote.is_error, text(wrote)
            denied = await client.call_tool("write_file", {"path": "secrets/x", "content": "x"})
            assert denied.is_error and "denied by policy" in text(denied)
            kept = await client.call_tool("run_code", {"code": "rm -r keep", "language": "bash"})
            assert not kept.is_error, text(kept)  # approved through the client
            refused = await client.call_tool("run_code", {"code": "rm -r other", "language": "bash"})
            assert refused.is_error and "a human denied" in text(refused)
            uris = {str(r.uri) for r in (await client.list_resources()).resources}
            assert {"stockade://session", "stockade://session/diff", "stockade://workspace/a.txt"} <= uris
            read = (await client.read_resource("stockade://workspace/a.txt")).contents[0]
            assert isinstance(read, types.TextResourceContents) and read.text == "hi <b>\n"
            diff = (await client.read_resource("stockade://session/diff")).contents[0]
            assert isinstance(diff, types.TextResourceContents) and "+hi <b>" in diff.text
            info = (await client.read_resource("stockade://session")).contents[0]
            assert isinstance(info, types.TextResourceContents)
            assert json.loads(info.text)["status"] == "running"
            with pytest.raises(Exception, match="denied by policy"):
                await client.read_resource("stockade://workspace/secrets/x")
            with pytest.raises(Exception, match="no resource"):
                await client.read_resource("stockade://elsewhere")

    asyncio.run(session())
    server.close()
    ends = [
        e.attributes["status"]
        for e in server.agent.agent.audit_log.store.events()
        if e.kind.value == "run_end"
    ]
    assert ends == ["paused", "paused", "success"]  # each approval paused the run; the session ended it
    decided = [
        (e.attributes["outcome"], e.actor)
        for e in server.agent.agent.audit_log.store.events()
        if e.kind.value == "approval" and e.attributes["outcome"] != "pending"
    ]
    assert [outcome for outcome, _ in decided] == ["approved", "denied"]
    for _, actor in decided:  # who decided is kept: the client (not a person), its name quoted
        assert actor.startswith('mcp-client:"') and actor.endswith('(elicitation: "accept")'), actor


def test_a_role_that_cannot_approve_is_not_asked_through_its_client(tmp_path: Path) -> None:
    """Found from outside: under a role with ``can_approve = false`` the MCP client answered
    the elicitation itself and its ``rm -r src`` ran, recorded as a human's decision. Now such a
    session's client is never asked: the call waits for ``stockade approve`` and, nobody
    deciding, is denied."""
    policy = POLICY.model_copy(update={"roles": {"dev": Role(can_approve=False)}})
    server = face(tmp_path, wait_s=0.3, policy=policy, role="dev")
    asked: list[str] = []

    async def approve_everything(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult | types.ErrorData:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"approve": True})

    async def session(mode: str) -> types.CallToolResult:
        async with Client(server.server, mode=mode, elicitation_callback=approve_everything) as client:
            return await client.call_tool("run_code", {"code": "rm -r src", "language": "bash"})

    for mode in ("legacy", "auto"):  # asked by a server request, or by InputRequiredResult
        refused = asyncio.run(session(mode))
        assert refused.is_error and "denied, as nobody answered within 0.3 s" in text(refused), text(refused)
    server.close()
    assert asked == []
    decided = [
        (e.actor, e.attributes["why"])
        for e in server.agent.agent.audit_log.store.events()
        if e.kind.value == "approval" and e.attributes["outcome"] != "pending"
    ]
    assert decided == [("system:timeout", "system:timeout: nobody answered within 0.3 s")] * 2, decided


async def never_answers(
    context: ClientRequestContext, params: types.ElicitRequestParams
) -> types.ElicitResult | types.ErrorData:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("wait_s", "limits", "within"),
    [(0.5, RunLimits(), "0.5 s"), (300.0, RunLimits(max_wall_s=2.0), "")],
    ids=["approval-wait", "session-wall-time"],
)
def test_an_elicitation_nobody_answers_is_denied_when_the_wait_or_the_session_ends(
    tmp_path: Path, wait_s: float, limits: RunLimits, within: str
) -> None:
    """Found from outside: a client that says it can elicit and never answers held the call
    (with `--approval-wait 5 --max-session-s 15`, no reply after 61 s), and over HTTP its
    sandbox and session slot, for good. The question is waited for no longer than the
    approval wait and the session's wall time left; then it is denied, and the trail says so."""
    server = face(tmp_path, wait_s=wait_s, limits=limits)

    async def session() -> types.CallToolResult:
        with anyio.fail_after(30):
            async with Client(server.server, mode="legacy", elicitation_callback=never_answers) as client:
                return await client.call_tool("run_code", {"code": "rm -r src", "language": "bash"})

    result = asyncio.run(session())
    server.close()
    assert result.is_error and "denied, as the MCP client answered nothing within" in text(result), text(
        result
    )
    deniers = [
        (e.actor, str(e.attributes["why"]))
        for e in server.agent.agent.audit_log.store.events()
        if e.kind.value == "approval" and e.attributes["outcome"] == "denied"
    ]
    # no person decided: the trail's actor is the system's, the reason kept beside it
    [(actor, why)] = deniers
    assert actor == "system:timeout" and "the MCP client answered nothing within " + within in why, deniers


@pytest.mark.parametrize("elicits", [True, False], ids=["elicitation", "stockade-approve"])
def test_a_pause_asks_what_its_call_waits_on_within_one_wait(tmp_path: Path, elicits: bool) -> None:
    """Found from outside: after code whose `rm -r dN` execs were each refused on the spot (and
    left pending), the next call the policy paused asked about every one of them, and waited
    ``--approval-wait`` for each in turn (9 execs: 80 s under 8 s, past ``--max-session-s``).
    Now the execs of earlier calls are not asked (they stay pending), and a pause is waited for
    once: a second question of it, once the wait is over, is denied unasked."""
    holder: list[McpSession] = []

    def run(op: RunCommand) -> CommandResult:
        if b"loop" in (op.stdin or b""):  # as code in a real sandbox starting 3 `rm -r dN`
            [session] = holder
            for n in range(3):
                _ask_about(session, f"exec `rm -r d{n}`")
        return CommandResult(exit_code=0, stdout="looped", stderr="", duration_s=0.0)

    config = AgentConfig(
        model=MODEL_NAME, policy=POLICY, audit=AuditLog(MemoryStore(), flush_interval_s=None),
        backend=FakeBackend(MemoryWorkspace(commands=run), tier="process"),
        approval_dir=tmp_path / "approvals", kill_target=str(tmp_path / "kill"),
    )  # fmt: skip
    server = McpFace(McpAgent(config), transport="stdio", approval_wait_s=0.5)
    asked: list[str] = []

    async def unanswered(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult | types.ErrorData:
        asked.append(params.message)
        return await never_answers(context, params)

    async def session() -> types.CallToolResult:
        with anyio.fail_after(30):
            async with Client(
                server.server, mode="legacy", elicitation_callback=unanswered if elicits else None
            ) as client:
                await client.call_tool("write_file", {"path": "a.txt", "content": "a"})
                held = server.agent.find("stdio")
                assert held is not None
                holder.append(held)
                looped = await client.call_tool("run_code", {"code": "loop", "language": "bash"})
                assert "looped" in text(looped), text(looped)
                _ask_about(held, "exec `rm -r late`")  # comes pending between the calls
                return await client.call_tool("run_code", {"code": "rm -r x", "language": "bash"})

    refused = asyncio.run(session())
    server.close()
    assert refused.is_error and "denied, as " in text(refused) and "answered" in text(refused), text(refused)
    assert len(asked) == (1 if elicits else 0), asked
    store = server.agent.agent.approvals.store
    assert store is not None
    kept = {r["action"]: (r["status"], r.get("by", "")) for r in store.requests(holder[0].run_id)}
    # the earlier call's execs stayed pending until the session's end withdrew them
    stale = {action for action, (status, by) in kept.items() if by == WITHDRAWN}
    assert stale == {"exec `rm -r d0`", "exec `rm -r d1`", "exec `rm -r d2`"}, kept
    denied = {action: by for action, (status, by) in kept.items() if status == "denied" and by != WITHDRAWN}
    assert set(denied) == {"exec `rm -r late`", "run `bash -c 'rm -r x'`"}, kept
    assert sum("had run out" in by for by in denied.values()) == 1, denied  # the second, unasked


def _ask_about(session: McpSession, action: str) -> None:
    """An exec of ``session`` asked about and refused on the spot, as a real sandbox's judge does."""
    request = ApprovalRequest(
        run_id=session.run_id, action=action, rule="rm -r",
        reason="code in the sandbox starts rm, which needs a human's approval",
    )  # fmt: skip
    with contextlib.suppress(ApprovalRequired):
        session.owner.agent.approvals.require(request)


def test_without_elicitation_a_call_waits_for_a_decision_then_is_denied(tmp_path: Path) -> None:
    server = face(tmp_path, wait_s=0.5)

    async def session() -> tuple[types.CallToolResult, types.CallToolResult]:
        async with Client(server.server, mode="legacy") as client:
            refused = await client.call_tool("run_code", {"code": "rm -r a", "language": "bash"})

            async def approve_soon() -> None:
                while True:
                    held = server.agent.find("stdio")
                    assert held is not None
                    store = held.owner.agent.approvals.store
                    assert store is not None
                    for request in store.pending(held.run_id):
                        store.decide(held.run_id, request["id"], Choice.APPROVED, by="test")
                        return
                    await asyncio.sleep(0.02)

            server.approval_wait_s = 30
            helper = asyncio.create_task(approve_soon())
            allowed = await client.call_tool("run_code", {"code": "rm -r b", "language": "bash"})
            await helper
            return refused, allowed

    refused, allowed = asyncio.run(session())
    server.close()
    assert refused.is_error and "denied, as nobody answered within 0.5 s" in text(refused), text(refused)
    assert not allowed.is_error, text(allowed)


def test_a_resource_read_that_needs_approval_is_asked_and_the_server_goes_on(tmp_path: Path) -> None:
    """Found from outside: with reads sent for approval, a resource read raised the guard's
    ApprovalRequired (no Exception) out of its handler, and it ended the SDK's task group: the
    stdio process died, an HTTP server answered every later request 500. A resource read is
    the call of its tool: asked as the tool's call would be, denied here when nobody decides."""
    policy = POLICY.model_copy(update={"decisions": Decisions(approve=("read",))})
    server = face(tmp_path, wait_s=0.3, policy=policy)

    async def session() -> None:
        with anyio.fail_after(60):
            async with Client(server.server, mode="legacy") as client:
                wrote = await client.call_tool("write_file", {"path": "a.txt", "content": "hi\n"})
                assert not wrote.is_error, text(wrote)
                with pytest.raises(MCPError, match="denied, as nobody answered within"):
                    await client.read_resource("stockade://workspace/a.txt")
                with pytest.raises(MCPError, match="denied, as nobody answered within"):
                    await client.list_resources()
                again = await client.call_tool("write_file", {"path": "a.txt", "content": "more\n"})
                assert not again.is_error, text(again)  # the session, and its server, go on

    asyncio.run(session())
    server.close()
    asked = [e for e in server.agent.agent.audit_log.store.events() if e.kind.value == "approval"]
    assert [e.attributes["action"] for e in asked if e.attributes["outcome"] == "denied"] != []


@pytest.mark.parametrize(
    "raised", [ApprovalRequired("asked", request_id="r1"), ValueError("a bug"), InvalidArgument("bad")]
)
async def test_whatever_a_handler_raises_is_its_requests_error(raised: BaseException) -> None:
    """Nothing a handler raises reaches the SDK's task group, a RunStopped (no Exception) least."""

    async def handler(ctx: object, params: object) -> object:
        raise raised

    with pytest.raises(MCPError, match=type(raised).__name__):
        await _answering(handler)(None, None)


def test_resources_are_judged_limited_and_recorded_as_their_tools_calls(tmp_path: Path) -> None:
    """Found from outside: resources were read beside the run: a role without read_file read
    files through them, they cost no rate budget (50 in 0.2 s under 1 a minute) and the audit
    trail had none of them. tools/list showed tools the role may not use."""
    policy = POLICY.model_copy(update={"roles": {"reader": Role(tools=("list_files",)), "writer": Role()}})
    reader = face(tmp_path / "r", policy=policy, role="reader")

    async def as_reader() -> None:
        async with Client(reader.server, mode="legacy") as client:
            assert {t.name for t in (await client.list_tools()).tools} == {"list_files"}
            with pytest.raises(MCPError, match="may not use the tool 'read_file'"):
                await client.read_resource("stockade://workspace/a.txt")
            uris = {str(r.uri) for r in (await client.list_resources()).resources}
            assert "stockade://session/diff" not in uris  # git_diff is not the reader's

    asyncio.run(as_reader())
    reader.close()

    writer = face(tmp_path / "w", policy=policy, role="writer", rate_per_minute=2, rate_period_s=1.0)

    async def as_writer() -> float:
        async with Client(writer.server, mode="legacy") as client:
            wrote = await client.call_tool("write_file", {"path": "a.txt", "content": "hi\n"})
            assert not wrote.is_error, text(wrote)
            started = time.monotonic()
            for _ in range(3):  # 2 a second, the write among them: the window is waited for
                read = (await client.read_resource("stockade://workspace/a.txt")).contents[0]
                assert isinstance(read, types.TextResourceContents) and read.text == "hi\n"
            return time.monotonic() - started

    took = asyncio.run(as_writer())
    writer.close()
    assert took >= 0.5, took
    calls = [
        e.attributes["tool"]
        for e in writer.agent.agent.audit_log.store.events()
        if e.kind.value == "tool_call"
    ]
    assert calls == ["write_file", "read_file", "read_file", "read_file"]


def test_a_call_cancelled_while_it_waits_for_approval_leaves_the_session_going(tmp_path: Path) -> None:
    """Found from outside: a call cancelled by its client while it waited for ``stockade
    approve`` left the run paused with nobody to resume it: the session's next call hung (and,
    over HTTP, in flight for ever, kept the session from being reaped)."""
    server = face(tmp_path, wait_s=30)

    async def session() -> types.CallToolResult:
        async with Client(server.server, mode="legacy") as client:
            with anyio.move_on_after(0.5) as cancelled:
                await client.call_tool("run_code", {"code": "rm -r a", "language": "bash"})
            assert cancelled.cancelled_caught
            with anyio.fail_after(20):
                return await client.call_tool("write_file", {"path": "b.txt", "content": "b"})

    after = asyncio.run(session())
    server.close()
    assert not after.is_error, text(after)
    decided = [
        e.actor
        for e in server.agent.agent.audit_log.store.events()
        if e.kind.value == "approval" and e.attributes["outcome"] == "denied"
    ]
    assert decided and "cancelled" in decided[0], decided


def test_over_http_a_call_needs_a_session(tmp_path: Path) -> None:
    server = face(tmp_path, transport="http")

    async def session() -> None:
        async with Client(server.server, mode="2026-07-28") as client:
            with pytest.raises(Exception, match="sandbox per MCP session"):
                await client.call_tool("list_files", {})

    asyncio.run(session())
    server.close()


async def test_over_http_a_token_is_asked_of_every_request(tmp_path: Path) -> None:
    server = face(tmp_path, transport="http")
    token = "t" * 8 + secrets.token_urlsafe(16)
    with pytest.raises(InvalidArgument, match="at least 16"):
        http_app(server, token="short")
    app = http_app(server, token=token)
    try:
        async with httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=app), base_url="http://127.0.0.1"
        ) as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
                refused = await http.post(
                    "/mcp", headers=headers, json={"jsonrpc": "2.0", "id": 1, "method": "ping"}
                )
                assert refused.status_code == 401, refused.text
                assert refused.headers["www-authenticate"].startswith("Bearer")
            # A header given twice is refused: the SDK reads a header's first copy, and a
            # DELETE naming its own session first and another's last ended the other one.
            bearer = ("Authorization", f"Bearer {token}")
            sessions = [("mcp-session-id", "a" * 32), ("Mcp-Session-Id", "b" * 32)]
            for twice in ([bearer, bearer], [bearer, *sessions]):
                assert (await http.delete("/mcp", headers=twice)).status_code == 400
    finally:
        server.close()


INITIALIZE = {
    "jsonrpc": "2.0", "id": 1, "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {},
               "clientInfo": {"name": "t", "version": "1"}},
}  # fmt: skip


def test_over_http_off_this_machine_sessions_are_bounded_and_web_pages_refused(tmp_path: Path) -> None:
    """Listening beyond this machine (`--host 0.0.0.0`, the SDK's own Host and Origin checks
    off): one token holder opened a session, and so a sandbox, per request with no bound, and a
    page on another site was let in. Served for real (uvicorn: the SDK's session manager runs
    in the app's lifespan), on this machine's address but told it is not."""
    server = face(tmp_path, transport="http")
    token = secrets.token_urlsafe(24)
    app = http_app(
        server, host="0.0.0.0", token=token, max_sessions=2, allowed_origins=("https://ok.example",)
    )
    try:
        with served(app) as port:
            headers = {"Authorization": f"Bearer {token}", "Accept": ACCEPT}
            with httpx2.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=10) as http:
                foreign = http.post("/mcp", json=INITIALIZE, headers={"Origin": "https://evil.example"})
                assert foreign.status_code == 403, foreign.text
                opened = [http.post("/mcp", json=INITIALIZE, headers={"Origin": "https://ok.example"})]
                lower = {"Authorization": f"bearer {token}"}  # the scheme's case is free (RFC 9110)
                opened += [http.post("/mcp", json=INITIALIZE, headers=lower) for _ in range(2)]
                assert [r.status_code for r in opened] == [200, 200, 503], [r.text for r in opened]
                http.delete("/mcp", headers={"mcp-session-id": opened[0].headers["mcp-session-id"]})
                assert http.post("/mcp", json=INITIALIZE).status_code == 200  # room again
    finally:
        server.close()


ACCEPT = "application/json, text/event-stream"


@contextlib.contextmanager
def served(app: ASGIApp) -> Iterator[int]:
    """``app`` served for real on this machine (uvicorn: the SDK's session manager runs in the
    app's lifespan); its port."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


def _answer(response: httpx2.Response) -> dict[str, object]:
    """The JSON-RPC answer of a POST, sent as JSON or as one server-sent event."""
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        [data] = [line[5:] for line in response.text.splitlines() if line.startswith("data:")]
        return json.loads(data)  # type: ignore[no-any-return]
    return response.json()  # type: ignore[no-any-return]


def _open_session(http: httpx2.Client) -> str:
    """Initialize an MCP session over ``http``, whose headers then name it; its id."""
    opened = http.post("/mcp", json=INITIALIZE)
    sid = str(opened.headers["mcp-session-id"])
    version = str(_answer(opened)["result"]["protocolVersion"])  # type: ignore[index]
    http.headers.update({"mcp-session-id": sid, "mcp-protocol-version": version})
    http.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"})
    return sid


def test_over_http_only_a_delete_the_sdk_carried_out_ends_the_session(tmp_path: Path) -> None:
    """Every DELETE ended the session's run, even one refused (a wrong Host, Origin or path):
    the SDK kept the session open, and the client's next call got a new sandbox and run."""
    server = face(tmp_path, transport="http")
    try:
        with served(http_app(server)) as port:
            url = f"http://127.0.0.1:{port}"
            with httpx2.Client(base_url=url, headers={"Accept": ACCEPT}, timeout=10) as http:
                sid = _open_session(http)
                call = {"name": "write_file", "arguments": {"path": "victim.txt", "content": "x"}}
                wrote = _answer(
                    http.post(
                        "/mcp", json={"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": call}
                    )
                )
                assert wrote["result"]["isError"] is False, wrote  # type: ignore[index]
                session = server.agent.find(sid)
                assert session is not None
                refused = [
                    http.delete("/mcp", headers={"Host": f"evil.example:{port}"}),
                    http.delete("/mcp", headers={"Origin": "http://evil.example"}),
                    http.delete("/elsewhere"),
                    http.delete("/mcp/"),  # the SDK's route redirects it
                ]
                assert [r.status_code for r in refused] == [421, 403, 404, 307], [r.text for r in refused]
                assert server.agent.find(sid) is session and not session.closed
                assert http.delete("/mcp").status_code == 200
                deadline = time.monotonic() + 10  # the run ends once the answer is sent
                while not session.closed and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert server.agent.find(sid) is None and session.closed
    finally:
        server.close()


def test_over_http_on_this_machine_host_and_origin_are_matched_whole(tmp_path: Path) -> None:
    """The SDK matches Host and Origin by prefix (``127.0.0.1:*``): ``127.0.0.1:80@evil.example``
    passed. Here they are this server's, its port included, or an origin the user allowed."""
    server = face(tmp_path, transport="http")
    try:
        with served(http_app(server, allowed_origins=("https://ok.example",))) as port:
            url = f"http://127.0.0.1:{port}"
            with httpx2.Client(base_url=url, headers={"Accept": ACCEPT}, timeout=10) as http:

                def status(name: str, value: str) -> int:
                    return http.post("/mcp", json=INITIALIZE, headers={name: value}).status_code

                for host in ("127.0.0.1:80@evil.example", f"127.0.0.1:{port}.evil.example",
                             f"localhost:{port + 1}", "evil.example", "localhost"):  # fmt: skip
                    assert status("Host", host) == 421, host
                for origin in ("http://127.0.0.1:1@evil.example", f"http://127.0.0.1:{port}.evil.example",
                               f"http://localhost:{port + 1}", f"https://localhost:{port}",
                               "null"):  # fmt: skip
                    assert status("Origin", origin) == 403, origin
                for host in (f"127.0.0.1:{port}", f"[::1]:{port}"):
                    assert status("Host", host) == 200, host
                for origin in (f"http://localhost:{port}", f"http://[::1]:{port}", "https://ok.example"):
                    assert status("Origin", origin) == 200, origin
    finally:
        server.close()


def test_over_http_a_2026_request_reaches_no_session_by_naming_one(tmp_path: Path) -> None:
    """A 2026-07-28 request has no session, and the SDK reads no session header of its: a
    client that named its own ids opened a sandbox per id past --max-sessions, and one that
    named another session's id read that session's files (found from outside)."""
    server = face(tmp_path, transport="http")
    try:
        with served(http_app(server, max_sessions=1)) as port:
            url = f"http://127.0.0.1:{port}"
            with httpx2.Client(base_url=url, headers={"Accept": ACCEPT}, timeout=10) as http:
                opened = http.post("/mcp", json=INITIALIZE)
                sid = opened.headers["mcp-session-id"]
                version = str(_answer(opened)["result"]["protocolVersion"])  # type: ignore[index]
                own = {"mcp-session-id": sid, "mcp-protocol-version": version}
                http.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=own)
                call = {"name": "write_file", "arguments": {"path": "victim.txt", "content": "victim data"}}
                body = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": call}
                wrote = http.post("/mcp", json=body, headers=own)
                assert _answer(wrote)["result"]["isError"] is False  # type: ignore[index]
                meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                        "io.modelcontextprotocol/clientCapabilities": {}}  # fmt: skip
                for named in (sid, "fake1", "fake2"):
                    headers = {"mcp-session-id": named, "mcp-protocol-version": "2026-07-28",
                               "mcp-method": "tools/call", "mcp-name": "read_file"}  # fmt: skip
                    params = {"name": "read_file", "arguments": {"path": "victim.txt"}, "_meta": meta}
                    body = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": params}
                    answer = http.post("/mcp", headers=headers, json=body)
                    assert "victim data" not in answer.text and "sandbox per MCP session" in answer.text, (
                        answer.text
                    )
                assert server.agent.find("fake1") is None and server.agent.find("fake2") is None
    finally:
        server.close()


def test_a_resource_read_serves_at_most_a_mebibyte_of_a_file(tmp_path: Path) -> None:
    """A resource read made the whole file (up to 256 MiB) one JSON message, and the server
    held ~13 times the file while it made it (found from outside: 1.6 GB for 128 MiB)."""
    workspace = MemoryWorkspace(files={"big.txt": b"x" * (3 << 20)})  # as code in the sandbox made it
    config = AgentConfig(
        model=MODEL_NAME, policy=POLICY, backend=FakeBackend(workspace, tier="process"),
        audit=AuditLog(MemoryStore(), flush_interval_s=None), approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
    )  # fmt: skip
    server = McpFace(McpAgent(config), transport="stdio")

    async def session() -> None:
        async with Client(server.server) as client:
            read = (await client.read_resource("stockade://workspace/big.txt")).contents[0]
            assert isinstance(read, types.TextResourceContents)
            shown, cut = read.text[: 1 << 20], read.text[1 << 20 :]
            assert shown == "x" * (1 << 20) and cut.startswith("\n[cut at 1,048,576 bytes: read_file reads")

    asyncio.run(session())
    server.close()


def test_a_file_name_with_a_line_break_is_one_resource(tmp_path: Path) -> None:
    """Found from outside: the listing was passed one name a line, so a file named
    ``a\\nb.txt`` (or with ``\\r``, ``\\x0b``, ``\\u2028``) was listed as resources that do not
    exist. Each name is now one resource, as it is."""
    server = face(tmp_path)
    names = ["a\nb.txt", "c\rd.txt", "e\x0bf.txt", "g\u2028h.txt"]

    async def session() -> set[str]:
        async with Client(server.server, mode="legacy") as client:
            for name in names:
                wrote = await client.call_tool("write_file", {"path": name, "content": "x"})
                assert not wrote.is_error, text(wrote)
            return {str(r.uri) for r in (await client.list_resources()).resources}

    uris = asyncio.run(session())
    server.close()
    files = {u.removeprefix("stockade://workspace/") for u in uris if u.startswith("stockade://workspace/")}
    assert {urllib.parse.unquote(f) for f in files} == set(names)


def _held_commands(tmp_path: Path, release: threading.Event) -> AgentConfig:
    """An agent's configuration whose every command waits for ``release`` (at most 30 s)."""

    def slow(op: object) -> CommandResult:
        release.wait(30)
        return CommandResult(exit_code=0, stdout="", stderr="", duration_s=0.0)

    return AgentConfig(
        model=MODEL_NAME, policy=POLICY, backend=FakeBackend(MemoryWorkspace(commands=slow), tier="process"),
        audit=AuditLog(MemoryStore(), flush_interval_s=None),
        approval_dir=tmp_path / "approvals", kill_target=str(tmp_path / "kill"),
    )  # fmt: skip


def test_over_http_a_queued_call_whose_request_went_away_is_dropped(tmp_path: Path) -> None:
    """Found from outside: behind a slow run_code, write_files of ~4 MB whose connections the
    client closed stayed queued with their arguments (300 held 2.4 GB). Now a queued call whose
    HTTP request went away is dropped, and never runs."""
    release = threading.Event()
    config = _held_commands(tmp_path, release)
    server = McpFace(McpAgent(config), transport="http", approval_wait_s=5)

    def call(id_: int, name: str, args: dict[str, object]) -> dict[str, object]:
        return {
            "jsonrpc": "2.0",
            "id": id_,
            "method": "tools/call",
            "params": {"name": name, "arguments": args},
        }

    try:
        with served(http_app(server)) as port:
            url = f"http://127.0.0.1:{port}"
            with httpx2.Client(base_url=url, headers={"Accept": ACCEPT}, timeout=10) as http:
                sid = _open_session(http)
                headers = dict(http.headers)

            async def abandon() -> McpSession:
                async with httpx2.AsyncClient(base_url=url, headers=headers, timeout=10) as client:
                    slow_call = asyncio.ensure_future(
                        client.post(
                            "/mcp", json=call(2, "run_code", {"code": "sleep 120", "language": "bash"})
                        )
                    )
                    while (session := server.agent.find(sid)) is None or session._current is None:
                        await asyncio.sleep(0.01)
                    async with client.stream(
                        "POST",
                        "/mcp",
                        json=call(3, "write_file", {"path": "late.txt", "content": "x" * 100_000}),
                    ):
                        while session._queued == 0:  # taken in: then its connection closes
                            await asyncio.sleep(0.01)
                    deadline = time.monotonic() + 10
                    while session._queued and time.monotonic() < deadline:
                        await asyncio.sleep(0.01)
                    assert session._queued == 0 and server.agent._queued_bytes == 0
                    release.set()
                    assert not _answer(await slow_call)["result"]["isError"]  # type: ignore[index]
                    return session

            session = asyncio.run(abandon())
        store = server.agent.agent.audit_log.store
        calls = [
            e.attributes.get("tool")
            for e in store.events(run_id=session.run_id)
            if e.kind.value == "tool_call"
        ]
        assert "write_file" not in calls, calls  # the dropped call never ran
    finally:
        release.set()
        server.close()


def test_over_http_a_session_the_sdk_let_go_holds_its_slot_until_its_run_ends(tmp_path: Path) -> None:
    """Found from outside: a client that dropped its connection mid-call (`sleep 200`) had its
    session ended by the SDK after the idle timeout, its ``--max-sessions`` slot freed, while the
    session's run and sandbox lived another idle timeout: a new session came in beside it (two
    sandboxes under ``--max-sessions 1``). Now the run ends with the SDK's session, and until it
    has, a new session is refused as one too many."""
    release = threading.Event()
    config = _held_commands(tmp_path, release)
    # An idle time the steps between opening the session and posting its call keep within on
    # a loaded machine (the session would end first, and the call find nothing to run in).
    server = McpFace(McpAgent(config), transport="http", approval_wait_s=5, idle_timeout_s=2.0)
    sleep = {
        "jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "run_code", "arguments": {"code": "sleep 200", "language": "bash"}},
    }  # fmt: skip
    try:
        with served(http_app(server, max_sessions=1)) as port:
            url = f"http://127.0.0.1:{port}"
            with httpx2.Client(base_url=url, headers={"Accept": ACCEPT}, timeout=10) as http:
                sid = _open_session(http)
                headers = dict(http.headers)

            async def drop() -> McpSession:
                async with (
                    httpx2.AsyncClient(base_url=url, headers=headers, timeout=10) as client,
                    client.stream("POST", "/mcp", json=sleep) as answer,  # closed mid-call
                ):
                    assert answer.status_code == 200, answer.status_code
                    started = time.monotonic() + 20
                    while (session := server.agent.find(sid)) is None or session._current is None:
                        assert time.monotonic() < started, "the call never started"
                        await asyncio.sleep(0.01)
                return session

            dropped = asyncio.run(drop())
            with httpx2.Client(base_url=url, headers={"Accept": ACCEPT}, timeout=10) as http:
                deadline = time.monotonic() + 20  # the SDK lets the session go once it is idle
                while server.agent.find(sid) is not None:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                assert dropped.running  # its command holds the sandbox (until released)
                assert http.post("/mcp", json=INITIALIZE).status_code == 503
                release.set()
                while dropped.running:  # its run was ended: once the command returns, it is over
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                assert http.post("/mcp", json=INITIALIZE).status_code == 200
    finally:
        release.set()
        server.close()


async def test_over_http_the_bodies_held_at_once_are_bounded_and_one_more_is_told_to_retry() -> None:
    """Each body was capped (4 MiB), not how many were held at once: on its 1,000 connections a
    client had 4 GB held. A body counts its bytes as they come and, once whole, what it takes
    parsed (``message_cost``: its bytes, and 128 a value). One more than the server's budget
    is answered 503 with Retry-After, before more of it is read; once a request is answered
    its bytes are free again."""
    from stockade.server.mcp_cost import MAX_MESSAGE_COST
    from stockade.server.mcp_face import MAX_MESSAGE_BYTES
    from stockade.server.mcp_http import MAX_BODIES_BYTES, _bodies_within

    # the largest body, and what it takes parsed at most, fit the budget alone (never a 503 for ever)
    assert MAX_MESSAGE_BYTES + MAX_MESSAGE_COST <= MAX_BODIES_BYTES

    answered = anyio.Event()
    bodies: list[bytes] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while (message := await receive())["more_body"]:
            body += message["body"]
        bodies.append(body + message["body"])
        await answered.wait()  # held until answered
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app = _bodies_within(inner, limit=2000)

    async def post(pieces: int) -> tuple[int, dict[bytes, bytes], int]:
        """A body of ``pieces`` pieces of 200 bytes: its status, its headers, the pieces read."""
        sent = [
            {"type": "http.request", "body": b"x" * 200, "more_body": i < pieces - 1} for i in range(pieces)
        ]
        read = 0
        said: list[Message] = []

        async def receive() -> Message:
            nonlocal read
            read += 1
            return sent[read - 1]

        async def send(message: Message) -> None:
            said.append(message)

        await app({"type": "http", "method": "POST", "path": "/mcp", "headers": []}, receive, send)
        return said[0]["status"], dict(said[0]["headers"]), read

    async with anyio.create_task_group() as group:
        group.start_soon(post, 3)  # 600 bytes and 728 parsed, held until answered
        await anyio.wait_all_tasks_blocked()
        status, headers, read = await post(3)
        assert (status, headers[b"retry-after"], read) == (503, b"1", 3)  # its third piece was one too many
        answered.set()
    assert await post(4) == (200, {}, 4)  # 800 and 928: the budget is free again
    assert bodies == [b"x" * 600, b"x" * 800]


def test_a_call_cancelled_after_its_approval_is_cut(tmp_path: Path) -> None:
    """Found from outside: a call cancelled once its approval was given (the run resumed, its
    command running) was not cut: it ran to its end, the trail recorded its success, and the
    session's next call waited for it. It is cut now as any running call is, and recorded as
    cancelled by its client."""
    started, released = threading.Event(), threading.Event()

    def slow(op: RunCommand) -> CommandResult:
        started.set()
        released.wait(30)  # until the test saw the cut (a real sandbox's command ends then)
        return CommandResult(exit_code=0, stdout="after the cut", stderr="", duration_s=0.0)

    backend = FakeBackend(MemoryWorkspace(commands=slow), tier="process")
    config = AgentConfig(
        model=MODEL_NAME, policy=POLICY, audit=AuditLog(MemoryStore(), flush_interval_s=None),
        backend=backend, approval_dir=tmp_path / "approvals", kill_target=str(tmp_path / "kill"),
    )  # fmt: skip
    server = McpFace(McpAgent(config), transport="stdio", approval_wait_s=30)

    async def approves(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult | types.ErrorData:
        return types.ElicitResult(action="accept", content={"approve": True})

    async def session() -> types.CallToolResult:
        with anyio.fail_after(60):
            async with Client(server.server, mode="legacy", elicitation_callback=approves) as client:
                async with anyio.create_task_group() as group:

                    async def call() -> None:
                        await client.call_tool("run_code", {"code": "rm -r d; sleep 6", "language": "bash"})

                    group.start_soon(call)
                    await anyio.to_thread.run_sync(started.wait)  # approved, resumed, running
                    group.cancel_scope.cancel()
                try:
                    while not any(instance.cuts for instance in backend.instances):
                        await anyio.sleep(0.02)
                finally:
                    released.set()
                return await client.call_tool("write_file", {"path": "b.txt", "content": "b"})

    after = asyncio.run(session())
    server.close()
    assert not after.is_error, text(after)
    calls = [
        (e.attributes["tool"], e.attributes.get("error_type"))
        for e in server.agent.agent.audit_log.store.events()
        if e.kind.value == "tool_call"
    ]
    assert calls == [("run_code", "CallCancelled"), ("write_file", None)], calls


def test_two_retries_with_one_answer_resume_the_call_once(tmp_path: Path) -> None:
    """Found from outside (2026-07-28): two retries of a held call, sent at once with its
    answer, both resumed the run; the second's resume, left over, resumed the session's next
    call with its approval undecided and was answered with that call's question. One retry
    takes the held call now; the other is refused."""
    server = face(tmp_path)
    held = {"code": "rm -r a", "language": "bash"}

    async def session() -> tuple[list[types.CallToolResult | BaseException], types.InputRequiredResult]:
        with anyio.fail_after(60):
            # it can ask its user (the answers are given by hand, below)
            async with Client(server.server, mode="auto", elicitation_callback=never_answers) as client:
                asked = await client.session.call_tool("run_code", held, allow_input_required=True)
                assert isinstance(asked, types.InputRequiredResult) and asked.input_requests, asked
                answer: types.InputResponses = {
                    key: types.ElicitResult(action="accept", content={"approve": True})
                    for key in asked.input_requests
                }

                async def retry() -> types.CallToolResult:
                    retried = await client.session.call_tool(
                        "run_code", held, input_responses=answer, request_state=asked.request_state,
                        allow_input_required=True,
                    )  # fmt: skip
                    assert isinstance(retried, types.CallToolResult), retried
                    return retried

                retries = await asyncio.gather(retry(), retry(), return_exceptions=True)
                other = {"code": "rm -r b", "language": "bash"}
                next_asked = await client.session.call_tool("run_code", other, allow_input_required=True)
                assert isinstance(next_asked, types.InputRequiredResult), next_asked
                return list(retries), next_asked

    retries, next_asked = asyncio.run(session())
    server.close()
    ran = [r for r in retries if isinstance(r, types.CallToolResult)]
    refused = [r for r in retries if isinstance(r, MCPError)]
    assert len(ran) == 1 and not ran[0].is_error, retries
    assert len(refused) == 1 and "no call of this session waits for an answer" in str(refused[0]), retries
    [question] = (next_asked.input_requests or {}).values()
    assert isinstance(question, types.ElicitRequest) and "rm -r b" in question.params.message
    starts = [
        e.attributes["tool"]
        for e in server.agent.agent.audit_log.store.events()
        if e.kind.value == "tool_call"
    ]
    assert starts == ["run_code"], starts  # the held call ran once; the next one waits


def test_an_accept_that_is_no_decision_is_denied_and_said_so(tmp_path: Path) -> None:
    """Found from outside: an elicitation answered "accept" with ``{"approve": "true"}`` (no
    boolean) was denied, rightly, but the model was told "a human denied" while the trail named
    the client's "accept". Both say now that the answer was not a decision."""
    server = face(tmp_path)

    async def malformed(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult | types.ErrorData:
        return types.ElicitResult(action="accept", content={"approve": "true"})

    async def session() -> types.CallToolResult:
        with anyio.fail_after(60):
            async with Client(server.server, mode="legacy", elicitation_callback=malformed) as client:
                return await client.call_tool("run_code", {"code": "rm -r a", "language": "bash"})

    refused = asyncio.run(session())
    server.close()
    assert refused.is_error and "denied, as the MCP client's answer was not a decision" in text(refused)
    assert "a human denied" not in text(refused), text(refused)
    [actor] = [
        e.actor
        for e in server.agent.agent.audit_log.store.events()
        if e.kind.value == "approval" and e.attributes["outcome"] == "denied"
    ]
    assert actor.startswith('mcp-client:"') and actor.endswith('(elicitation: "accept", not a decision)'), (
        actor
    )
