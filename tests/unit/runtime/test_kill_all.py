"""A kill-all: every live run of a tenant, or of the host, stopped at once from the command line."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from typer.testing import CliRunner

from stockade.agent import RunResult, RunStatus
from stockade.assembly import AgentConfig, build_agent
from stockade.audit import AuditLog, MemoryStore
from stockade.cli.main import app
from stockade.models import ScriptedModel, tool_call
from stockade.policy.schema import Policy, TrustRules
from stockade.runtime.killswitch import FileKillSource, KillSwitch, LiveRun, kill_all
from stockade.sandbox.ops import RunCommand
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.tools import Toolset, shell
from stockade.types import CommandResult, Trust
from tests.conftest import wait_for


def slow(op: RunCommand) -> CommandResult:
    time.sleep(0.02)
    return CommandResult(exit_code=0, stdout="", stderr="", duration_s=0.02)


def start_run(tmp_path: Path, tenant: str, run_id: str, results: dict[str, RunResult]) -> threading.Thread:
    """A run that would go on for a long while, in a thread of its own."""
    config = AgentConfig(
        model=ScriptedModel([tool_call("shell", {"command": "sleep 0.02"})] * 5000 + ["done"]),
        policy=Policy(trust=TrustRules(level=Trust.TRUSTED)),
        backend=FakeBackend(MemoryWorkspace(commands=slow), tier="process"),
        audit=AuditLog(MemoryStore()),
        tools=Toolset([shell]),
        kill_target=str(tmp_path / "kill"),
        anomaly=False,
        tenant=tenant,
    )

    def run() -> None:
        with build_agent(config) as agent:
            results[run_id] = agent.run_sync("loop", run_id=run_id)

    thread = threading.Thread(target=run, name=f"run-{run_id}")
    thread.start()
    return thread


def wait_live(source: FileKillSource, count: int) -> None:
    wait_for(lambda: len(source.live_runs()) >= count, what=f"{count} live runs")


def test_kill_all_of_a_tenant_then_of_the_host(tmp_path: Path) -> None:
    source = FileKillSource(tmp_path / "kill")
    results: dict[str, RunResult] = {}
    threads = [
        start_run(tmp_path, "acme", "acme-1", results),
        start_run(tmp_path, "acme", "acme-2", results),
        start_run(tmp_path, "globex", "globex-1", results),
    ]
    try:
        wait_live(source, 3)
        assert {(r.run_id, r.tenant) for r in source.live_runs()} == {
            ("acme-1", "acme"),
            ("acme-2", "acme"),
            ("globex-1", "globex"),
        }
        target = ["--target", str(tmp_path / "kill")]
        tenant = CliRunner().invoke(app, ["kill", "--all", "--tenant", "acme", *target, "--reason", "breach"])
        assert tenant.exit_code == 0, tenant.output
        assert "2 run(s) of tenant acme stopped" in tenant.output
        for thread in threads[:2]:
            thread.join(timeout=10)
        assert results["acme-1"].status == results["acme-2"].status == RunStatus.KILLED
        assert "breach" in (results["acme-1"].error or "")
        assert threads[2].is_alive() and [r.run_id for r in source.live_runs()] == ["globex-1"]
        host = CliRunner().invoke(app, ["kill", "--all", *target])
        assert host.exit_code == 0, host.output
        threads[2].join(timeout=10)
        assert results["globex-1"].status == RunStatus.KILLED
        nothing = CliRunner().invoke(app, ["kill", "--all", *target])
        assert nothing.exit_code == 1 and "no live run" in nothing.output
    finally:
        kill_all(source, "test cleanup")
        for thread in threads:
            thread.join(timeout=10)


def test_kill_all_pulls_only_what_is_live(tmp_path: Path) -> None:
    source = FileKillSource(tmp_path)
    alive = KillSwitch("a-1", [FileKillSource(tmp_path)], poll_s=0.01, tenant="a")
    with alive.watch():
        source.mark_live("old-style", "pid 1 on elsewhere")  # a mark written before tenants
        runs = {r.run_id: r for r in source.live_runs()}
        assert runs["old-style"] == LiveRun(run_id="old-style", where="pid 1 on elsewhere")
        assert runs["a-1"].tenant == "a" and "tenant a" in (source.live("a-1") or "")
        assert [r.run_id for r in kill_all(source, "stop", tenant="a")] == ["a-1"]
        wait_for(lambda: alive.killed, what="the switch to see the kill", timeout_s=5)
    assert source.reason("old-style") is None
