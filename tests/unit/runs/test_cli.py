"""`stockade runs list | show` over a SQLite run store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from stockade import Sandbox
from stockade.agent import Agent
from stockade.cli.main import app
from stockade.exceptions import ResourceContention
from stockade.models.scripted import Turn
from stockade.runs import RunRecorder, open_run_store
from stockade.runtime import Retrier, RetryingBackend, RetryPolicy
from stockade.sandbox.base import OpResult
from stockade.sandbox.ops import Op, RunCommand
from stockade.testing import FakeBackend, MemoryWorkspace, ScriptedModel, tool_call
from stockade.tools import default_toolset, idempotency_key, shell
from stockade.types import CommandResult

runner = CliRunner()

TURNS: list[Turn] = [
    tool_call("write_file", {"path": "a.txt", "content": "x\n"}),
    tool_call("shell", {"command": "cat a.txt"}),
    "done",
]


def recorded_run(path: Path) -> str:
    """One run with a write, a command (exit 3, long output) and a retried read of the workspace."""
    failures = iter([ResourceContention("the host is busy")])
    workspace = MemoryWorkspace(
        commands=lambda op: CommandResult(exit_code=3, stdout="y" * 2000, stderr="", duration_s=0.2)
    )

    def handler(op: Op[Any]) -> OpResult:
        if isinstance(op, RunCommand) and (error := next(failures, None)):
            raise error
        return workspace(op)

    with open_run_store(f"sqlite:///{path}") as store:
        recorder = RunRecorder(store)
        retrier = Retrier(policy=RetryPolicy(wait_initial=0.5, wait_jitter=0), observer=recorder.runtime)
        tools = default_toolset().including(shell)
        agent = Agent(ScriptedModel(TURNS), tools=tools, checkpointer=store, observers=[recorder])
        backend = RetryingBackend(FakeBackend(handler), retrier, idempotent=(RunCommand,))
        with Sandbox.create(backend=backend) as sbx:
            agent.run_sync("write a and show it", sandbox=sbx, run_id="run-abc123")
    return f"sqlite:///{path}"


def test_list_shows_the_run_and_its_status(tmp_path: Path) -> None:
    db = recorded_run(tmp_path / "audit.db")
    result = runner.invoke(app, ["runs", "list", "--db", db])
    assert result.exit_code == 0, result.output
    assert "run-abc123" in result.output and "success" in result.output

    (run,) = json.loads(runner.invoke(app, ["runs", "list", "--db", db, "--json"]).output)
    assert (run["run_id"], run["status"], run["steps"]) == ("run-abc123", "success", 3)


def test_show_traces_each_step_with_exit_code_retries_and_the_diff(tmp_path: Path) -> None:
    db = recorded_run(tmp_path / "audit.db")
    result = runner.invoke(app, ["runs", "show", "run-abc", "--db", db])  # a unique prefix is enough
    assert result.exit_code == 0, result.output
    text = result.output
    assert 'write_file({"path": "a.txt", "content": "x\\n"})' in text
    assert "exit 3" in text
    assert "retry 1" in text and "ResourceContention: the host" in text
    assert "more chars]" in text  # the long output is cut
    assert "+++ b/a.txt" in text


def test_show_json_has_the_whole_trace(tmp_path: Path) -> None:
    db = recorded_run(tmp_path / "audit.db")
    trace = json.loads(runner.invoke(app, ["runs", "show", "run-abc123", "--db", db, "--json"]).output)
    write, command = (step["tool_calls"][0] for step in trace["steps"][:2])
    assert write["idempotency_key"] == idempotency_key("run-abc123", 1, 0, "call_0_0")
    assert command["exit_code"] == 3 and command["duration_s"] > 0
    assert command["retries"] == [
        {
            "subject": "fake:RunCommand",
            "attempt": 1,
            "delay_s": 0.5,
            "reason": "ResourceContention: the host is busy",
        }
    ]
    assert trace["diff"].endswith("+x\n") and trace["answer"] == "done"


def test_an_unknown_run_or_store_exits_two(tmp_path: Path) -> None:
    db = recorded_run(tmp_path / "audit.db")
    assert runner.invoke(app, ["runs", "show", "nope", "--db", db]).exit_code == 2
    assert runner.invoke(app, ["runs", "list", "--db", str(tmp_path / "missing.db")]).exit_code == 2


def test_piped_output_is_never_wrapped_or_cut(tmp_path: Path) -> None:
    long_line = "value = " + "'x' + " * 40 + "'end of the line'"
    turns: list[Turn] = [tool_call("write_file", {"path": "long.py", "content": long_line + "\n"}), "done"]
    db = tmp_path / "audit.db"
    with open_run_store(f"sqlite:///{db}") as store:
        agent = Agent(ScriptedModel(turns), checkpointer=store, observers=[RunRecorder(store)])
        with Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sbx:
            agent.run_sync("write a long line, a long task to describe " * 4, sandbox=sbx, run_id="long")
    result = runner.invoke(app, ["runs", "show", "long", "--db", f"sqlite:///{db}"])
    assert result.exit_code == 0, result.output
    assert f"+{long_line}\n" in result.output  # the diff line arrives whole, not at 80 columns
    listed = runner.invoke(app, ["runs", "list", "--db", f"sqlite:///{db}"])
    assert max(len(line) for line in listed.output.splitlines()) > 80  # the table is not squeezed


LINKED = "[link=https://evil.example/]read_file[/link]"


def hostile_run(path: Path) -> str:
    """A run whose model named tools and a call id with rich markup, and wrote a file whose
    text and a task that hold an 8-bit CSI (U+009B) and a bidi override (U+202E)."""
    turns: list[Turn] = [
        tool_call(LINKED, {"path": "a.py"}),
        tool_call("[/bold]", {}, id="[/x]"),
        tool_call("write_file", {"path": "b.txt", "content": "ok \u202eevil\u202c \x9b2J\n"}),
        "done",
    ]
    with open_run_store(f"sqlite:///{path}") as store:
        agent = Agent(ScriptedModel(turns), checkpointer=store, observers=[RunRecorder(store)])
        with Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sbx:
            agent.run_sync("clean \u202eup\x9b", sandbox=sbx, run_id="run-hostile")
    return f"sqlite:///{path}"


def test_show_prints_the_models_tool_names_and_call_ids_as_text_never_as_markup(tmp_path: Path) -> None:
    """A tool named `[link=https://evil.example/]read_file[/link]` was drawn as a plain read_file
    call that was a link to evil.example, and one named `[/bold]` made `runs show` fail with a
    MarkupError (exit 1): that run could never be shown."""
    db = hostile_run(tmp_path / "audit.db")
    result = runner.invoke(app, ["runs", "show", "run-hostile", "--db", db])
    assert result.exit_code == 0, result.output
    assert f'{LINKED}({{"path": "a.py"}})' in result.output
    assert "[/bold]({})" in result.output


def test_every_json_output_shows_controls_as_escapes_and_decodes_the_same(tmp_path: Path) -> None:
    """`runs show --json` and `runs list --json` printed U+009B (which a terminal acts on) and
    U+202E raw, where `runs show` and `audit export` show them escaped."""
    db = hostile_run(tmp_path / "audit.db")
    raw = {"\x9b", "\u202e", "\u202c"}
    shown = runner.invoke(app, ["runs", "show", "run-hostile", "--db", db, "--json"])
    listed = runner.invoke(app, ["runs", "list", "--db", db, "--json"])
    for result in (shown, listed):
        assert result.exit_code == 0, result.output
        assert not set(result.stdout) & raw
        assert "\\u202e" in result.stdout and "\\u009b" in result.stdout
    assert json.loads(listed.stdout)[0]["task"] == "clean \u202eup\x9b"
    write = json.loads(shown.stdout)["steps"][2]["tool_calls"][0]
    assert write["args"]["content"] == "ok \u202eevil\u202c \x9b2J\n"
