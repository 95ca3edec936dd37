"""`stockade replay`: a recorded run played again in a fresh process-tier sandbox; the exit code
says whether any observation changed."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from stockade import Sandbox
from stockade.agent import Agent
from stockade.cli.main import app
from stockade.models.scripted import Turn
from stockade.runs import RunRecorder, open_run_store
from stockade.testing import ScriptedModel, tool_call
from stockade.tools import default_toolset, shell
from tests.conftest import require_tier

runner = CliRunner()


def record(db: Path, command: str, workspace: Path) -> str:
    turns: list[Turn] = [
        tool_call("read_file", {"path": "app.py"}),
        tool_call("shell", {"command": command}),
        "done",
    ]
    with open_run_store(f"sqlite:///{db}") as store:
        agent = Agent(
            ScriptedModel(turns),
            tools=default_toolset().including(shell),
            checkpointer=store,
            observers=[RunRecorder(store, seed=workspace)],
        )
        with Sandbox.create("process", workspace=workspace) as sbx:
            assert agent.run_sync("look around", sandbox=sbx, run_id="run-1").ok
    return f"sqlite:///{db}"


def project(tmp_path: Path) -> Path:
    workspace = tmp_path / "project"
    workspace.mkdir()
    (workspace / "app.py").write_text("print('hello')\n")
    return workspace


def test_a_deterministic_run_replays_identically(tmp_path: Path) -> None:
    require_tier("process")
    workspace = project(tmp_path)
    db = record(tmp_path / "audit.db", "python3 app.py", workspace)
    result = runner.invoke(app, ["replay", "run-1", "--db", db, "--workspace", str(workspace)])
    assert result.exit_code == 0, result.output
    assert "every observation matches" in result.output


def test_a_run_whose_output_changes_is_reported_and_exits_one(tmp_path: Path) -> None:
    require_tier("process")
    workspace = project(tmp_path)
    db = record(tmp_path / "audit.db", "date +%N", workspace)  # different every time: "flaky"
    result = runner.invoke(app, ["replay", "run-1", "--db", db, "--workspace", str(workspace), "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    (difference,) = report["differences"]
    assert (difference["step"], difference["tool"], difference["what"]) == (2, "shell", "observation")
    assert report["compared"] == 2 and report["replayed_status"] == "success"


def test_replay_starts_from_the_workspace_the_run_store_kept(tmp_path: Path) -> None:
    require_tier("process")
    workspace = project(tmp_path)
    db = record(tmp_path / "audit.db", "python3 app.py", workspace)
    (workspace / "app.py").write_text("print('changed since')\n")  # the folder moved on

    result = runner.invoke(app, ["replay", "run-1", "--db", db])  # no --workspace
    assert result.exit_code == 0, result.output
    assert "every observation matches" in result.output
