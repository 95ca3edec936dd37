"""``build_agent`` end to end on the real process tier, from the shipped example policy.

One scripted run tries a denied command (it never reaches the sandbox), then one that needs
approval (the run pauses, a human approves, it resumes and the command runs); another run
crosses its dollar budget; afterwards the audit chain verifies and holds every kind of event.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from stockade.agent import RunLimits, RunStatus
from stockade.assembly import AgentConfig, build_agent
from stockade.audit import AuditLog, SQLiteStore, verify
from stockade.models import ScriptedModel, tool_call
from stockade.models.messages import ModelRequest, ModelResponse, ToolCall, Usage
from stockade.models.scripted import FunctionModel
from stockade.policy import ApprovalStore, Choice, Policy, load_policy
from stockade.policy.schema import CommandRules, TrustRules
from stockade.tools import default_toolset, shell
from stockade.types import Trust
from tests.conftest import require, require_tier

pytestmark = pytest.mark.process

EXAMPLE_POLICY = Path(__file__).parents[2] / "examples" / "policy.toml"


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "scratch").mkdir(parents=True)
    (root / "scratch" / "stale.o").write_text("old object file\n")
    (root / "app.py").write_text("print('hello')\n")
    return root


def config(
    tmp_path: Path, model: ScriptedModel, log: AuditLog, limits: RunLimits | None = None
) -> AgentConfig:
    return AgentConfig(
        model=model,
        policy=EXAMPLE_POLICY,
        tier="process",
        audit=log,
        limits=limits or RunLimits(max_steps=10),
        tools=default_toolset().including(shell),
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
    )


def test_the_example_policy_loads_and_says_what_the_readme_says() -> None:
    policy = load_policy(EXAMPLE_POLICY)
    assert policy.trust.level is Trust.TRUSTED
    assert "curl" in policy.commands.deny and "rm -r" in policy.commands.approve
    assert not policy.network.enabled
    assert policy.models.allows("gpt-4.1", "openai") and not policy.models.allows("gpt-4.1", "elsewhere")
    assert not policy.models.allows("some-unvetted-model", "openai")


def test_denied_never_runs_approval_pauses_then_resumes_budget_stops_and_the_chain_verifies(
    tmp_path: Path, workspace: Path
) -> None:
    require_tier("process")
    store = SQLiteStore(tmp_path / "audit.db")
    log = AuditLog(store, flush_interval_s=None)
    model = ScriptedModel(
        [
            tool_call("shell", {"command": "curl -s https://example.com -o loot; touch pwned"}),
            tool_call("shell", {"command": "rm -r scratch"}),
            tool_call("list_files", {"path": "."}),
            "cleaned the scratch folder",
        ]
    )
    approvals = ApprovalStore(tmp_path / "approvals")
    with build_agent(config(tmp_path, model, log)) as agent:
        with agent.session(workspace=workspace, run_id="cleanup") as session:
            paused = session.run_sync("clean the scratch folder")
            assert paused.status == RunStatus.PAUSED
            assert session.sandbox.files.exists("scratch/stale.o")  # not yet: it waits for a human
            assert not session.sandbox.files.exists("pwned")  # the denied command never ran

            (request,) = approvals.pending("cleanup")
            assert "rm -r scratch" in request["action"]
            approvals.decide("cleanup", request["id"], Choice.APPROVED, by="alice")

            done = session.resume_sync()
            assert done.status == RunStatus.SUCCESS, done.error
            assert not session.sandbox.files.exists("scratch")
        assert "-old object file" in done.diff

        budget_model = ScriptedModel(
            [
                ModelResponse(
                    tool_calls=(tool_call("list_files", {"path": "."}),),
                    usage=Usage(input_tokens=2_000, output_tokens=500, requests=1),
                )
            ]
            * 5
            + ["never reached"],
            name="gpt-4.1",
        )  # $0.008 a turn at gpt-4.1's price
    with build_agent(
        config(tmp_path, budget_model, log, RunLimits(max_steps=10, max_cost_usd=0.015))
    ) as agent:
        over = agent.run_sync("look around", workspace=workspace, run_id="spender")
    assert over.status == RunStatus.BUDGET and len(over.steps) == 2

    report = verify(store)
    assert report.ok, report.problems
    events = list(store.events(run_id="cleanup"))
    kinds = Counter(e.kind.value for e in events)
    for kind in ("run_start", "model_call", "tool_call", "policy_decision", "approval", "command"):
        assert kinds[kind] >= 1, (kind, kinds)
    assert kinds["sandbox_start"] == 1 and kinds["sandbox_stop"] == 1
    commands = [e.attributes["argv"] for e in events if e.kind.value == "command"]
    assert all("curl" not in " ".join(argv) for argv in commands)  # type: ignore[arg-type]
    outcomes = [e.attributes["outcome"] for e in events if e.kind.value == "approval"]
    assert outcomes[0] == "pending" and "approved" in outcomes
    assert [e.attributes["status"] for e in store.events(run_id="spender") if e.kind.value == "run_end"] == [
        "budget"
    ]
    store.close()


def test_a_yes_lets_its_action_go_once_and_the_same_action_later_is_asked_again(
    tmp_path: Path, workspace: Path
) -> None:
    """A human approves `rm -r scratch`: it runs. The model makes the folder again and asks for
    the same `rm -r scratch`: a new question (the same request id, pending again), which the
    human refuses, and the new folder stays. Before, the first yes stood for the rest of the
    run: the second removal ran unasked."""
    require_tier("process")
    store = SQLiteStore(tmp_path / "audit.db")
    removal = tool_call("shell", {"command": "rm -r scratch"})
    remade = tool_call("shell", {"command": "mkdir scratch && touch scratch/new.o"})
    model = ScriptedModel([removal, remade, removal, "kept the new scratch folder"])
    approvals = ApprovalStore(tmp_path / "approvals")
    agent = build_agent(config(tmp_path, model, AuditLog(store, flush_interval_s=None)))
    with agent, agent.session(workspace=workspace, run_id="twice") as session:
        assert session.run_sync("clean up").status == RunStatus.PAUSED
        (first,) = approvals.pending("twice")
        approvals.decide("twice", first["id"], Choice.APPROVED, by="alice")
        again = session.resume_sync()
        assert again.status == RunStatus.PAUSED, again.error
        assert session.sandbox.files.exists("scratch/new.o"), "not removed unasked"
        (second,) = approvals.pending("twice")
        assert second["id"] == first["id"] and second["action"] == first["action"]
        approvals.decide("twice", second["id"], Choice.DENIED, by="bob")
        done = session.resume_sync()
        assert done.status == RunStatus.SUCCESS, done.error
        assert session.sandbox.files.exists("scratch/new.o")
    outcomes = [e.attributes["outcome"] for e in store.events(run_id="twice") if e.kind.value == "approval"]
    assert outcomes == ["pending", "approved", "pending", "denied"]
    assert verify(store).ok
    store.close()


def test_an_exec_refused_for_want_of_a_decision_is_withdrawn_when_its_run_ends(
    tmp_path: Path, workspace: Path
) -> None:
    """Code runs `rm -r` inside the sandbox; nobody can decide now, so the exec is refused on
    the spot and the run goes on to its end. The request stayed pending for good: `stockade
    approvals` offered it, and a yes to it said the run would continue, which had ended
    (found from outside). A run that ends for good withdraws what nobody decided."""
    require_tier("process")
    store = SQLiteStore(tmp_path / "audit.db")
    code = "import subprocess; print(subprocess.run(['rm', '-r', 'scratch']).returncode)"
    model = ScriptedModel([tool_call("run_code", {"language": "python", "code": code}), "left it"])
    approvals = ApprovalStore(tmp_path / "approvals")
    with build_agent(config(tmp_path, model, AuditLog(store, flush_interval_s=None))) as agent:
        done = agent.run_sync("clean up", workspace=workspace, run_id="execs")
    assert done.status == RunStatus.SUCCESS, done.error
    assert "-old object file" not in done.diff  # the folder was not removed
    assert approvals.pending("execs") == []
    (kept,) = approvals.requests("execs")
    assert "rm -r scratch" in kept["action"] and kept["status"] == "denied"
    outcomes = [e.attributes["outcome"] for e in store.events(run_id="execs") if e.kind.value == "approval"]
    assert outcomes == ["pending", "withdrawn"]
    assert verify(store).ok
    store.close()


def test_a_yes_to_an_exec_shown_masked_is_spent_by_that_exec_alone(tmp_path: Path, workspace: Path) -> None:
    """Code runs `rm -r keep_token=SHOWN1234`: the human is shown its value masked and says yes.
    The code then runs `rm -r keep_token=OTHER5678`, shown alike. Its request had the same id
    (derived from the text shown), so it spent the yes and removed the folder nobody was asked
    about, and the one approved stayed (found from outside). Now each is a question of its own."""
    require_tier("process")
    shown, other = "keep_token=SHOWN1234", "keep_token=OTHER5678"
    for name in (shown, other):
        (workspace / name).mkdir()

    def removal(name: str) -> ToolCall:
        code = f"import subprocess; subprocess.run(['rm', '-r', {name!r}])"
        return tool_call("run_code", {"language": "python", "code": code})

    script = ScriptedModel([removal(shown), removal(other), removal(shown), "done"])
    approvals = ApprovalStore(tmp_path / "approvals")

    async def human_between_steps(request: ModelRequest) -> ModelResponse:
        if len(script.requests) == 1:  # the first exec was refused, waiting: a human says yes
            (asked,) = approvals.pending("masked")
            approvals.decide("masked", asked["id"], Choice.APPROVED, by="alice")
        return await script.request(request)

    store = SQLiteStore(tmp_path / "audit.db")
    configured = config(tmp_path, ScriptedModel([]), AuditLog(store, flush_interval_s=None))
    policy = Policy(trust=TrustRules(level=Trust.TRUSTED), commands=CommandRules(approve=("rm -r",)))
    model = FunctionModel(human_between_steps)
    agent = build_agent(dataclasses.replace(configured, model=model, policy=policy))
    with agent, agent.session(workspace=workspace, run_id="masked") as session:
        done = session.run_sync("clean up")
        assert done.status == RunStatus.SUCCESS, done.error
        assert not session.sandbox.files.exists(shown), "the folder approved is removed"
        assert session.sandbox.files.exists(other), "not removed under another exec's yes"
    first, second = sorted(approvals.requests("masked"), key=lambda r: int(r["asked_ns"]))
    assert first["action"] == second["action"] == "run `rm -r 'keep_token=[REDACTED:assignment]'`"
    assert first["id"] != second["id"]
    assert (first["status"], second["status"]) == ("spent", "denied")  # the other, withdrawn at the end
    kept = b"".join(p.read_bytes() for p in (tmp_path / "approvals").rglob("*.json"))
    assert b"SHOWN1234" not in kept and b"OTHER5678" not in kept
    store.close()


def test_code_that_asks_for_ever_new_approvals_fills_the_runs_requests_once_and_no_more(
    tmp_path: Path, workspace: Path
) -> None:
    """Code loops over distinct `rm -r X$i` execs, each refused on the spot for want of a
    decision. Each was kept as a request and recorded twice in the trail (2,000 in 21 s over
    the service, every read of the run returning them all). The run keeps at most
    `max_pending_approvals` pending; past them an exec is refused and kept nowhere, and the
    trail says once that the run's requests were full (each exec stays in it as an exec)."""
    require_tier("process")
    store = SQLiteStore(tmp_path / "audit.db")
    code = (
        "import subprocess\n"
        "refused = 0\n"
        "for i in range(12):\n"
        "    try:\n"
        "        subprocess.run(['rm', '-r', f'scratch{i}'])\n"
        "    except PermissionError:\n"
        "        refused += 1\n"
        "print('refused', refused)"
    )
    model = ScriptedModel([tool_call("run_code", {"language": "python", "code": code}), "left it"])
    approvals = ApprovalStore(tmp_path / "approvals")
    limits = RunLimits(max_steps=10, max_pending_approvals=5)
    with build_agent(config(tmp_path, model, AuditLog(store, flush_interval_s=None), limits)) as agent:
        done = agent.run_sync("clean up", workspace=workspace, run_id="flood")
    assert done.status == RunStatus.SUCCESS, done.error
    assert "refused 12" in str(model.requests[-1].messages[-1])
    kept = approvals.requests("flood")
    assert sorted(r["action"] for r in kept) == [f"run `rm -r scratch{i}`" for i in range(5)]
    outcomes = Counter(
        e.attributes["outcome"] for e in store.events(run_id="flood") if e.kind.value == "approval"
    )
    assert outcomes == {"pending": 5, "full": 1, "withdrawn": 5}
    assert verify(store).ok
    store.close()


def test_what_the_policy_keeps_out_is_not_in_the_repositorys_history_either(tmp_path: Path) -> None:
    """A secret the policy denies (`secrets/**`, `.env`) but the repository once committed was
    read back through its history: `git show HEAD:secrets/key` from code, and the git_diff
    tool, which showed it as a deleted file. Under rules that keep files out, `.git` stays
    out with them, and the diff is against the run's start."""
    require_tier("process")
    git = shutil.which("git")
    require("git", git is not None, "git is not installed on this host")
    assert git is not None
    root = tmp_path / "repo"
    (root / "secrets").mkdir(parents=True)
    (root / "secrets" / "key").write_text("TOPSECRET-KEY\n")
    (root / ".env").write_text("PASSWORD=TOPSECRET-ENV\n")
    (root / "app.py").write_text("print('hello')\n")
    env = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(tmp_path),
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@x"}  # fmt: skip
    nested = root / "vendor" / "lib"  # a repository of its own inside: its history too
    nested.mkdir(parents=True)
    (nested / "secret.pem").write_text("TOPSECRET-PEM\n")
    (nested / "lib.py").write_text("x = 1\n")
    for repo in (nested, root):
        for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "all"]):
            subprocess.run([git, *argv], cwd=repo, env=env, check=True, capture_output=True)
    (nested / "secret.pem").unlink()  # only in its history now
    model = ScriptedModel(
        [
            tool_call("git_diff", {}),
            tool_call(
                "shell",
                {"command": "git show HEAD:secrets/key; git -C vendor/lib show HEAD:secret.pem; ls -a"},
            ),
            tool_call(
                "run_code", {"code": "import os; print(sorted(os.listdir('.')))", "language": "python"}
            ),
            "looked",
        ]
    )
    policy = tmp_path / "policy.toml"  # the example's, but for its own `.git/**` among the denied
    policy.write_text(EXAMPLE_POLICY.read_text().replace('deny = [".git/**", ', "deny = ["))
    assert '".git/**"' not in policy.read_text()
    log = AuditLog(SQLiteStore(tmp_path / "audit.db"), flush_interval_s=None)
    with build_agent(dataclasses.replace(config(tmp_path, model, log), policy=policy)) as agent:
        result = agent.run_sync("look at the history", workspace=root, run_id="history")
    told = [call.observation for step in result.steps for call in step.tool_calls]
    assert len(told) == 3 and "not a git repository" in told[0], told
    assert not any("TOPSECRET" in text for text in [*told, result.diff]), told
    assert ".git" not in told[2] and "app.py" in told[2]


def test_the_runs_diff_hands_back_no_file_the_policy_keeps_out(tmp_path: Path, workspace: Path) -> None:
    """Under `write = ["**"]` code could create `.env` and `secrets/x` (kept out, so absent):
    the run's diff carried them, and a host that applied it would overwrite its own."""
    require_tier("process")
    code = (
        "import os\nos.makedirs('secrets', exist_ok=True)\n"
        "for p in ('.env', 'secrets/x', 'ok.py'): open(p, 'w').write('PWNED=1\\n')"
    )
    model = ScriptedModel([tool_call("run_code", {"code": code, "language": "python"}), "wrote"])
    log = AuditLog(SQLiteStore(tmp_path / "audit.db"), flush_interval_s=None)
    with build_agent(config(tmp_path, model, log)) as agent:
        result = agent.run_sync("write", workspace=workspace, run_id="handback")
    assert "+++ b/ok.py" in result.diff, result.diff
    assert "b/.env" not in result.diff and "b/secrets" not in result.diff
    assert result.diff.endswith("or begins or ends with a space): '.env', 'secrets/x'\n")


def test_a_tier_weaker_than_trust_allows_fails_before_anything_runs(tmp_path: Path) -> None:
    from stockade.exceptions import TierUnavailable

    with pytest.raises(TierUnavailable, match="weaker than trust 'untrusted'"):
        build_agent(
            AgentConfig(
                model=ScriptedModel(["hi"]), policy=EXAMPLE_POLICY, trust=Trust.UNTRUSTED, tier="process"
            )
        )


def test_the_readme_agents_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    require_tier("process")
    root = Path(__file__).parents[2]
    text = (root / "README.md").read_text()
    block = text.split("## Agents", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "examples").symlink_to(root / "examples")
    (tmp_path / "src" / "stockade").mkdir(parents=True)
    (tmp_path / "src" / "stockade" / "demo").symlink_to(root / "src" / "stockade" / "demo")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STOCKADE_APPROVAL_DIR", str(tmp_path / "approvals"))
    monkeypatch.setenv("STOCKADE_KILL_DIR", str(tmp_path / "kill"))
    exec(compile(block, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    # the model said "all green"; the check ran the tests and said otherwise, as the README says
    assert printed.startswith("check_failed process unittest: 2 passed, 1 failed"), printed
    with SQLiteStore(tmp_path / ".stockade" / "audit.db") as store:
        assert verify(store).ok and store.head() is not None
    from typer.testing import CliRunner

    from stockade.cli.main import app

    listed = CliRunner().invoke(app, ["runs", "list"])  # the default store, from the same folder
    assert (
        listed.exit_code == 0 and "check_failed" in listed.output and "make the tests pass" in listed.output
    )


@pytest.mark.microvm  # the microVM's probe starts a guest
def test_trust_sets_the_minimum_and_the_cheapest_tier_that_meets_it_is_used(tmp_path: Path) -> None:
    from stockade import Sandbox
    from stockade.sandbox import _registry

    require_tier("process")
    # trusted code is allowed the process tier: no microVM for it unless asked to prefer strength
    with Sandbox.create(trust="trusted") as sbx:
        assert sbx.tier == "process"
    if _registry.probe("microvm").available:  # (probing docker-backed tiers starts containers)
        assert _registry.select_tier(Trust.TRUSTED, prefer="strongest") == "microvm"

    model = ScriptedModel(["nothing to do"])
    with build_agent(
        AgentConfig(
            model=model,
            policy=EXAMPLE_POLICY,  # trust = "trusted"
            approval_dir=tmp_path / "approvals",
            kill_target=str(tmp_path / "kill"),
        )
    ) as agent:
        assert agent.tier == "process" and "cheapest" in agent.tier_reason
        result = agent.run_sync("look")
    assert result.tier == "process" and result.ok


def test_the_acceptance_checks_commands_are_recorded_as_the_checks(tmp_path: Path) -> None:
    """What the check runs is no tool call's: its op_start events carried the id of the last
    call the model made (the context variable outlived the call), and `runs show` listed them
    under that call."""
    require_tier("process")
    from stockade.audit.sandbox import CHECK_CALL

    workspace = tmp_path / "project"
    workspace.mkdir()
    policy = tmp_path / "policy.toml"
    policy.write_text('[trust]\nlevel = "trusted"\n')
    db = tmp_path / "audit.db"
    config = AgentConfig(
        model=ScriptedModel([tool_call("run_tests", {"command": "echo model"}, id="t1"), "done"]),
        policy=policy,
        tier="process",
        audit=f"sqlite:///{db}",
        check="echo acceptance",
        keep_sandbox=False,
    )
    with build_agent(config) as agent:
        assert agent.run_sync("t", workspace=workspace, run_id="checked").status == RunStatus.SUCCESS
    store = SQLiteStore(db)
    started = {
        str(e.attributes.get("argv")): e.attributes.get("call_id")
        for e in store.events(run_id="checked")
        if e.kind.value == "op_start"
    }
    store.close()
    by_call = {call: [argv for argv, c in started.items() if c == call] for call in set(started.values())}
    assert any("echo model" in argv for argv in by_call.get("t1", [])), started
    assert any("echo acceptance" in argv for argv in by_call.get(CHECK_CALL, [])), started
    assert not any("echo acceptance" in argv for argv in by_call.get("t1", [])), started
