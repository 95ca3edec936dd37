"""One transient failure, seen from every side: an assembled agent on the real process tier
whose sandbox fails a read once (a wrapper backend injects it) retries it; afterwards
`stockade runs show` lists the retry and its reason under the tool call, the audit trail
holds the RETRY event, and `stockade audit verify` passes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from stockade.agent import RunLimits
from stockade.assembly import AgentConfig, build_agent
from stockade.audit import EventKind, SQLiteStore
from stockade.cli.main import app
from stockade.exceptions import ResourceContention
from stockade.models import ScriptedModel, tool_call
from stockade.runs import open_run_store
from stockade.runtime import RetryPolicy
from stockade.sandbox import _registry
from stockade.sandbox.base import (
    Backend,
    Instance,
    OpResult,
    OutputSink,
    SandboxSpec,
    WrapperBackend,
    WrapperInstance,
)
from stockade.sandbox.ops import Op, ReadFile, WriteFile
from stockade.tools.workspace_diff import BASELINE
from tests.conftest import require_tier

pytestmark = pytest.mark.process

EXAMPLE_POLICY = Path(__file__).parents[2] / "examples" / "policy.toml"
runner = CliRunner()


class FailsModelsRead(WrapperInstance):
    """The real sandbox, except that the model's first read of ``path`` fails as a busy host
    would: the second read of it after the run's baseline is written (before it, the run's
    baseline hashes every file; after it, the run store reads the file first)."""

    def __init__(self, wrapped: Instance, path: str) -> None:
        super().__init__(wrapped)
        self.path, self.armed, self.reads = path, False, 0

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        if isinstance(op, WriteFile) and op.path == BASELINE:
            self.armed = True
        elif isinstance(op, ReadFile) and op.path == self.path and self.armed:
            self.reads += 1
            if self.reads == 2:
                raise ResourceContention("injected: the host is busy")
        return self.wrapped.handle(op, sink)


class FlakyBackend(WrapperBackend):
    def __init__(self, wrapped: Backend, path: str) -> None:
        super().__init__(wrapped)
        self.path = path

    def start(self, spec: SandboxSpec) -> Instance:
        return FailsModelsRead(self.wrapped.start(spec), self.path)


def test_a_retried_read_is_in_the_run_store_and_the_verified_audit_trail(tmp_path: Path) -> None:
    require_tier("process")
    workspace = tmp_path / "project"
    (workspace / "build").mkdir(parents=True)
    (workspace / "build" / "log.txt").write_text("compiled 3 files\n")
    db = tmp_path / "audit.db"  # the run tables live in the audit database, as the CLI expects
    model = ScriptedModel([tool_call("read_file", {"path": "build/log.txt"}), "read it"])
    with open_run_store(f"sqlite:///{db}") as runs:
        config = AgentConfig(
            model=model,
            policy=EXAMPLE_POLICY,
            backend=FlakyBackend(_registry.backend("process"), "build/log.txt"),
            audit=f"sqlite:///{db}",
            checkpointer=runs,
            limits=RunLimits(max_steps=4),
            retry=RetryPolicy(wait_initial=0.01, wait_jitter=0),
            approval_dir=tmp_path / "approvals",
            kill_target=str(tmp_path / "kill"),
        )
        with build_agent(config) as agent:
            result = agent.run_sync("read the build log", workspace=workspace, run_id="flaky-read")
    assert result.ok, result.state.error
    assert "compiled 3 files" in result.steps[0].tool_calls[0].observation  # the retry succeeded

    shown = runner.invoke(app, ["runs", "show", "flaky-read", "--db", f"sqlite:///{db}", "--json"])
    assert shown.exit_code == 0, shown.output
    (call,) = json.loads(shown.output)["steps"][0]["tool_calls"]
    (retry,) = call["retries"]
    assert call["tool"] == "read_file" and retry["attempt"] == 1
    assert retry["reason"] == "ResourceContention: injected: the host is busy"

    with SQLiteStore(db) as store:
        retries = [e for e in store.events(run_id="flaky-read") if e.kind is EventKind.RETRY]
    assert len(retries) == 1 and "injected" in json.dumps(retries[0].attributes)

    verified = runner.invoke(app, ["audit", "verify", "--db", f"sqlite:///{db}"])
    assert verified.exit_code == 0, verified.output
    assert "intact" in verified.output
