"""`stockade agent` and `stockade demo` on the real process tier.

With no terminal to ask, an action that needs approval pauses the run (exit code 3) with
the commands to approve and resume it; `stockade agent --resume` continues it in a new
process-tier sandbox seeded with the workspace as it was when it paused.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from stockade.audit import SQLiteStore, verify
from stockade.cli.main import app
from tests.conftest import require_tier, wait_for

pytestmark = pytest.mark.process

EXAMPLE_POLICY = Path(__file__).parents[2] / "examples" / "policy.toml"
runner = CliRunner()


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STOCKADE_APPROVAL_DIR", str(tmp_path / "approvals"))
    monkeypatch.setenv("STOCKADE_KILL_DIR", str(tmp_path / "kill"))
    workspace = tmp_path / "project"
    (workspace / "scratch").mkdir(parents=True)
    (workspace / "scratch" / "stale.o").write_text("old\n")
    (workspace / "app.py").write_text("print('hello')\n")
    turns = [
        {"name": "shell", "args": {"command": "curl https://example.com; touch pwned"}},
        {"name": "shell", "args": {"command": "rm -r scratch"}},
        {"name": "write_file", "args": {"path": "NOTES.md", "content": "cleaned\n"}},
        "cleaned the scratch folder",
    ]
    (tmp_path / "turns.json").write_text(json.dumps(turns))
    return tmp_path


def test_stockade_agent_pauses_for_approval_then_resumes_to_success(dirs: Path) -> None:
    require_tier("process")
    db = f"sqlite:///{dirs / 'audit.db'}"
    common = ["--audit-db", db, "--state-dir", str(dirs / "paused")]
    first = runner.invoke(
        app,
        [
            "agent", "clean the scratch folder", "--workspace", str(dirs / "project"),
            "--model", f"scripted:{dirs / 'turns.json'}", "--tier", "process",
            "--policy", str(EXAMPLE_POLICY), "--shell", "--run-id", "tidy", *common,
        ],
    )  # fmt: skip
    assert first.exit_code == 3, first.output
    output = " ".join(first.output.split())  # the console wraps long lines
    assert "denied shell" in output and "is denied by the policy ('curl')" in output
    assert "on the process tier" in output
    approve = re.search(r"approve: (stockade approve tidy [0-9a-f]+)", output)
    assert approve is not None and "then resume: stockade agent --resume tidy" in output

    decided = runner.invoke(app, approve.group(1).split()[1:])
    assert decided.exit_code == 0, decided.output

    second = runner.invoke(app, ["agent", "--resume", "tidy", *common])
    assert second.exit_code == 0, second.output
    assert "+cleaned" in second.output and "-old" in second.output  # the diff spans both processes
    assert "success after" in second.output and "on the process tier" in second.output
    assert "pwned" not in second.output
    assert (dirs / "project" / "scratch" / "stale.o").exists()  # the host folder is never written
    assert not (dirs / "paused" / "tidy").exists()

    with SQLiteStore(dirs / "audit.db") as store:
        report = verify(store)
        assert report.ok and report.checked > 10
        kinds = {e.kind.value for e in store.events(run_id="tidy")}
    assert {"policy_decision", "approval", "command", "model_call", "tool_call"} <= kinds
    runs = runner.invoke(app, ["runs", "list", "--db", db])
    assert "tidy" in runs.output and "success" in runs.output
    # The exec inside the sandbox was judged too, under the call whose code started it.
    shown = runner.invoke(app, ["runs", "show", "tidy", "--db", db])
    assert "exec approve rm -r scratch (commands.approve: rm -r)" in shown.output, shown.output


def test_stockade_agent_refuses_a_tier_weaker_than_trust_allows(dirs: Path) -> None:
    result = runner.invoke(
        app,
        [
            "agent", "anything", "--workspace", str(dirs / "project"),
            "--model", f"scripted:{dirs / 'turns.json'}", "--tier", "process", "--trust", "untrusted",
            "--policy", str(EXAMPLE_POLICY), "--audit-db", f"sqlite:///{dirs / 'audit.db'}",
        ],
    )  # fmt: skip
    assert result.exit_code == 2
    assert "weaker than trust 'untrusted'" in " ".join(result.output.split())


def test_stockade_demo_ends_with_its_audit_run_and_a_verified_chain(tmp_path: Path) -> None:
    require_tier("process")
    result = runner.invoke(app, ["demo", "--audit-db", str(tmp_path / "demo.db")])
    assert result.exit_code == 0, result.output
    assert "✓ check passed" in result.output
    # the diff's long line arrives whole: output to a pipe or a file is never cut at 80 columns
    fixed = "+    return sorted(name for name, count in stock.items() if count <= threshold)\n"
    assert fixed in result.output
    run_id = re.search(r"audit run id: ([0-9a-f]+)", result.output)
    verified = re.search(r"audit chain verified: (\d+) events", result.output)
    assert run_id is not None and verified is not None
    with SQLiteStore(tmp_path / "demo.db") as store:
        events = list(store.events(run_id=run_id.group(1)))
    assert int(verified.group(1)) == len(events)
    assert "retry" in {e.kind.value for e in events}  # the injected fault, retried and recorded


def test_stockade_agent_with_a_check_shows_invalid_calls_and_ends_check_failed(
    dirs: Path, tmp_path: Path
) -> None:
    require_tier("process")
    from stockade.demo import SAMPLE_PROJECT

    turns = [
        {"name": "read_file", "args": {"no_such_argument": 1}},
        {"name": "run_tests", "args": {"command": "python3 -m unittest"}},
        "all green",
    ]
    (tmp_path / "lies.json").write_text(json.dumps(turns))
    result = runner.invoke(
        app,
        [
            "agent", "make the tests pass", "--workspace", str(SAMPLE_PROJECT),
            "--model", f"scripted:{tmp_path / 'lies.json'}", "--policy", str(EXAMPLE_POLICY),
            "--check", "python3 -m unittest", "--max-steps", "3",
            "--audit-db", f"sqlite:///{tmp_path / 'audit.db'}", "--state-dir", str(tmp_path / "paused"),
        ],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "✗ invalid call read_file(no_such_argument=1)" in result.output
    assert "path: Field required" in result.output
    assert "✗ check failed python3 -m unittest" in result.output
    assert "unittest: 2 passed, 1 failed" in result.output
    assert "check_failed after 3 steps on the process tier" in result.output


def test_stockade_demo_records_its_run_where_runs_list_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_tier("process")
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["demo"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / ".stockade" / "audit.db").exists()
    run_id = re.search(r"audit run id: ([0-9a-f]+)", result.output)
    assert run_id is not None and f"stockade runs show {run_id.group(1)}" in result.output
    listed = runner.invoke(app, ["runs", "list", "--json"])
    (run,) = json.loads(listed.output)
    assert (run["run_id"], run["status"]) == (run_id.group(1), "success")


@pytest.mark.microvm  # the microVM's probe starts a guest: the tier is chosen by trust
def test_a_failed_stockade_agent_leaves_no_files_behind(dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(dirs)
    project = str(dirs / "project")
    failing = [
        ["agent", "x", "-w", project, "-m", "scripted:missing.json"],  # no such model file
        ["agent", "x", "-w", str(dirs / "nowhere"), "-m", f"scripted:{dirs / 'turns.json'}"],
        ["agent", "x", "-w", project, "-m", f"scripted:{dirs / 'turns.json'}", "--tier", "bogus"],
        ["agent", "x", "-w", project, "-m", f"scripted:{dirs / 'turns.json'}", "--policy", "missing.toml"],
    ]
    weaker = ["--policy", str(EXAMPLE_POLICY), "--trust", "untrusted", "--tier", "process"]
    failing.append(["agent", "x", "-w", project, "-m", f"scripted:{dirs / 'turns.json'}", *weaker])
    for args in failing:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert not (dirs / ".stockade").exists(), args


def test_ctrl_c_stops_a_long_tool_call_at_once_and_the_run_resumes(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    from stockade.runs import open_run_store

    require_tier("process")
    (tmp_path / "project").mkdir()
    slow = "if [ -f marker ]; then echo 'second time'; else touch marker; sleep 120; fi"
    turns = [{"name": "run_code", "args": {"language": "bash", "code": slow}}, "done"]
    (tmp_path / "turns.json").write_text(json.dumps(turns))
    env = {
        **os.environ,
        "STOCKADE_APPROVAL_DIR": str(tmp_path / "approvals"),
        "STOCKADE_KILL_DIR": str(tmp_path / "kill"),
    }
    agent = [sys.executable, "-m", "stockade.cli.main", "agent"]
    proc = subprocess.Popen(
        [*agent, "wait", "-w", "project", "-m", "scripted:turns.json", "--policy", str(EXAMPLE_POLICY),
         "--run-id", "slow"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        live = tmp_path / "kill" / ".live" / "slow"

        def watching() -> bool:  # the run watches its kill switch once its sandbox is up
            assert proc.poll() is None, proc.communicate()
            return live.exists()

        wait_for(watching, what="the run to watch its kill switch", timeout_s=60)
        time.sleep(1.5)  # the model's first turn is in: the 120 s command runs
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - started
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, stdout + stderr
    assert took < 5, f"took {took:.1f} s"  # not the ~23 s of waiting for the command
    assert "interrupted" in stdout and "stockade agent --resume slow" in stdout
    with open_run_store(f"sqlite:///{tmp_path / '.stockade' / 'audit.db'}") as store:
        assert store.summary("slow").status == "interrupted"  # type: ignore[union-attr]
    assert not live.exists()  # nothing says it is live any more

    resumed = subprocess.run(
        [*agent, "--resume", "slow"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "second time" in resumed.stdout or "success" in resumed.stdout
    with open_run_store(f"sqlite:///{tmp_path / '.stockade' / 'audit.db'}") as store:
        assert store.summary("slow").status == "success"  # type: ignore[union-attr]


def test_a_killed_stockade_agent_shows_interrupted_and_resumes_from_its_workspace(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    require_tier("process")
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "app.py").write_text("print('hello')\n")
    turns = [
        {"name": "write_file", "args": {"path": "NOTES.md", "content": "step one\n"}},
        {"name": "run_code", "args": {"language": "bash", "code": "touch half-done; sleep 120"}},
        "done",
    ]
    (tmp_path / "turns.json").write_text(json.dumps(turns))
    env = {
        **os.environ,
        "STOCKADE_APPROVAL_DIR": str(tmp_path / "approvals"),
        "STOCKADE_KILL_DIR": str(tmp_path / "kill"),
    }
    agent = [sys.executable, "-m", "stockade.cli.main", "agent"]
    proc = subprocess.Popen(
        [*agent, "crash", "-w", "project", "-m", "scripted:turns.json", "--policy", str(EXAMPLE_POLICY),
         "--run-id", "crashy"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # the long command is running once its call is shown... or not yet: the second call (120 s) runs
    kill_after_line(proc, "write_file", after_s=1.5)
    db = f"sqlite:///{tmp_path / '.stockade' / 'audit.db'}"
    listed = subprocess.run(
        [sys.executable, "-m", "stockade.cli.main", "runs", "list", "--db", db, "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    (run,) = json.loads(listed.stdout)
    assert run["status"] == "interrupted" and "--resume" in run["error"]

    resumed = subprocess.run(
        [*agent, "--resume", "crashy"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "+++ b/NOTES.md" in resumed.stdout and "half-done" not in resumed.stdout
    assert "app.py" not in resumed.stdout  # the diff's baseline came back with the workspace
    again = subprocess.run(
        [*agent, "--resume", "crashy"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert again.returncode == 2 and "no run 'crashy' to resume" in again.stderr
    with SQLiteStore(tmp_path / ".stockade" / "audit.db") as trail:
        kinds = [e.kind.value for e in trail.events(run_id="crashy")]
    assert "run_crash" in kinds
    checked = subprocess.run(
        [sys.executable, "-m", "stockade.cli.main", "audit", "verify", "--db", db],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_audit_verify_is_not_intact_while_a_killed_run_had_a_call_in_flight(tmp_path: Path) -> None:
    """The process dies by SIGKILL during a ``run_code`` that started a program and wrote a file
    seconds before: the audit log had written its batches, but the call's events come only when
    it returns. ``audit verify`` names the call in flight (exit 1), and the trail holds what was
    asked (``tool_call_start``, ``op_start``); a resume records the crash and closes it."""
    import os
    import subprocess
    import sys

    from stockade.agent.state import args_measure

    require_tier("process")
    (tmp_path / "project").mkdir()
    code = (
        "import subprocess, time\n"
        "subprocess.run(['/bin/echo', 'EVIL-MARKER'])\n"
        "open('written.txt', 'w').write('x')\n"
        "time.sleep(120)\n"
    )
    turns: list[Any] = [{"name": "run_code", "args": {"language": "python", "code": code}}, "done"]
    (tmp_path / "turns.json").write_text(json.dumps(turns))
    env = {**os.environ, "STOCKADE_KILL_DIR": str(tmp_path / "kill"), "STOCKADE_AUDIT_KEY": "k" * 32}
    cli = [sys.executable, "-m", "stockade.cli.main"]
    db = f"sqlite:///{tmp_path / '.stockade' / 'audit.db'}"
    # the example policy's trust: the process tier (the default trust's is the microVM: a guest
    # booted beside the microVM worker's, which this test is not about)
    proc = subprocess.Popen(
        [*cli, "agent", "stall", "-w", "project", "-m", "scripted:turns.json", "--run-id", "stalled",
         "--policy", str(EXAMPLE_POLICY)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # the code runs; the log's batches (every 0.2 s) are written meanwhile
    kill_after_line(proc, "run_code", after_s=2.0)

    def audit_verify() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*cli, "audit", "verify", "--db", db, "--json"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    checked = audit_verify()
    assert checked.returncode == 1, checked.stdout + checked.stderr  # never "intact"
    problems = json.loads(checked.stdout)["problems"]
    assert [p["kind"] for p in problems] == ["in_flight"], problems
    assert "run_code" in problems[0]["detail"] and "stalled" in problems[0]["detail"]
    with SQLiteStore(tmp_path / ".stockade" / "audit.db") as trail:
        events = list(trail.events(run_id="stalled"))
    (started,) = [e for e in events if e.kind.value == "tool_call_start"]
    (op,) = [e for e in events if e.kind.value == "op_start"]
    assert started.attributes["tool"] == "run_code"
    assert started.attributes["args_digest"] == args_measure(turns[0]["args"])[1]  # what was asked
    assert op.attributes["call_id"] == started.attributes["call_id"]  # what ran in the sandbox for it
    assert problems[0]["seq"] == started.seq  # the finding points at the start the trail has

    resumed = subprocess.run(
        [*cli, "agent", "--resume", "stalled"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    closed = audit_verify()
    assert closed.returncode == 0, closed.stdout + closed.stderr  # run_crash, and the call's unknown outcome


def kill_after_line(proc: subprocess.Popen[str], marker: str, *, after_s: float) -> None:
    """SIGKILL ``proc`` (no handler, no cleanup, no flush) ``after_s`` after it prints a line
    holding ``marker``; its pipes closed either way."""
    try:
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        for line in proc.stdout:
            if marker in line:
                break
            assert time.monotonic() < deadline, line
        time.sleep(after_s)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_the_demo_tells_a_fresh_shell_how_to_call_the_cli_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`./scripts/demo` runs the virtualenv's CLI, which a fresh shell has not on its PATH: the
    commands it suggests name that script where `stockade` alone would not be found."""
    require_tier("process")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    result = runner.invoke(app, ["demo"])
    assert result.exit_code == 0, result.output
    script = Path(sys.executable).parent / "stockade"
    assert f"{script} runs show " in result.output and f"{script} audit tail" in result.output
