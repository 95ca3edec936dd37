"""``stockade mcp`` and ``stockade ui`` in process: over stdio the protocol, and nothing else,
reaches standard output; what they refuse to start with exits 2 saying why. No sandbox is
started: the handshake needs none, and the tier is named (so nothing probes the host)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import stamina.instrumentation
from typer.testing import CliRunner, Result

from stockade.cli.main import app

runner = CliRunner()

POLICY = """\
version = 1
[trust]
level = "trusted"
[models]
approved = ["mcp"]
"""


@pytest.fixture(autouse=True)
def _stamina_hooks_restored() -> Iterator[None]:
    """``stockade mcp`` turns stamina's retry log off for its process; give the suite its own back."""
    hooks = stamina.instrumentation.get_on_retry_hooks()
    yield
    stamina.instrumentation.set_on_retry_hooks(hooks)


def _messages(*messages: dict[str, object]) -> str:
    return "".join(json.dumps(m) + "\n" for m in messages)


HELLO = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}


def serve_stdio(tmp_path: Path, given: str) -> Result:
    """``stockade mcp`` on stdio over a fresh workspace, reading ``given`` then end of input."""
    (tmp_path / "policy.toml").write_text(POLICY)
    (tmp_path / "ws").mkdir()
    return runner.invoke(
        app,
        ["mcp", "--policy", str(tmp_path / "policy.toml"), "--tier", "process", "--workspace",
         str(tmp_path / "ws"), "--audit-db", f"sqlite:///{tmp_path / 'audit.db'}", "--max-failures", "0"],
        input=given,
    )  # fmt: skip


def test_over_stdio_only_the_protocol_reaches_stdout(tmp_path: Path) -> None:
    # the handshake only: it is answered before the next line is read, whereas a request still
    # in flight when the client closes stdin (as here, at once) may go unanswered
    given = _messages(
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": HELLO},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
    )
    result = serve_stdio(tmp_path, given)
    assert result.exit_code == 0, result.stderr
    [answer] = [json.loads(line) for line in result.stdout.splitlines()]  # every line is JSON-RPC
    assert answer["id"] == 1 and answer["result"]["serverInfo"]["name"] == "stockade"
    assert answer["result"]["capabilities"]["tools"] is not None
    assert "stockade mcp on stdio: the process tier" in result.stderr


def test_over_stdio_a_message_longer_than_http_takes_ends_the_session(tmp_path: Path) -> None:
    """The SDK reads a stdio line whole (one of 200 MB took 928 MB); over HTTP a body past the
    cap is answered 413. A longer line is not read: the session ends, says why, and exits 1
    (it exited 0, as if the client had simply left)."""
    from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE as MAX_MESSAGE_BYTES

    given = _messages(
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": HELLO},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "ping", "params": {"_meta": {"pad": "x" * MAX_MESSAGE_BYTES}}},
        {"jsonrpc": "2.0", "id": 3, "method": "ping"},
    )
    result = serve_stdio(tmp_path, given)
    assert result.exit_code == 1, result.stderr
    answered = [json.loads(line)["id"] for line in result.stdout.splitlines()]
    assert answered == [1], answered  # neither the long message nor any after it
    said = " ".join(result.stderr.split())  # as the console wrapped it
    assert f"a message longer than {MAX_MESSAGE_BYTES} bytes: the session ended" in said, said


def test_over_stdio_a_message_of_too_many_values_ends_the_session_unparsed(tmp_path: Path) -> None:
    """Parsed, 4 MiB of ``[{},{},...]`` took 96 MiB (192 at its parse's peak), and the bounds
    counted bytes: a client that read no answers held 16 such lines, 1.9 GB. A message that
    would take more than ``MAX_MESSAGE_COST`` parsed is never parsed: the session ends, said."""
    from stockade.server.mcp_cost import MAX_MESSAGE_COST, VALUE_BYTES

    junk: list[dict[str, object]] = [{}] * (MAX_MESSAGE_COST // VALUE_BYTES)  # under 1.5 MiB of JSON
    given = _messages(
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": HELLO},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "ping", "params": {"junk": junk}},
        {"jsonrpc": "2.0", "id": 3, "method": "ping"},
    )
    result = serve_stdio(tmp_path, given)
    assert result.exit_code == 1, result.stderr
    answered = [json.loads(line)["id"] for line in result.stdout.splitlines()]
    assert answered == [1], answered  # the old server answered the ping (and held it, unread)
    said = " ".join(result.stderr.split())
    assert f"at most {MAX_MESSAGE_COST >> 20} MiB: the session ended" in said, said


def test_what_mcp_refuses_to_start_with(tmp_path: Path) -> None:
    (tmp_path / "policy.toml").write_text(POLICY)
    not_a_folder = runner.invoke(app, ["mcp", "--policy", str(tmp_path / "policy.toml"), "--workspace",
                                       str(tmp_path / "missing")])  # fmt: skip
    assert not_a_folder.exit_code == 2 and "is not a folder" in not_a_folder.stderr
    (tmp_path / "strict.toml").write_text('version = 1\n[trust]\nlevel = "untrusted"\n')
    weak = runner.invoke(app, ["mcp", "--policy", str(tmp_path / "strict.toml"), "--tier", "process",
                               "--audit-db", f"sqlite:///{tmp_path / 'audit.db'}"])  # fmt: skip
    assert weak.exit_code == 2 and "weaker than" in weak.stderr, weak.stderr


def test_ui_needs_a_run_store(tmp_path: Path) -> None:
    missing = runner.invoke(app, ["ui", "--db", str(tmp_path / "nothing.db")])
    assert missing.exit_code == 2 and "no run store" in missing.stderr


def test_http_beyond_this_machine_needs_a_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "policy.toml").write_text(POLICY)
    args = ["mcp", "--policy", str(tmp_path / "policy.toml"), "--transport", "http", "--host", "0.0.0.0"]
    monkeypatch.delenv("STOCKADE_MCP_TOKEN", raising=False)
    open_to_all = runner.invoke(app, args)
    assert open_to_all.exit_code == 2 and "holds no token" in open_to_all.stderr, open_to_all.stderr
    assert "Authorization: Bearer" in open_to_all.stderr  # the fix says how clients send it
    monkeypatch.setenv("STOCKADE_MCP_TOKEN", "short")
    weak = runner.invoke(app, args)
    assert weak.exit_code == 2 and "shorter than 16 characters" in weak.stderr, weak.stderr


@pytest.mark.parametrize(
    "given",
    [
        ["--transport", "http", "--idle-timeout", "0"],  # every session reaped at once
        ["--transport", "http", "--idle-timeout", "-1"],
        ["--transport", "http", "--idle-timeout", "inf"],  # the reaper's wait overflowed
        ["--dollars-per-hour", "nan"],  # limited nothing
        ["--dollars-per-hour", "inf"],
        ["--approval-wait", "nan"],
        ["--max-failures", "-3"],  # started, then every session failed
        ["--transport", "http", "--body-timeout", "nan"],  # no body would ever be late
    ],
)
def test_mcp_refuses_numbers_that_are_no_limit(tmp_path: Path, given: list[str]) -> None:
    """Found from outside: these ended in a traceback, or in a server that started but could
    serve nothing. Each is refused before anything starts, saying which, exit 2."""
    (tmp_path / "policy.toml").write_text(POLICY)
    result = runner.invoke(app, ["mcp", "--policy", str(tmp_path / "policy.toml"), "--tier", "process",
                                 "--audit-db", f"sqlite:///{tmp_path / 'audit.db'}", *given])  # fmt: skip
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    assert given[-2] in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("age", ["nan", "inf", "-1"])
def test_runs_erase_refuses_an_age_that_is_none(tmp_path: Path, age: str) -> None:
    """``--older-than=-1`` chose runs updated "a day from now": every run of the store."""
    result = runner.invoke(
        app, ["runs", "erase", f"--older-than={age}", "--db", f"sqlite:///{tmp_path / 'r.db'}"]
    )
    assert result.exit_code == 2 and "--older-than" in result.stderr, (result.exit_code, result.stderr)


def test_a_pipe_is_cut_into_lines_as_readline_cut_it() -> None:
    """A pipe is read as the event loop finds bytes in it (a stop signal can end the wait), in
    chunks that split lines anywhere: its lines are those ``readline(limit + 1)`` gave."""
    import os

    import anyio

    from stockade.server.mcp_stdio import _BoundedLines

    sent = b"a\n" + b"b" * 9 + b"\n" + b"\n" + b"c" * 11 + b"\n"  # limit 10: the last is too long
    read_end, write_end = os.pipe()

    async def lines() -> tuple[list[str], bool]:
        with os.fdopen(read_end, "rb") as wire:
            bounded = _BoundedLines(wire, 10)
            async with anyio.create_task_group() as group:

                async def send() -> None:
                    for i in range(0, len(sent), 3):
                        os.write(write_end, sent[i : i + 3])
                        await anyio.sleep(0)
                    os.close(write_end)

                group.start_soon(send)
                got = [line async for line in bounded]
            return got, bounded.refused is not None

    got, too_long = anyio.run(lines)
    assert got == ["a\n", "b" * 9 + "\n", "\n"] and too_long
