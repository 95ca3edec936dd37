"""The runtime controls against real sandboxes, black-box: a scripted model and a policy file;
judged by the run's result, its audit trail, its run store and the host.

- code that really raises, five times in a row, stops the run "broken";
- an anomaly rule that says kill isolates the run: the sandbox's processes are gone, its
  workspace is in the run store for review, and ``stockade runs show`` says which rule fired;
- a declared compliance profile runs on the microVM, the only tier it allows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from stockade.agent import RunStatus
from stockade.assembly import AgentConfig, build_agent
from stockade.audit import SQLiteStore
from stockade.cli.main import app
from stockade.models import ScriptedModel, tool_call
from stockade.runs import open_run_store
from stockade.tools import default_toolset, shell
from tests.conftest import host_processes, require_tier

TRUSTED = 'version = 1\n[trust]\nlevel = "trusted"\n'
RAISE = tool_call("run_code", {"language": "python", "code": "import json; json.loads('{')"})


def policy(tmp_path: Path, text: str) -> Path:
    file = tmp_path / "policy.toml"
    file.write_text(text)
    return file


def config(tmp_path: Path, model: ScriptedModel, text: str, **fields: object) -> AgentConfig:
    return AgentConfig(
        model=model,
        policy=policy(tmp_path, text),
        audit=f"sqlite:///{tmp_path / 'audit.db'}",
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
        **fields,  # type: ignore[arg-type]
    )


@pytest.mark.process
def test_real_code_that_keeps_raising_breaks_the_run(tmp_path: Path) -> None:
    require_tier("process")
    model = ScriptedModel([RAISE] * 7 + ["done"])
    with build_agent(
        config(tmp_path, model, TRUSTED + "[anomaly]\nenabled = false\n", tier="process")
    ) as agent:
        result = agent.run_sync("parse it", run_id="real-broken")
    assert result.status == RunStatus.BROKEN
    assert result.error is not None and result.error.count("JSONDecodeError") == 5
    assert len(model.requests) == 5
    with open_run_store(f"sqlite:///{tmp_path / 'audit.db'}") as store:
        summary = store.summary("real-broken")
        assert summary is not None and summary.status == RunStatus.BROKEN
        assert [c.failed for c in store.tool_calls("real-broken")] == [True] * 5
    with SQLiteStore(tmp_path / "audit.db") as audit:
        changes = [
            e.attributes for e in audit.events(run_id="real-broken") if e.kind.value == "breaker_change"
        ]
    assert [(c["name"], c["new"]) for c in changes] == [("agent", "open")]


KILL_ON_REPEAT = TRUSTED + '[anomaly.repeated_failure]\ntimes = 2\naction = "kill"\n'


@pytest.mark.process
def test_a_kill_rule_isolates_a_real_run(tmp_path: Path) -> None:
    require_tier("process")
    # a process that outlives its call (setsid: out of the call's process group)
    background = tool_call(
        "shell", {"command": "setsid sleep 3171 >/dev/null 2>&1 < /dev/null & echo started"}
    )
    evidence = tool_call("write_file", {"path": "evidence.txt", "content": "kept for review\n"})
    model = ScriptedModel([evidence, background, RAISE, RAISE, RAISE, "done"])
    cfg = config(tmp_path, model, KILL_ON_REPEAT, tier="process", tools=default_toolset().including(shell))
    with build_agent(cfg) as agent:
        result = agent.run_sync("parse it", run_id="real-incident")
    assert "started" in result.steps[1].tool_calls[0].observation
    assert host_processes(b"sleep\x003171") == []  # the sandbox died, with what it had started
    assert result.status == RunStatus.KILLED
    assert "anomaly rule 'repeated_failure' fired" in (result.error or "")
    db = f"sqlite:///{tmp_path / 'audit.db'}"
    shown = CliRunner().invoke(app, ["runs", "show", "real-incident", "--db", db])
    assert shown.exit_code == 0 and "incident" in shown.output and "repeated_failure" in shown.output
    kept = tmp_path / "review"
    exported = CliRunner().invoke(app, ["runs", "workspace", "real-incident", str(kept), "--db", db])
    assert exported.exit_code == 0, exported.output
    assert (kept / "evidence.txt").read_text() == "kept for review\n"


COMPLIANT = """\
version = 1
[compliance]
profiles = ["hipaa"]
[roles.clinician]
tools = ["run_code"]
[[data]]
paths = ["records/**"]
tier = "restricted"
[data_access.restricted]
read = ["clinician"]
write = ["clinician"]
"""


@pytest.mark.slow
def test_a_declared_profile_runs_on_the_microvm(tmp_path: Path) -> None:
    require_tier("microvm")
    model = ScriptedModel([tool_call("run_code", {"language": "python", "code": "print(6 * 7)"}), "42"])
    cfg = config(tmp_path, model, COMPLIANT, role="clinician", audit_key=b"k" * 32)
    with build_agent(cfg) as agent:
        assert agent.tier == "microvm"
        result = agent.run_sync("compute", run_id="on-microvm")
    assert result.status == RunStatus.SUCCESS and result.tier == "microvm"
    assert "42" in result.steps[0].tool_calls[0].observation


@pytest.mark.process
def test_the_readme_runtime_controls_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    require_tier("process")
    root = Path(__file__).parents[2]
    text = (root / "README.md").read_text()
    block = text.split("## Runtime controls", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "examples").symlink_to(root / "examples")
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.startswith("broken CircuitBroken: the agent's last 3 actions failed in a row"), printed
