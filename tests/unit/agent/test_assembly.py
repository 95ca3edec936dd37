"""``build_agent`` over the shipped fakes: trust fails closed, each layer is in its place, and
every decision lands in the audit trail."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import JsonValue

from stockade.agent import RunLimits, RunStatus
from stockade.assembly import AgentConfig, build_agent, effective_trust
from stockade.assembly.approvals import AuditedApprovals
from stockade.audit import AuditLog, MemoryStore
from stockade.exceptions import ApprovalDecided, ApprovalRequired, PolicyDenied, TierUnavailable
from stockade.models import FunctionModel, Model, ModelRequest, ModelResponse, ScriptedModel, tool_call
from stockade.policy import Policy
from stockade.policy.approval import ApprovalRequest, Approvals, ApprovalStore, Choice
from stockade.policy.schema import CommandRules, ModelRegistry, PathRules, TrustRules
from stockade.runtime.clock import ManualClock
from stockade.sandbox.ops import RunCommand, WriteFile
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.tools import Toolset, apply_patch, read_file, run_code, shell, write_file
from stockade.types import Trust

TRUSTED = TrustRules(level=Trust.TRUSTED)


def config(tmp_path: Path, model: Model, policy: Policy, **overrides: object) -> AgentConfig:
    base = AgentConfig(
        model=model,
        policy=policy,
        backend=FakeBackend(MemoryWorkspace(), tier="process"),
        audit=AuditLog(MemoryStore(), flush_interval_s=None),
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
        clock=ManualClock(),
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def kinds(log: AuditLog) -> list[str]:
    log.flush()
    return [e.kind.value for e in log.store.events()]


def test_a_caller_can_tighten_the_policys_trust_but_never_loosen_it() -> None:
    internal = Policy(trust=TrustRules(level=Trust.INTERNAL))
    assert effective_trust(internal, Trust.UNTRUSTED) is Trust.UNTRUSTED
    assert effective_trust(internal, Trust.TRUSTED) is Trust.INTERNAL
    assert effective_trust(internal, None) is Trust.INTERNAL


def test_a_backend_of_a_tier_trust_does_not_allow_fails_closed(tmp_path: Path) -> None:
    policy = Policy(trust=TrustRules(level=Trust.INTERNAL))  # LLM code: docker at least
    with pytest.raises(TierUnavailable, match="weaker than trust 'internal'"):
        build_agent(config(tmp_path, ScriptedModel(["hi"]), policy))


def test_a_model_outside_the_registry_is_refused_before_any_run(tmp_path: Path) -> None:
    policy = Policy(trust=TRUSTED, models=ModelRegistry(approved=("gpt-4.1*",)))
    log = AuditLog(MemoryStore(), flush_interval_s=None)
    with pytest.raises(PolicyDenied, match="not in the policy's registry"):
        build_agent(config(tmp_path, ScriptedModel(["hi"], name="unvetted"), policy, audit=log))
    refusals = [e.attributes for e in log.store.events() if e.kind.value == "policy_decision"]
    assert [(r["level"], r["rule"], r["action"]) for r in refusals] == [
        ("model", "models.approved", "model unvetted")
    ]


def test_a_model_that_serves_an_unapproved_model_is_refused_and_audited(tmp_path: Path) -> None:
    # the configured name passes the registry; the name the provider actually served does not
    def served(request: ModelRequest) -> ModelResponse:
        return ModelResponse(text="hi", model_name="unvetted")

    policy = Policy(trust=TRUSTED, models=ModelRegistry(approved=("gpt-4.1*",)))
    with build_agent(config(tmp_path, FunctionModel(served, name="gpt-4.1"), policy)) as agent:
        result = agent.run_sync("hi", run_id="r6")
        events = list(agent.audit_log.store.events(run_id="r6"))
    assert result.status == RunStatus.DENIED
    refusals = [e for e in events if e.kind.value == "policy_decision"]
    assert len(refusals) == 1 and refusals[0].step == 1
    assert refusals[0].attributes["level"] == "model" and refusals[0].attributes["rule"] == "models.approved"
    assert "unvetted" in str(refusals[0].attributes["reason"])


def test_an_op_the_call_level_cannot_see_is_denied_at_the_sandbox_and_audited(tmp_path: Path) -> None:
    policy = Policy(trust=TRUSTED, paths=PathRules(deny=("secrets/**",)))
    # the call-level guard does not look inside run_code's `files`: the sandbox guard does
    files: dict[str, JsonValue] = {"secrets/key": "stolen"}
    model = ScriptedModel(
        [tool_call("run_code", {"language": "python", "code": "1", "files": files}), "done"]
    )
    cfg = config(tmp_path, model, policy, tools=Toolset([run_code, write_file]))
    with build_agent(cfg) as agent:
        result = agent.run_sync("write", run_id="r1")
        backend = cfg.backend
        assert isinstance(backend, FakeBackend)
        writes = [op for op in backend.instances[0].ops if isinstance(op, WriteFile)]
        assert not any(op.path.startswith("secrets") for op in writes)
        assert "PolicyDenied" in result.steps[0].tool_calls[0].observation
        events = list(agent.audit_log.store.events(run_id="r1"))
    denials = [e for e in events if e.kind.value == "policy_decision"]
    assert denials and denials[0].attributes["level"] == "sandbox"
    assert str(denials[0].attributes["rule"]).startswith("paths.")
    # under the call whose op it refused (it said step 0 and no call: found from outside)
    (call,) = [e for e in events if e.kind.value == "tool_call"]
    assert (denials[0].step, denials[0].attributes["call_id"]) == (1, call.attributes["call_id"])


def test_an_approval_given_on_the_callback_covers_the_calls_sandbox_op_once(tmp_path: Path) -> None:
    asked = []

    def approver(request: object) -> Choice:
        asked.append(request)
        return Choice.APPROVED

    policy = Policy(trust=TRUSTED, commands=CommandRules(approve=("git push",)))
    model = ScriptedModel([tool_call("shell", {"command": "git push origin main"}), "pushed"])
    cfg = config(tmp_path, model, policy, tools=Toolset([shell]), approver=approver)
    with build_agent(cfg) as agent:
        result = agent.run_sync("push", run_id="r2")
        assert result.status == RunStatus.SUCCESS
        backend = cfg.backend
        assert isinstance(backend, FakeBackend)
        ran = [op.argv for op in backend.instances[0].ops if isinstance(op, RunCommand)]
        assert ran == [("/bin/sh", "-c", "git push origin main")]
        assert len(asked) == 1  # the op-level guard did not ask again
        events = list(agent.audit_log.store.events(run_id="r2"))
    (approval,) = [e for e in events if e.kind.value == "approval"]
    (call,) = [e for e in events if e.kind.value == "tool_call"]
    assert approval.attributes["outcome"] == "approved"
    assert (approval.step, approval.attributes["call_id"]) == (1, call.attributes["call_id"])


def test_runtime_refusals_and_budgets_are_audited_under_the_run(tmp_path: Path) -> None:
    model = ScriptedModel([tool_call("shell", {"command": "echo again"})] * 4 + ["done"])
    cfg = config(
        tmp_path, model, Policy(trust=TRUSTED), tools=Toolset([shell]), rate_per_minute=2,
        limits=RunLimits(max_steps=3), anomaly=False,
    )  # fmt: skip
    with build_agent(cfg) as agent:
        result = agent.run_sync("loop", run_id="r3")
        assert result.status == RunStatus.MAX_STEPS
        events = list(agent.audit_log.store.events(run_id="r3"))
    limited = [e for e in events if e.kind.value == "rate_limited"]
    assert len(limited) == 1 and limited[0].attributes["limit"] == "rate"
    assert {"sandbox_start", "sandbox_stop", "run_start", "run_end"} <= {e.kind.value for e in events}


def test_a_policy_that_restricts_reads_does_not_break_the_runs_own_diff(tmp_path: Path) -> None:
    # The model may only touch src/; the run's baseline and diff are its own bookkeeping.
    policy = Policy(trust=TRUSTED, paths=PathRules(read=("src/**",), write=("src/**",), deny=("secrets/**",)))
    workspace = MemoryWorkspace(files={"src/app.py": b"x = 1\n", "secrets/key": b"hunter2\n"})
    model = ScriptedModel(
        [
            tool_call("write_file", {"path": "src/app.py", "content": "x = 2\n"}),
            tool_call("read_file", {"path": "secrets/key"}),
            "done",
        ]
    )
    cfg = config(
        tmp_path, model, policy, backend=FakeBackend(workspace, tier="process"),
        tools=Toolset([write_file, read_file]),
    )  # fmt: skip
    with build_agent(cfg) as agent:
        result = agent.run_sync("edit", run_id="r4")
        events = list(agent.audit_log.store.events(run_id="r4"))
    assert result.status == RunStatus.SUCCESS, result.error
    assert "-x = 1\n+x = 2\n" in result.diff and "secrets" not in result.diff
    assert result.steps[1].tool_calls[0].denied  # the model's own reads are still ruled
    denials = [e.attributes for e in events if e.kind.value == "policy_decision"]
    assert [d["tool"] for d in denials] == ["read_file"]  # the bookkeeping was never denied


@pytest.mark.parametrize(
    ("diff", "path"),
    [
        ("--- /dev/null\n+++ b/secrets/key\n@@ -0,0 +1 @@\n+stolen\n", "secrets/key"),  # created
        ("--- a/secrets/key\n+++ /dev/null\n@@ -1 +0,0 @@\n-hunter2\n", "secrets/key"),  # deleted
        ("--- a/secrets/key\n+++ b/src/key\n@@ -1 +1 @@\n-hunter2\n+hunter2\n", "secrets/key"),  # moved
        ("--- a/src/app.py\n+++ b/secrets/app.py\n@@ -1 +1 @@\n-x = 1\n+x = 1\n", "secrets/app.py"),  # into
        ("--- a/src/app.py\n+++ b/src/app.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
         "--- a/../up.py\n+++ b/../up.py\n@@ -1 +1 @@\n-a\n+b\n", "../up.py"),  # second file escapes
    ],
)  # fmt: skip
def test_every_path_a_patch_touches_is_judged_before_anything_happens(
    tmp_path: Path, diff: str, path: str
) -> None:
    policy = Policy(trust=TRUSTED, paths=PathRules(deny=("secrets/**",)))
    workspace = MemoryWorkspace(files={"src/app.py": b"x = 1\n", "secrets/key": b"hunter2\n"})
    model = ScriptedModel([tool_call("apply_patch", {"diff": diff}), "done"])
    backend = FakeBackend(workspace, tier="process")
    cfg = config(tmp_path, model, policy, backend=backend, tools=Toolset([apply_patch]))
    with build_agent(cfg) as agent:
        result = agent.run_sync("patch", run_id="r5")
        events = list(agent.audit_log.store.events(run_id="r5"))
    record = result.steps[0].tool_calls[0]
    assert record.denied and path in record.observation
    project = {k: v for k, v in workspace.files.items() if not k.startswith(".stockade/")}
    assert project == {"src/app.py": b"x = 1\n", "secrets/key": b"hunter2\n"}
    denials = [e.attributes for e in events if e.kind.value == "policy_decision"]
    assert [d.get("level", "call") for d in denials] == ["call"]  # the model heard it from the guard


def test_an_assembled_run_keeps_its_starting_workspace_for_replay(tmp_path: Path) -> None:
    from stockade.runs import open_run_store

    seed = tmp_path / "project"
    seed.mkdir()
    (seed / "app.py").write_text("print('v1')\n")
    store = open_run_store(f"sqlite:///{tmp_path / 'runs.db'}")
    cfg = config(tmp_path, ScriptedModel(["done"]), Policy(trust=TRUSTED), checkpointer=store)
    with build_agent(cfg) as agent:
        result = agent.run_sync("look", workspace=seed)
    (seed / "app.py").write_text("print('changed after the run')\n")
    restored = tmp_path / "restored"
    store.restore_seed(result.run_id, restored)
    assert (restored / "app.py").read_text() == "print('v1')\n"


def test_an_assembled_run_keeps_what_it_ran_under_and_a_seed_without_what_it_hid(tmp_path: Path) -> None:
    from stockade.runs import open_run_store
    from stockade.runs.replay import policy_file_changed

    seed = tmp_path / "project"
    (seed / "secrets").mkdir(parents=True)
    (seed / "app.py").write_text("print('v1')\n")
    (seed / ".env").write_text("SECRET=hunter2\n")
    (seed / "secrets" / "key").write_text("hunter2\n")
    policy = tmp_path / "policy.toml"
    policy.write_text('version = 1\n[trust]\nlevel = "internal"\n[paths]\ndeny = [".env", "secrets/**"]\n')
    store = open_run_store(f"sqlite:///{tmp_path / 'runs.db'}")
    backend = FakeBackend(MemoryWorkspace(), tier="microvm")
    cfg = config(tmp_path, ScriptedModel(["done"]), Policy(), checkpointer=store, backend=backend)
    with build_agent(replace(cfg, policy=policy, trust=Trust.UNTRUSTED, tier=None)) as agent:
        agent.run_sync("look", workspace=seed, run_id="kept")
    assert agent.tier == "microvm"  # a fake of it
    setup = store.setup("kept")
    assert setup is not None and setup.tier == "microvm" and setup.role is None
    assert setup.policy.trust.level is Trust.UNTRUSTED  # the caller's tightening is kept with it
    assert setup.policy.paths.deny == (".env", "secrets/**")
    assert setup.policy_file == str(policy.resolve()) and policy_file_changed(setup) is None
    policy.write_text(policy.read_text().replace('".env", ', ""))
    assert "has changed since the run" in (policy_file_changed(setup) or "")
    restored = tmp_path / "restored"
    assert store.restore_seed("kept", restored)
    assert sorted(p.name for p in restored.rglob("*")) == ["app.py"]  # no .env, no secrets/
    assert store.erase(["kept"]) == 1 and store.setup("kept") is None
    store.close()


def test_runs_are_recorded_where_the_audit_trail_goes_unless_told_not_to(tmp_path: Path) -> None:
    from stockade.runs import open_run_store

    db = f"sqlite:///{tmp_path / 'audit.db'}"
    policy = Policy(trust=TRUSTED)
    with build_agent(config(tmp_path, ScriptedModel(["done"]), policy, audit=db)) as agent:
        agent.run_sync("say done", run_id="recorded")
    unrecorded = config(tmp_path, ScriptedModel(["done"]), policy, audit=db, record_runs=False)
    with build_agent(unrecorded) as agent:
        agent.run_sync("say done", run_id="unrecorded")
    with open_run_store(db) as store:
        assert [s.run_id for s in store.runs()] == ["recorded"]
        assert store.summary("recorded").status == RunStatus.SUCCESS  # type: ignore[union-attr]


def test_a_configuration_error_creates_no_audit_database(tmp_path: Path) -> None:
    from stockade.exceptions import ConfigurationError

    db = tmp_path / "records" / "audit.db"
    bad = config(tmp_path, ScriptedModel(["x"]), Policy(trust=TRUSTED), audit=f"sqlite:///{db}")
    with pytest.raises(ConfigurationError):
        build_agent(replace(bad, model="nope:x"))
    assert not db.exists() and not db.parent.exists()


class _BookTheRunReadsAtOnce(ApprovalStore):
    """A book whose ``decide`` lets the run read the decision the moment it is written, before
    the decider goes on: the run's ``require`` on another thread, run to its end."""

    run_asks: Callable[[], None] = staticmethod(lambda: None)

    def decide(self, run_id: str, request_id: str, choice: Choice, *, by: str = "") -> None:
        super().decide(run_id, request_id, choice, by=by)
        asker = threading.Thread(target=self.run_asks)
        asker.start()
        asker.join()


def test_a_decision_the_run_reads_while_it_is_being_made_is_recorded_once(tmp_path: Path) -> None:
    """``decide`` wrote the book, then marked the decision as its own to record: a run reading
    it in between recorded it too (two decision events), and the mark left behind kept the
    next decision of that request out of the trail. The mark comes first now."""
    log = AuditLog(MemoryStore(), flush_interval_s=None)
    book = _BookTheRunReadsAtOnce(tmp_path / "approvals")
    approvals = AuditedApprovals(Approvals(store=book), log)
    request = ApprovalRequest(run_id="r1", action="run `rm -r build`", rule="rm -r", reason="asks")
    with pytest.raises(ApprovalRequired):
        approvals.require(request)
    book.run_asks = lambda: approvals.require(request)
    approvals.decide(request, Choice.APPROVED, by="alice")
    log.flush()
    outcomes = [e.attributes["outcome"] for e in log.store.events(run_id="r1") if e.kind.value == "approval"]
    assert outcomes == ["pending", "approved"]


def test_a_decision_refused_by_the_book_leaves_the_next_one_to_the_run_to_record(tmp_path: Path) -> None:
    """A ``decide`` the book refuses (the request waits for no decision) records nothing, and
    leaves no mark: the request's next decision, made elsewhere (``stockade approve``), is
    recorded by the run that reads it."""
    log = AuditLog(MemoryStore(), flush_interval_s=None)
    book = ApprovalStore(tmp_path / "approvals")
    approvals = AuditedApprovals(Approvals(store=book), log)
    request = ApprovalRequest(run_id="r1", action="run `rm -r build`", rule="rm -r", reason="asks")
    with pytest.raises(ApprovalRequired):
        approvals.require(request)
    approvals.decide(request, Choice.APPROVED, by="alice")
    approvals.require(request)  # the yes spent
    with pytest.raises(ApprovalDecided):
        approvals.decide(request, Choice.APPROVED, by="alice")
    with pytest.raises(ApprovalRequired):
        approvals.require(request)  # asked anew
    book.decide("r1", approvals.keyed(request).id, Choice.DENIED, by="bob")
    with pytest.raises(PolicyDenied):
        approvals.require(request)
    log.flush()
    outcomes = [e.attributes["outcome"] for e in log.store.events(run_id="r1") if e.kind.value == "approval"]
    assert outcomes == ["pending", "approved", "pending", "denied"]
