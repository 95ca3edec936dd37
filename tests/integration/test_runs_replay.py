"""`stockade replay`: a recorded run played again in a fresh process-tier sandbox, under the
policy, role and tier the run had; the exit code says whether any observation changed."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from typer.testing import CliRunner

from stockade import Sandbox
from stockade.agent import Agent, RunLimits
from stockade.assembly import AgentConfig, build_agent
from stockade.cli.main import app
from stockade.models.scripted import Turn
from stockade.policy import Choice
from stockade.runs import RunRecorder, open_run_store
from stockade.testing import FakeBackend, ScriptedModel, tool_call
from stockade.tools import default_toolset, shell
from tests.conftest import require_tier

runner = CliRunner()
# a bare Agent's run keeps no policy: replayed under the defaults (untrusted: the microVM) unless told
TRUSTED = ("--trust", "trusted", "--tier", "process")


def record(db: Path, command: str, workspace: Path, *, call_id: str = "") -> str:
    turns: list[Turn] = [
        tool_call("read_file", {"path": "app.py"}),
        tool_call("shell", {"command": command}, id=call_id),
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
    result = runner.invoke(app, ["replay", "run-1", "--db", db, "--workspace", str(workspace), *TRUSTED])
    assert result.exit_code == 0, result.output
    assert "every observation matches" in result.output


def test_a_run_whose_output_changes_is_reported_and_exits_one(tmp_path: Path) -> None:
    require_tier("process")
    workspace = project(tmp_path)
    db = record(tmp_path / "audit.db", "date +%N", workspace)  # different every time: "flaky"
    args = ["replay", "run-1", "--db", db, "--workspace", str(workspace), "--json", *TRUSTED]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    (difference,) = report["differences"]
    assert (difference["step"], difference["tool"], difference["what"]) == (2, "shell", "observation")
    assert report["compared"] == 2 and report["replayed_status"] == "success"


def test_a_difference_names_the_models_call_id_as_text(tmp_path: Path) -> None:
    """A model-chosen call id `[/x]` made the report of a difference fail with a MarkupError,
    exit 1: the code that says "an observation differs"."""
    require_tier("process")
    workspace = project(tmp_path)
    db = record(tmp_path / "audit.db", "date +%N", workspace, call_id="[/x]")
    result = runner.invoke(app, ["replay", "run-1", "--db", db, "--workspace", str(workspace), *TRUSTED])
    assert result.exit_code == 1, result.output
    assert "step 2 shell ([/x]): observation differs" in result.output


def test_replay_starts_from_the_workspace_the_run_store_kept(tmp_path: Path) -> None:
    require_tier("process")
    workspace = project(tmp_path)
    db = record(tmp_path / "audit.db", "python3 app.py", workspace)
    (workspace / "app.py").write_text("print('changed since')\n")  # the folder moved on

    result = runner.invoke(app, ["replay", "run-1", "--db", db, *TRUSTED])  # no --workspace
    assert result.exit_code == 0, result.output
    assert "every observation matches" in result.output


# What the original run's code tries: a recursive rm (the policy asks a human), reading .env
# (the policy keeps it out of the sandbox), and curl (denied).
PROBE = """
import os, subprocess
def run(*argv):
    try:
        done = subprocess.run(argv, capture_output=True, text=True)
        return f"{done.returncode} {done.stdout[:20]!r}"
    except OSError as error:
        return f"refused {error.errno}"
print("rm:", run("rm", "-r", "build"), os.path.isdir("build"))
print("env:", open(".env").read() if os.path.exists(".env") else "absent")
print("secrets:", os.listdir("secrets") if os.path.isdir("secrets") else "absent")
print("curl:", run("curl", "--version"))
"""


def guarded_run(tmp_path: Path, *, policy: Path, run_id: str, backend: FakeBackend | None = None) -> str:
    """A run of ``build_agent`` under ``policy`` (its approvals all refused), recorded in a run
    store that shares the audit database; returns that database."""
    workspace = tmp_path / "project"
    (workspace / "build").mkdir(parents=True)
    (workspace / "build" / "out.o").write_text("object\n")
    (workspace / ".env").write_text("SECRET=hunter2\n")
    (workspace / "secrets").mkdir()
    (workspace / "secrets" / "key").write_text("hunter2-key\n")
    db = f"sqlite:///{tmp_path / 'audit.db'}"
    turns: list[Turn] = [tool_call("run_code", {"language": "python", "code": PROBE}), "done"]
    config = AgentConfig(
        model=ScriptedModel(turns),
        policy=policy,
        tier=None if backend is not None else "process",
        backend=backend,
        audit=db,
        approver=lambda request: Choice.DENIED,
        keep_sandbox=False,
    )
    with build_agent(config) as agent:
        agent.run_sync("look around", workspace=workspace, run_id=run_id)
    return db


def example_policy(tmp_path: Path) -> Path:
    policy = tmp_path / "policy.toml"
    policy.write_text((Path(__file__).parents[2] / "examples" / "policy.toml").read_text())
    return policy


def test_the_seed_kept_for_replay_holds_nothing_the_policy_kept_out_of_the_sandbox(tmp_path: Path) -> None:
    require_tier("process")
    db = guarded_run(tmp_path, policy=example_policy(tmp_path), run_id="r3")
    with open_run_store(db) as store:
        state = store.load("r3")
        assert state is not None
        (call,) = state.steps[0].tool_calls
        # the original: rm asked a human (refused), .env and secrets/ absent, curl denied
        assert "rm: refused" in call.observation and "True" in call.observation, call.observation
        assert "env: absent" in call.observation and "secrets: absent" in call.observation
        assert "curl: refused" in call.observation, call.observation
        assert store.restore_seed("r3", tmp_path / "seed")
    kept = sorted(p.relative_to(tmp_path / "seed").as_posix() for p in (tmp_path / "seed").rglob("*"))
    assert kept == ["build", "build/out.o"], kept  # what the sandbox was given, no more


def test_a_replay_is_refused_what_the_run_was_refused(tmp_path: Path) -> None:
    require_tier("process")
    policy = example_policy(tmp_path)
    db = guarded_run(tmp_path, policy=policy, run_id="r3")
    # the policy file loosened since: the replay still runs under the policy the run had
    policy.write_text(policy.read_text().replace('deny = ["curl", ', "deny = ["))
    result = runner.invoke(app, ["replay", "r3", "--db", db, "--json"])
    assert "hunter2" not in result.output
    assert result.exit_code == 0, result.output  # every observation as the original's
    assert "has changed since the run" in result.stderr
    report = json.loads(result.stdout)
    assert report["tier"] == "process" and report["replay_id"].startswith("r3-replay-")
    with sqlite3.connect(tmp_path / "audit.db") as con:  # the replay is audited under its own id
        decisions = con.execute(
            "SELECT COUNT(*) FROM audit_events WHERE run_id = ? AND kind = 'approval'", (report["replay_id"],)
        ).fetchone()[0]
    assert decisions > 0


def test_a_replay_of_a_run_that_needed_a_stronger_tier_refuses_a_weaker_one(tmp_path: Path) -> None:
    require_tier("process")
    policy = tmp_path / "policy.toml"
    policy.write_text('version = 1\n[trust]\nlevel = "untrusted"\n')
    # the run's sandbox: a fake of the microVM tier, which trust "untrusted" needs
    db = guarded_run(tmp_path, policy=policy, run_id="vm", backend=FakeBackend(tier="microvm"))

    result = runner.invoke(app, ["replay", "vm", "--db", db, "--tier", "process"])
    assert result.exit_code == 2, result.output
    assert "ran on the microvm tier" in result.stderr
    # nor can --trust loosen what the run had
    result = runner.invoke(app, ["replay", "vm", "--db", db, "--tier", "process", "--trust", "trusted"])
    assert result.exit_code == 2, result.output


def test_a_replay_takes_no_more_wall_time_than_the_run_could(tmp_path: Path) -> None:
    """A replay runs under the run's own budgets (kept with its policy, signed): a call the
    run's wall time cut is cut in the replay too. It ran under the defaults (900 s), so a
    replay of a run limited to a few seconds held a sandbox for as long as its code asked
    (found from outside: 52 s for a 10 s run)."""
    require_tier("process")
    turns: list[Turn] = [
        tool_call("run_code", {"language": "python", "code": "import time\ntime.sleep(60)\nprint('slept')"}),
        "done",
    ]
    policy = tmp_path / "policy.toml"
    policy.write_text('[trust]\nlevel = "trusted"\n')
    config = AgentConfig(
        model=ScriptedModel(turns),
        policy=policy,
        tier="process",
        audit=f"sqlite:///{tmp_path / 'audit.db'}",
        limits=RunLimits(max_wall_s=3),
        keep_sandbox=False,
    )
    with build_agent(config) as agent:
        agent.run_sync("sleep", workspace=project(tmp_path), run_id="slow")
    with open_run_store(f"sqlite:///{tmp_path / 'audit.db'}") as store:
        setup = store.setup("slow")
        state = store.load("slow")
    assert setup is not None and setup.limits == RunLimits(max_wall_s=3)
    assert state is not None and "slept" not in state.steps[0].tool_calls[0].observation
    result = runner.invoke(app, ["replay", "slow", "--db", f"sqlite:///{tmp_path / 'audit.db'}", "--json"])
    report = json.loads(result.stdout)
    assert "slept" not in json.dumps(report), report


def checked_run(tmp_path: Path, *, run_id: str, passing: bool) -> tuple[str, Path]:
    """A guarded run with an acceptance check that passes only where `ok.txt` is; one failure
    ends the run. Returns the database and the run's workspace."""
    workspace = project(tmp_path)
    if passing:
        (workspace / "ok.txt").write_text("ok\n")
    policy = tmp_path / "policy.toml"
    policy.write_text('[trust]\nlevel = "trusted"\n')
    db = f"sqlite:///{tmp_path / 'audit.db'}"
    config = AgentConfig(
        model=ScriptedModel([tool_call("read_file", {"path": "app.py"}), "done"]),
        policy=policy,
        tier="process",
        audit=db,
        check="test -f ok.txt",
        check_timeout_s=20,
        limits=RunLimits(max_check_failures=1),
        keep_sandbox=False,
    )
    with build_agent(config) as agent:
        agent.run_sync("make ok.txt", workspace=workspace, run_id=run_id)
    return db, workspace


def test_a_run_keeps_its_acceptance_check_for_its_replay(tmp_path: Path) -> None:
    require_tier("process")
    db, _ = checked_run(tmp_path, run_id="checked", passing=True)
    with open_run_store(db) as store:
        setup = store.setup("checked")
    assert setup is not None and setup.check_kept
    assert (setup.check, setup.check_timeout_s) == ("test -f ok.txt", 20)


def test_a_run_that_failed_its_check_replays_as_failing_it(tmp_path: Path) -> None:
    """The replay runs the run's acceptance check too. It left the check out, so a run that
    ended check_failed replayed as "success", "every observation matches" (found from outside)."""
    require_tier("process")
    db, _ = checked_run(tmp_path, run_id="failed", passing=False)
    result = runner.invoke(app, ["replay", "failed", "--db", db, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["recorded_status"], report["replayed_status"]) == ("check_failed", "check_failed")
    assert report["compared"] == 2  # the read_file call and the check


def test_a_check_whose_outcome_changes_is_a_difference_and_exits_one(tmp_path: Path) -> None:
    require_tier("process")
    db, _ = checked_run(tmp_path, run_id="passed", passing=True)
    (tmp_path / "elsewhere").mkdir()
    elsewhere = project(tmp_path / "elsewhere")  # the same app.py, no ok.txt: the check fails
    result = runner.invoke(app, ["replay", "passed", "--db", db, "--workspace", str(elsewhere), "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    (difference,) = report["differences"]
    assert (difference["tool"], difference["what"]) == ("check", "error")
    assert report["status_differs"] and report["replayed_status"] == "check_failed"
    text = runner.invoke(app, ["replay", "passed", "--db", db, "--workspace", str(elsewhere)])
    assert text.exit_code == 1 and "every observation matches" not in text.output
    assert "the run ended success, the replay check_failed" in text.output


def test_a_run_kept_without_its_check_replays_the_one_its_record_shows(tmp_path: Path) -> None:
    require_tier("process")
    db, _ = checked_run(tmp_path, run_id="older", passing=False)
    with sqlite3.connect(tmp_path / "audit.db") as con:  # as an older stockade kept it
        con.execute("DELETE FROM runs_run_checks")
    result = runner.invoke(app, ["replay", "older", "--db", db, "--json"])
    assert result.exit_code == 0, result.output
    assert "kept no acceptance check for run older" in result.stderr
    assert "`test -f ok.txt`" in result.stderr
    assert json.loads(result.stdout)["replayed_status"] == "check_failed"
