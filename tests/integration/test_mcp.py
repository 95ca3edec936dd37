"""``stockade mcp`` through the official MCP Python client, over stdio and streamable HTTP: a
session writes a file, runs the tests, is denied something, has an action approved (through
the client's elicitation, or ``stockade approve`` while the call waits), and ends with its
sandbox gone and its audit chain verified."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import mcp_types as types
import pytest
from mcp import Client, StdioServerParameters
from mcp.client._transport import TransportStreams
from mcp.client.session import ClientRequestContext
from mcp.client.streamable_http import streamable_http_client

from stockade.audit.events import EventKind
from stockade.audit.stores import open_store
from stockade.audit.verify import verify
from stockade.policy.approval import ApprovalStore
from stockade.runs.store import RunSummary, open_run_store
from stockade.server.mcp_cost import MAX_MESSAGE_COST, message_cost
from stockade.server.mcp_face import MAX_MESSAGE_BYTES
from stockade.server.mcp_http import MAX_BODIES_BYTES
from stockade.server.mcp_stdio import MAX_HELD_BYTES, MAX_HELD_REQUESTS
from tests.conftest import require_tier, wait_for
from tests.integration.service_env import REPO, Process, free_port

pytestmark = [pytest.mark.process]

POLICY = """\
version = 1
[trust]
level = "trusted"
[models]
approved = ["mcp"]
[commands]
approve = ["rm -r"]
[paths]
deny = ["secrets/**"]
"""
TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    require_tier("process")
    (tmp_path / "policy.toml").write_text(POLICY)
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    return tmp_path


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}


def _args(project: Path, *extra: str) -> list[str]:
    return [
        "mcp", "--policy", str(project / "policy.toml"), "--workspace", str(project / "ws"),
        "--audit-db", f"sqlite:///{project / 'audit.db'}", *extra,
    ]  # fmt: skip


def _text(result: types.CallToolResult) -> str:
    block = result.content[0]
    assert isinstance(block, types.TextContent)
    return block.text


async def _session_info(client: Client) -> dict[str, Any]:
    read = await client.read_resource("stockade://session")
    block = read.contents[0]
    assert isinstance(block, types.TextResourceContents)
    info: dict[str, Any] = json.loads(block.text)
    return info


async def _work(client: Client) -> str:
    """What both transports do: write, test, be denied; the session's run id."""
    names = {t.name for t in (await client.list_tools()).tools}
    assert names == {
        "run_code",
        "run_tests",
        "read_file",
        "write_file",
        "apply_patch",
        "list_files",
        "git_diff",
    }
    wrote = await client.call_tool("write_file", {"path": "test_calc.py", "content": TEST})
    assert not wrote.is_error, _text(wrote)
    tested = await client.call_tool("run_tests", {"command": "python3 -m pytest -q"})
    assert not tested.is_error and "1 passed" in _text(tested), _text(tested)
    denied = await client.call_tool("write_file", {"path": "secrets/token", "content": "x"})
    assert denied.is_error and "denied by policy" in _text(denied) and "paths" in _text(denied)
    resources = {str(r.uri) for r in (await client.list_resources()).resources}
    assert {"stockade://workspace/test_calc.py", "stockade://session/diff"} <= resources
    diff = (await client.read_resource("stockade://session/diff")).contents[0]
    assert isinstance(diff, types.TextResourceContents) and "+++ b/test_calc.py" in diff.text
    info = await _session_info(client)
    assert info["tier"] == "process" and info["status"] == "running"
    return str(info["run_id"])


def _ended_and_verified(project: Path, run_id: str) -> None:
    """The session's run ended, its sandbox was stopped, and the chain verifies with the ledger."""
    url = f"sqlite:///{project / 'audit.db'}"
    with open_run_store(url) as runs:

        def ended() -> RunSummary | None:
            summary = runs.summary(run_id)
            return summary if summary is not None and summary.status.finished else None

        summary = wait_for(ended, what="the run to end")
        assert summary is not None and summary.status.value == "success", summary
        calls = [c.call.name for c in runs.tool_calls(run_id)]
        assert calls[:2] == ["write_file", "run_tests"], calls
        with open_store(url) as store:

            def stopped() -> list[EventKind]:  # the sandbox is removed after the run's end is recorded
                kinds = [e.kind for e in store.events(run_id=run_id)]
                return kinds if EventKind.SANDBOX_STOP in kinds else []

            kinds = wait_for(stopped, what="the session's sandbox to stop")
            assert EventKind.SANDBOX_START in kinds
            assert EventKind.POLICY_DECISION in kinds and EventKind.APPROVAL in kinds
            report = verify(store, run_id=run_id, ledger=runs)
    assert report.ok and report.found, report.problems


# -- stdio --------------------------------------------------------------------------------------


async def _approve_when_asked(approvals: Path, project: Path) -> str:
    """What a person does: sees the pending action, runs `stockade approve RUN REQUEST`."""
    while True:
        pending = ApprovalStore(approvals).pending()
        if pending:
            request = pending[0]
            done = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "stockade.cli.main", "approve", request["run_id"], request["id"]],
                env=_env(), capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            return request["action"]
        await asyncio.sleep(0.1)


def test_a_stdio_session_waits_for_stockade_approve(project: Path) -> None:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "stockade.cli.main", *_args(project)],
        env=_env(),
        cwd=str(project),
    )

    async def session() -> str:
        async with Client(params, read_timeout_seconds=120) as client:  # no elicitation: it waits
            run_id = await _work(client)
            approver = asyncio.create_task(
                _approve_when_asked(Path(os.environ["STOCKADE_APPROVAL_DIR"]), project)
            )
            ran = await client.call_tool(
                "run_code", {"code": "mkdir -p build && rm -r build && echo removed", "language": "bash"}
            )
            assert "rm -r build" in await asyncio.wait_for(approver, 5)
            assert not ran.is_error and "removed" in _text(ran), _text(ran)
            return run_id

    run_id = asyncio.run(session())
    _ended_and_verified(project, run_id)


def test_a_stdio_session_of_the_2026_protocol_asks_with_its_result(project: Path) -> None:
    """No server-to-client request exists on 2026-07-28: the question is an InputRequiredResult,
    the answer comes with the client's retry of the call (the SDK's client does it)."""
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "stockade.cli.main", *_args(project)],
        env=_env(),
        cwd=str(project),
    )
    asked: list[str] = []

    async def answer(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult | types.ErrorData:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"approve": "keep" not in params.message})

    async def session() -> tuple[str, types.CallToolResult, types.CallToolResult]:
        async with Client(params, elicitation_callback=answer, read_timeout_seconds=120) as client:
            assert client.session.protocol_version == "2026-07-28"
            ran = await client.call_tool(
                "run_code", {"code": "mkdir t && rm -r t && echo yes", "language": "bash"}
            )
            kept = await client.call_tool(
                "run_code", {"code": "mkdir keep && rm -r keep", "language": "bash"}
            )
            return str((await _session_info(client))["run_id"]), ran, kept

    run_id, ran, kept = asyncio.run(session())
    assert not ran.is_error and "yes" in _text(ran), _text(ran)
    assert kept.is_error and "a human denied" in _text(kept), _text(kept)
    assert len(asked) == 2 and "rm -r t" in asked[0]
    with open_store(f"sqlite:///{project / 'audit.db'}") as store:
        outcomes = [
            e.attributes.get("outcome") for e in store.events(run_id=run_id) if e.kind == EventKind.APPROVAL
        ]
    assert outcomes == ["pending", "approved", "pending", "denied"], outcomes


def test_a_stdio_call_nobody_approves_is_denied(project: Path) -> None:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "stockade.cli.main", *_args(project, "--approval-wait", "1")],
        env=_env(),
        cwd=str(project),
    )

    async def session() -> types.CallToolResult:
        async with Client(params, read_timeout_seconds=120) as client:
            return await client.call_tool("run_code", {"code": "rm -r nothing-here", "language": "bash"})

    refused = asyncio.run(session())
    assert refused.is_error and "denied, as nobody answered within 1 s" in _text(refused), _text(refused)


class _Wire:
    """A stdio MCP client speaking JSON-RPC by hand: what the SDK's client does not send
    (``notifications/cancelled`` of a call, a call while another waits for its approval)."""

    def __init__(self, project: Path, *extra: str) -> None:
        self.stderr = project / "mcp.stderr"
        with self.stderr.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "stockade.cli.main", *_args(project, *extra)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=_env(), cwd=str(project),
            )  # fmt: skip
        self.answers: dict[int, dict[str, Any]] = {}
        self.questions: list[dict[str, Any]] = []  # the server's requests, as they came

    def hello(self, capabilities: dict[str, Any] | None = None) -> None:
        """The handshake of a 2025-11-25 client."""
        info = {
            "protocolVersion": "2025-11-25",
            "capabilities": capabilities or {},
            "clientInfo": {"name": "t", "version": "0"},
        }
        self.send({"id": 0, "method": "initialize", "params": info})
        self.answer(0)
        self.send({"method": "notifications/initialized"})

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n")
        self.proc.stdin.flush()

    def call(self, rid: int, name: str, args: dict[str, Any], **params: Any) -> None:
        self.send({"id": rid, "method": "tools/call", "params": {"name": name, "arguments": args, **params}})

    def answer(self, rid: int) -> dict[str, Any]:
        """The answer to request ``rid`` (the next lines read until it comes)."""
        assert self.proc.stdout is not None
        while rid not in self.answers:
            line = self.proc.stdout.readline()
            assert line, f"the server ended before answering {rid}"
            message = json.loads(line)
            if "id" in message and ("result" in message or "error" in message):
                self.answers[message["id"]] = message
            elif "id" in message and "method" in message:
                self.questions.append(message)
        return self.answers.pop(rid)

    def question(self) -> dict[str, Any]:
        """The server's next request (the lines read until it comes, answers kept)."""
        assert self.proc.stdout is not None
        while not self.questions:
            line = self.proc.stdout.readline()
            assert line, "the server ended before asking"
            message = json.loads(line)
            if "id" in message and "method" in message:
                self.questions.append(message)
            elif "id" in message:
                self.answers[message["id"]] = message
        return self.questions.pop(0)

    def unread(self, *, pipes: int = 4096) -> None:
        """Be a client that does not read its answers: the pipes shrunk to ``pipes`` bytes, so
        that what the server read of stdin shows in what stdin takes."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        for pipe in (self.proc.stdin, self.proc.stdout):
            fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, pipes)

    def send_unread(self, lines: list[bytes]) -> int:
        """Send ``lines`` while the server reads them: how many it took whole before stdin stayed
        full (``STALL_S`` without room); the rest of the line it took in part is sent once it
        reads again (the client reading its answers)."""
        assert self.proc.stdin is not None
        fd = self.proc.stdin.fileno()
        left = b""
        os.set_blocking(fd, False)
        try:
            for taken, line in enumerate(lines):
                left = line
                while left:
                    if not select.select([], [fd], [], STALL_S)[1]:
                        return taken
                    with contextlib.suppress(BlockingIOError):
                        left = left[os.write(fd, left) :]
            return len(lines)
        finally:
            os.set_blocking(fd, True)
            if left:
                threading.Thread(target=_write_all, args=(fd, left), daemon=True).start()

    def text(self, rid: int) -> tuple[bool, str]:
        result = self.answer(rid)["result"]
        return bool(result.get("isError")), str(result["content"][0]["text"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            assert self.proc.stdout is not None
            self.proc.stdout.close()


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _run_id(wire: _Wire, rid: int) -> str:
    wire.send({"id": rid, "method": "resources/read", "params": {"uri": "stockade://session"}})
    return str(json.loads(wire.answer(rid)["result"]["contents"][0]["text"])["run_id"])


TICKS = "import time\nfor i in range(40):\n    open('ticks.txt', 'a').write('.')\n    time.sleep(0.25)\n"


def test_a_cancelled_call_never_runs_queued_and_is_cut_running(project: Path) -> None:
    """``notifications/cancelled``: a call still queued behind another never runs; a running
    one has its sandbox work cut, the session's next call is served at once, and the trail
    says the client cancelled it (it ran to its end, and the trail said success)."""
    wire = _Wire(project)
    try:
        wire.hello()
        wire.call(1, "run_code", {"code": "import time; time.sleep(2); print('first')", "language": "python"})
        time.sleep(0.5)
        wire.call(2, "write_file", {"path": "cancelled.txt", "content": "ran\n"})
        time.sleep(0.3)
        wire.send({"method": "notifications/cancelled", "params": {"requestId": 2, "reason": "user"}})
        assert wire.text(1) == (False, "stdout:\nfirst\n")
        wire.call(3, "run_code", {"code": TICKS, "language": "python"})  # 10 s of ticks
        time.sleep(1.5)
        wire.send({"method": "notifications/cancelled", "params": {"requestId": 3}})
        started = time.monotonic()
        wire.call(4, "read_file", {"path": "ticks.txt"})
        error, seen = wire.text(4)
        assert not error and time.monotonic() - started < 5, seen
        time.sleep(1.5)  # a tick every 0.25 s, had it gone on
        wire.call(5, "read_file", {"path": "ticks.txt"})
        assert wire.text(5) == (False, seen)
        wire.call(6, "read_file", {"path": "cancelled.txt"})
        error, said = wire.text(6)
        assert error and "No such file" in said, said
        run_id = _run_id(wire, 7)
        assert 2 not in wire.answers and 3 not in wire.answers  # a cancelled request is not answered
    finally:
        wire.close()
    with open_run_store(f"sqlite:///{project / 'audit.db'}") as runs:
        calls = [(c.call.name, c.error_type) for c in runs.tool_calls(run_id)]
    assert not any(name == "write_file" for name, _ in calls), calls  # nothing recorded as run
    assert ("run_code", "CallCancelled") in calls, calls


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_a_stdio_session_whose_client_keeps_stdin_open(project: Path, signum: int) -> None:
    """A supervisor's SIGTERM (or Ctrl-C) was ignored while the client kept stdin open: the read
    of stdin could not be cancelled, so the server lived on (a minute with a call running) and,
    once stdin closed, exited 0. It stops at once now: the run ends, the sandbox is removed,
    and the exit code is the signal's, as a shell reports it (128 + its number)."""
    wire = _Wire(project)
    try:
        wire.hello()
        run_id = _run_id(wire, 1)
        wire.call(2, "run_code", {"code": "import time; time.sleep(120)", "language": "python"})
        time.sleep(1)  # the call is running (or about to): either way the signal must end it
        wire.proc.send_signal(signum)
        assert wire.proc.wait(60) == 128 + signum  # stdin is still open
    finally:
        wire.close()
    said = wire.stderr.read_text()
    assert f"stopped by {signal.Signals(signum).name}" in said and "Traceback" not in said, said
    with open_store(f"sqlite:///{project / 'audit.db'}") as store:
        assert EventKind.SANDBOX_STOP in [e.kind for e in store.events(run_id=run_id)]


def test_a_client_gone_mid_call_ends_the_stdio_session_in_one_line(project: Path) -> None:
    """A client that dies with a call running closes the server's stdout: the answer's write
    failed with a BrokenPipeError traceback (an exception group), or the server waited on an
    open stdin. The session ends, said in one line, exit 0: a client leaving is no failure."""
    wire = _Wire(project)
    try:
        wire.hello()
        wire.call(1, "run_code", {"code": "import time; time.sleep(1)", "language": "python"})
        assert wire.proc.stdout is not None
        wire.proc.stdout.close()  # the client's end: the answer has nowhere to go
        assert wire.proc.wait(60) == 0
    finally:
        wire.close()
    said = wire.stderr.read_text()
    assert "the client went away" in said and "Traceback" not in said, said


# How long stdin without room means the server stopped reading it: on a slow host a pause that
# long ends the sending early, so a server that stops nowhere still sends everything
STALL_S = 3.0


def _padded_lists(first: int, count: int, pad: int = 64 * 1024) -> list[bytes]:
    """``tools/list`` requests ``first``.. of ``pad`` bytes each (the pipes' 4 KiB hold none)."""
    return [
        json.dumps(
            {"jsonrpc": "2.0", "id": rid, "method": "tools/list", "params": {"_meta": {"pad": "x" * pad}}}
        ).encode()
        + b"\n"
        for rid in range(first, first + count)
    ]


def test_a_stdio_client_that_reads_no_answers_is_read_no_further(project: Path) -> None:
    """The server read every request it was sent, answered or not, each held by a task until
    its answer was written: a client that never read its answers grew it without end (2.4 GB
    after 787 requests of 3 MiB). Stdin waits now while 32 requests wait for their answers
    (a few more are in the pipes and the reader); once the client reads, all are answered."""
    wire = _Wire(project)
    try:
        wire.hello()
        wire.unread()
        sent = 400
        taken = wire.send_unread(_padded_lists(1, sent))
        assert taken <= MAX_HELD_REQUESTS + 8, taken  # the old server took all 400
        for rid in range(1, taken + 2):  # the one taken in part too
            assert "tools" in wire.answer(rid)["result"]
        assert wire.send_unread(_padded_lists(taken + 2, 3)) == 3  # read again, as it is answered
        for rid in range(taken + 2, taken + 5):
            assert "tools" in wire.answer(rid)["result"]
    finally:
        wire.close()


def test_a_stdio_client_that_reads_no_answers_holds_what_its_requests_take_parsed(project: Path) -> None:
    """The bound counted bytes, and parsed a request of many small values takes ~30 times its
    own: 4 MiB lines of ``[{},{},...]`` held 1.9 GB for 64 MiB of them. It counts what they
    take parsed now: a few such requests fill it, long before 32 of them (as the old one let)."""
    junk: list[dict[str, Any]] = [{}] * 100_000
    listing = {"jsonrpc": "2.0", "id": 0, "method": "tools/list", "params": {"_meta": {"junk": junk}}}
    line = json.dumps(listing).encode()
    fill = -(-MAX_HELD_BYTES // message_cost(line))  # the requests that fill the bound
    assert fill < MAX_HELD_REQUESTS / 4 and len(line) * MAX_HELD_REQUESTS < MAX_HELD_BYTES
    # each answer is longer than the pipes take: one unread keeps the server's writer waiting
    lists = [line.replace(b'"id": 0', f'"id": {rid}'.encode()) + b"\n" for rid in range(1, 41)]
    wire = _Wire(project)
    try:
        wire.hello()
        wire.unread()
        taken = wire.send_unread(lists)
        # a few more are in the pipes, the writer and the reader; the old server took 32 and more
        assert taken <= fill + 5, taken
        for rid in range(1, taken + 2):  # the one taken in part too
            assert "tools" in wire.answer(rid)["result"]
    finally:
        wire.close()


def test_over_stdio_a_clients_answer_to_its_approval_is_read_behind_its_requests(project: Path) -> None:
    """While the server waits for the client's answer to its elicitation, stdin is read past
    the bound: the answer may come behind more requests than the bound, which the client sent
    before reading (held back there, the call would have waited out its approval, denied)."""
    wire = _Wire(project, "--approval-wait", "120")
    try:
        wire.hello({"elicitation": {"form": {}}})
        wire.unread()
        wire.call(1, "run_code", {"code": "mkdir t && rm -r t && echo removed", "language": "bash"})
        asked = wire.question()
        assert asked["method"] == "elicitation/create" and "rm -r t" in asked["params"]["message"]
        behind = MAX_HELD_REQUESTS + 8
        assert wire.send_unread(_padded_lists(2, behind)) == behind
        answer = {
            "jsonrpc": "2.0",
            "id": asked["id"],
            "result": {"action": "accept", "content": {"approve": True}},
        }
        assert wire.send_unread([json.dumps(answer).encode() + b"\n"]) == 1
        assert wire.text(1) == (False, "stdout:\nremoved\n")
        for rid in range(2, 2 + behind):
            assert "tools" in wire.answer(rid)["result"]
    finally:
        wire.close()


MODERN = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientCapabilities": {"elicitation": {"form": {}}},
    "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"},
}


def test_another_call_while_one_waits_for_its_approval_never_gets_the_held_one(project: Path) -> None:
    """2026-07-28: while a call's approval is held, a call with another name or arguments got
    the held call's question, and its retry with the answer ran the held call and returned
    its result (its own action never ran). It is refused now; the held call's retry runs it."""
    wire = _Wire(project)
    try:
        held = {"code": "mkdir gone && rm -r gone && echo removed", "language": "bash"}
        wire.call(1, "run_code", held, _meta=MODERN)
        asked = wire.answer(1)["result"]
        answer = {
            "inputResponses": {
                key: {"action": "accept", "content": {"approve": True}} for key in asked["inputRequests"]
            },
            "requestState": asked.get("requestState"),
        }
        other = {"path": "other.txt", "content": "other\n"}
        wire.call(2, "write_file", other, _meta=MODERN)
        refused = wire.answer(2)
        assert "waits for its approval" in refused.get("error", {}).get("message", ""), refused
        wire.call(3, "write_file", other, _meta=MODERN, **answer)
        refused = wire.answer(3)
        assert "waits for its approval" in refused.get("error", {}).get("message", ""), refused
        wire.call(4, "run_code", held, _meta=MODERN, **answer)
        assert wire.text(4) == (False, "stdout:\nremoved\n")
        wire.call(5, "read_file", {"path": "other.txt"}, _meta=MODERN)
        error, said = wire.text(5)
        assert error and "No such file" in said, said
    finally:
        wire.close()


# -- streamable HTTP ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HttpServer:
    url: str
    token: str

    def client(self, **options: Any) -> Client:
        """A client that sends the server's bearer token, as a configured MCP host would."""
        return Client(self._streams(), **options)

    @contextlib.asynccontextmanager
    async def _streams(self) -> AsyncIterator[TransportStreams]:
        bearer = {"Authorization": f"Bearer {self.token}"}
        async with (
            httpx2.AsyncClient(headers=bearer, timeout=120) as http,
            streamable_http_client(self.url, http_client=http) as streams,
        ):
            yield streams


@pytest.fixture
def http_server(project: Path) -> Iterator[HttpServer]:
    with serving_http(project) as server:
        yield server


@contextlib.contextmanager
def serving_http(project: Path, *extra: str) -> Iterator[HttpServer]:
    port = free_port()
    token = secrets.token_urlsafe(32)
    server = Process(
        _args(project, "--transport", "http", "--port", str(port), *extra), project / "mcp.log", cwd=project,
        env={"STOCKADE_MCP_TOKEN": token},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/mcp"
    try:

        def up() -> bool:
            assert server.proc.poll() is None, server.output()
            try:
                httpx2.get(url, timeout=1)
            except httpx2.TransportError:
                return False
            return True

        wait_for(up, what="stockade mcp to listen", timeout_s=30)
        yield HttpServer(url=url, token=token)
    finally:
        server.stop()
    assert "Traceback" not in server.output(), server.output()[-3000:]
    assert token not in server.output()  # never logged


def test_an_http_request_without_the_token_is_refused(http_server: HttpServer) -> None:
    for headers in ({}, {"Authorization": "Bearer " + "x" * 43}):
        refused = httpx2.post(
            http_server.url, headers=headers, json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, timeout=10
        )
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")

    async def anonymous() -> None:
        async with Client(http_server.url, read_timeout_seconds=30) as client:
            await client.list_tools()

    with pytest.raises(Exception):  # noqa: B017 - the SDK's error for a 401 varies by version
        asyncio.run(anonymous())


def test_an_http_connection_that_sends_nothing_is_closed_within_the_head_timeout(project: Path) -> None:
    """Idle sockets held the MCP server's descriptors for good (the API's took 20,000 of them,
    its limit): a connection that sends no request head in time is closed, as the API's is."""
    with serving_http(project, "--head-timeout", "1") as server:
        port = int(urllib.parse.urlsplit(server.url).port or 0)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            started = time.monotonic()
            assert sock.recv(1024) == b""  # closed by the server, nothing said
            assert time.monotonic() - started < 5


def test_slow_heads_from_one_address_do_not_keep_a_client_with_the_token_out(project: Path) -> None:
    """1,100 connections from one address, each sending a request's head a line a second and
    opened again when closed, held all 1,000 connections the server takes before it sees a
    token, and a client's ``initialize`` with the valid token was answered 503 for as long as
    they lasted. An address now holds an eighth of the cap (here 2 of 16): the rest of its
    connections are answered 503 at once, and a client on another address gets in."""
    with serving_http(project, "--max-connections", "16") as server:
        port = int(urllib.parse.urlsplit(server.url).port or 0)
        with contextlib.ExitStack() as held:
            slow = []
            for _ in range(40):
                sock = held.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
                with contextlib.suppress(OSError):  # a refused one may be closed already
                    sock.sendall(b"POST /mcp HTTP/1.1\r\nX-a: b\r\n")
                slow.append(sock)
            answers = []
            for sock in slow[2:]:  # all but the address's share: refused, asked nothing more
                with contextlib.suppress(ConnectionResetError):
                    answers.append(sock.recv(12))
            assert set(answers) <= {b"HTTP/1.1 503", b""}, set(answers)
            hello = {"protocolVersion": "2025-11-25", "capabilities": {},
                     "clientInfo": {"name": "t", "version": "0"}}  # fmt: skip
            body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello}).encode()
            head = (
                f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {server.token}\r\n"
                f"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            honest = ("127.0.0.2", 0)  # another address (all of 127/8 is this machine's on Linux)
            with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=honest) as sock:
                sock.sendall(head + body)
                assert sock.recv(12) == b"HTTP/1.1 200"


def test_http_bodies_that_stall_are_cut_and_their_room_given_back(project: Path) -> None:
    """Bodies had no deadline: 16 connections that each sent 4 MiB of a body and stalled held
    every byte the server takes at once, and every other client was answered 503 until they
    closed. A body past its deadline (here 1 s, then 100 MB/s) is answered 408, its connection
    closed, and its bytes leave the bodies held: a client's ``initialize`` then gets in."""
    with serving_http(project, "--body-timeout", "1", "--min-body-rate", "100000000") as server:
        port = int(urllib.parse.urlsplit(server.url).port or 0)
        head = (
            f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {server.token}\r\n"
            f"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
            f"Content-Length: {MAX_MESSAGE_BYTES}\r\n\r\n"
        ).encode()
        stalled = []
        try:
            for _ in range(MAX_BODIES_BYTES // MAX_MESSAGE_BYTES):  # all but their last byte: the room
                sock = socket.create_connection(("127.0.0.1", port), timeout=60)
                stalled.append(sock)
                sock.sendall(head + b"x" * (MAX_MESSAGE_BYTES - 1))
            for sock in stalled:
                answer = b""
                while chunk := sock.recv(65536):  # until the server closes it
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
            hello = {"protocolVersion": "2025-11-25", "capabilities": {},
                     "clientInfo": {"name": "t", "version": "0"}}  # fmt: skip
            headers = {
                "Authorization": f"Bearer {server.token}",
                "Accept": "application/json, text/event-stream",
            }
            initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello}
            answered = httpx2.post(server.url, json=initialize, headers=headers, timeout=30)
            assert answered.status_code == 200, answered.text
        finally:
            for sock in stalled:
                sock.close()


def test_an_http_body_of_too_many_values_is_refused_unparsed(http_server: HttpServer) -> None:
    """4 MiB of ``[{},{},...]`` takes ~100 MiB parsed: a body that would take more than
    ``MAX_MESSAGE_COST`` is answered 413 before the SDK parses it."""
    junk = {"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"junk": [{}] * (MAX_MESSAGE_COST // 100)}}
    headers = {
        "Authorization": f"Bearer {http_server.token}",
        "Accept": "application/json, text/event-stream",
    }
    refused = httpx2.post(http_server.url, json=junk, headers=headers, timeout=30)
    assert refused.status_code == 413, refused.text
    assert f"at most {MAX_MESSAGE_COST >> 20} MiB" in refused.json()["error"]["message"]


def test_a_session_in_a_call_is_not_idle_however_long_the_call(project: Path) -> None:
    """The idle timeout counted from a call's start: a run_tests longer than it (or a user
    slow to answer an approval) had its sandbox ended under it, the client blamed for ending
    the session, and the next call given a new run and an empty sandbox."""
    with serving_http(project, "--idle-timeout", "2") as server:

        async def session() -> tuple[str, str, types.CallToolResult]:
            async with server.client(read_timeout_seconds=120) as client:
                before = str((await _session_info(client))["run_id"])
                slow = await client.call_tool("run_code", {"code": "sleep 6; echo slept", "language": "bash"})
                after = str((await _session_info(client))["run_id"])
                return before, after, slow

        before, after, slow = asyncio.run(session())
    assert not slow.is_error and "slept" in _text(slow), _text(slow)
    assert after == before  # the same session's run and sandbox


def test_an_http_session_asks_its_user_through_elicitation(project: Path, http_server: HttpServer) -> None:
    asked: list[str] = []

    async def answer(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult | types.ErrorData:
        assert isinstance(params, types.ElicitRequestFormParams)
        asked.append(params.message)
        approve = "build" in params.message  # yes to the build folder, no to the rest
        return types.ElicitResult(action="accept", content={"approve": approve})

    async def session() -> str:
        async with http_server.client(elicitation_callback=answer, read_timeout_seconds=120) as client:
            run_id = await _work(client)
            ran = await client.call_tool(
                "run_code", {"code": "mkdir build && rm -r build && echo ok", "language": "bash"}
            )
            assert not ran.is_error and "ok" in _text(ran), _text(ran)
            refused = await client.call_tool(
                "run_code", {"code": "rm -r /workspace/calc.py", "language": "bash"}
            )
            assert refused.is_error and "a human denied" in _text(refused), _text(refused)
            listing = await client.call_tool("list_files", {})
            assert "calc.py" in _text(listing)  # the denied removal did not happen
            return run_id

    run_id = asyncio.run(session())
    assert len(asked) == 2 and "rm -r build" in asked[0]
    _ended_and_verified(project, run_id)  # the client's DELETE ended the session


def test_a_killed_http_session_ends_and_says_so(project: Path, http_server: HttpServer) -> None:
    async def session() -> tuple[str, types.CallToolResult]:
        async with http_server.client(read_timeout_seconds=120) as client:
            run_id = str((await _session_info(client))["run_id"])

            def kill() -> subprocess.CompletedProcess[str]:
                # The session's run is live once its sandbox is up, which a fresh process on a
                # busy host may take seconds to get to: until then `stockade kill` pulls
                # nothing and says so (exit 1), and is asked again.
                deadline = time.monotonic() + 60
                while True:
                    done = subprocess.run(
                        [sys.executable, "-m", "stockade.cli.main", "kill", run_id],
                        env=_env(), capture_output=True, text=True, timeout=60, check=False,
                    )  # fmt: skip
                    if done.returncode != 1 or time.monotonic() > deadline:
                        return done
                    time.sleep(0.2)

            killed = await asyncio.to_thread(kill)
            assert killed.returncode == 0, killed.stdout + killed.stderr
            time.sleep(0.5)
            return run_id, await client.call_tool("run_code", {"code": "print(1)", "language": "python"})

    run_id, after = asyncio.run(session())
    assert after.is_error and "killed" in _text(after), _text(after)
    with open_run_store(f"sqlite:///{project / 'audit.db'}") as runs:
        summary = runs.summary(run_id)
        assert summary is not None and summary.status.value == "killed"


def test_http_sessions_at_once_each_have_a_sandbox_and_a_run_of_their_own(
    project: Path, http_server: HttpServer
) -> None:
    async def session(name: str) -> str:
        async with http_server.client(read_timeout_seconds=120) as client:
            run_id = str((await _session_info(client))["run_id"])
            wrote = await client.call_tool("write_file", {"path": f"{name}.txt", "content": name})
            assert not wrote.is_error, _text(wrote)
            await asyncio.sleep(0.5)  # the other sessions write theirs meanwhile
            seen = await client.call_tool(
                "run_code", {"code": "import os; print(sorted(os.listdir('.')))", "language": "python"}
            )
            assert not seen.is_error, _text(seen)
            assert f"'{name}.txt'" in _text(seen) and "'calc.py'" in _text(seen)
            others = [other for other in ("ann", "bob", "cy") if other != name]
            assert not any(f"'{other}.txt'" in _text(seen) for other in others), _text(seen)
            return run_id

    async def sessions() -> list[str]:
        return list(await asyncio.gather(*(session(name) for name in ("ann", "bob", "cy"))))

    run_ids = asyncio.run(sessions())
    assert len(set(run_ids)) == 3
    url = f"sqlite:///{project / 'audit.db'}"
    with open_run_store(url) as runs, open_store(url) as store:
        for run_id in run_ids:

            def ended(rid: str = run_id) -> RunSummary | None:
                summary = runs.summary(rid)
                return summary if summary is not None and summary.status.finished else None

            summary = wait_for(ended, what=f"session {run_id} to end")
            assert summary is not None and summary.status.value == "success", summary
            [call] = runs.tool_calls(run_id)[:1]
            assert call.call.name == "write_file"
            report = verify(store, run_id=run_id, ledger=runs)
            assert report.ok and report.found, report.problems
    assert not (project / "ws" / "ann.txt").exists()  # the project's folder is each session's seed only
