"""Compliance checkpoints, black-box: a policy file that declares profiles, ``build_agent`` that
refuses to start when one is not met, ``stockade policy check --compliance`` that says what and
how to fix it; the microVM as the minimum tier; GDPR's redaction, retention and erasure."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stockade.agent import RunStatus
from stockade.assembly import AgentConfig, build_agent
from stockade.audit import SQLiteStore
from stockade.audit.sealing import CLEAR
from stockade.cli.main import app
from stockade.exceptions import ComplianceNotMet, InvalidArgument, RunConflict, TierUnavailable
from stockade.models import ScriptedModel, tool_call
from stockade.policy import Policy, PolicyEngine, load_policy
from stockade.policy.compliance import PROFILES, Setup, check_compliance
from stockade.runs import open_run_store
from stockade.runtime.clock import ManualClock
from stockade.testing import FakeBackend, MemoryWorkspace

KEY = b"k" * 32

COMPLIANT = """\
version = 1
[compliance]
profiles = ["hipaa", "soc2", "gdpr"]
retention_days = 30

[roles.clinician]
tools = ["read_file", "write_file", "run_tests"]

[[data]]
paths = ["records/**"]
tier = "restricted"

[data_access.restricted]
read = ["clinician"]
write = ["clinician"]

[commands]
approve = ["git push", "kubectl apply", "terraform apply", "helm upgrade", "docker push"]

[risk]
high = "approve"
"""


def write(tmp_path: Path, text: str) -> Path:
    file = tmp_path / "policy.toml"
    file.write_text(text)
    return file


def setup(tmp_path: Path, model: ScriptedModel, policy: str, **overrides: object) -> AgentConfig:
    base = AgentConfig(
        model=model,
        policy=write(tmp_path, policy),
        role="clinician",
        backend=FakeBackend(MemoryWorkspace(), tier="microvm"),
        audit=f"sqlite:///{tmp_path / 'audit.db'}",
        audit_key=KEY,
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
        clock=ManualClock(),
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def test_a_compliant_setup_starts_on_the_microvm_and_records_what_gdpr_asks(tmp_path: Path) -> None:
    model = ScriptedModel(
        [tool_call("write_file", {"path": "records/17.txt", "content": "jane.doe@example.com\n"}), "noted"]
    )
    config = setup(tmp_path, model, COMPLIANT)
    with build_agent(config) as agent:
        assert agent.tier == "microvm"
        result = agent.run_sync("note jane.doe@example.com, +44 20 7946 0958", run_id="c1", subject="p-17")
    assert result.status == RunStatus.SUCCESS, result.error
    with SQLiteStore(tmp_path / "audit.db") as store:
        bodies = [row.body for row in store.rows()]
        opened = json.dumps([e.attributes for e in store.events(run_id="c1")])
    assert bodies and not any("jane.doe@example.com" in b or "7946 0958" in b for b in bodies)
    assert "[REDACTED:email]" in opened  # personal data redacted, then the run's events sealed
    assert "records/17.txt" in opened and not any("records/17.txt" in b for b in bodies)
    db = f"sqlite:///{tmp_path / 'audit.db'}"
    with open_run_store(db) as runs:
        assert runs.runs_of(subject="p-17") == ["c1"]
    keyless = CliRunner().invoke(app, ["runs", "erase", "--subject", "p-17", "--db", db])
    assert keyless.exit_code == 2 and "pass its key" in keyless.output  # the chain records erasures
    with open_run_store(db) as runs:
        assert runs.runs_of(subject="p-17") == ["c1"]  # and nothing was erased without it
    erased = CliRunner().invoke(
        app, ["runs", "erase", "--subject", "p-17", "--db", db], env={"STOCKADE_AUDIT_KEY": KEY.decode()}
    )
    assert erased.exit_code == 0 and "erased 1 run(s)" in erased.output, erased.output
    assert "the audit events of 1 sealed run(s) can no longer be read" in erased.output
    with open_run_store(db) as runs:
        assert runs.summary("c1") is None and runs.tool_calls("c1") == []
    with SQLiteStore(tmp_path / "audit.db") as store:  # what the events said is gone, they stay
        events = list(store.events(run_id="c1"))
    assert events and all(set(e.attributes) <= CLEAR | {"$erased"} for e in events)
    assert "records/17.txt" not in json.dumps([e.attributes for e in events])
    (tmp_path / "key").write_bytes(KEY)
    verified = CliRunner().invoke(app, ["audit", "verify", "--db", db, "--key-file", str(tmp_path / "key")])
    assert verified.exit_code == 0 and "intact" in verified.output, verified.output


def test_erasure_leaves_no_approval_behind_and_the_erased_run_id_stays_taken(tmp_path: Path) -> None:
    push = tool_call("run_tests", {"command": "git push origin patient-secret-18"})
    config = setup(tmp_path, ScriptedModel([push, "pushed"]), COMPLIANT)
    with build_agent(config) as agent:
        paused = agent.run_sync("push", run_id="c2", subject="p-18")
    assert paused.status == RunStatus.PAUSED, paused.error
    kept = [f.read_text() for f in (tmp_path / "approvals").rglob("*.json")]
    assert any("patient-secret-18" in text for text in kept)  # the request names the call
    db = f"sqlite:///{tmp_path / 'audit.db'}"
    erased = CliRunner().invoke(
        app,
        ["runs", "erase", "--subject", "p-18", "--db", db, "--approval-dir", str(tmp_path / "approvals")],
        env={"STOCKADE_AUDIT_KEY": KEY.decode()},
    )
    assert erased.exit_code == 0, erased.output
    assert not any("patient-secret-18" in f.read_text() for f in (tmp_path / "approvals").rglob("*.json"))
    with (
        build_agent(replace(config, model=ScriptedModel(["again"]))) as agent,
        pytest.raises(RunConflict) as taken,
    ):
        agent.run_sync("again", run_id="c2", subject="p-18")  # its old events keep the id
    assert "erased" in str(taken.value)


def test_a_run_id_the_redactor_would_change_is_refused(tmp_path: Path) -> None:
    """Under GDPR's redaction a run id like a phone number would be stored as
    ``order-[REDACTED:phone]``: two runs would share one id in the trail."""
    config = setup(tmp_path, ScriptedModel(["done"]), COMPLIANT)
    with build_agent(config) as agent, pytest.raises(InvalidArgument) as refused:
        agent.run_sync("task", run_id="order-555-123-4567")
    assert refused.value.argument == "run_id" and "redact" in str(refused.value)


def test_build_agent_refuses_to_start_when_a_declared_profile_is_not_met(tmp_path: Path) -> None:
    lax = COMPLIANT.replace('[risk]\nhigh = "approve"\n', "").replace("retention_days = 30\n", "")
    config = setup(
        tmp_path, ScriptedModel(["x"]), lax, audit_key=None, audit=f"sqlite:///{tmp_path / 'a.db'}"
    )
    with pytest.raises(ComplianceNotMet) as refused:
        build_agent(config)
    unmet = "\n".join(refused.value.unmet)
    assert "HIPAA §164.312(b)" in unmet and "plain SHA-256" in unmet and "audit_key" in unmet
    assert "GDPR Art. 5(1)(e)" in unmet and "retention_days" in unmet
    assert "checkpoints, not certifications" in str(refused.value)
    assert not (tmp_path / "a.db").exists()  # refused before anything was created
    weaker = setup(tmp_path, ScriptedModel(["x"]), COMPLIANT, backend=FakeBackend(tier="docker"))
    with pytest.raises(ComplianceNotMet, match="needs microvm"):
        build_agent(weaker)


def test_a_declared_profile_raises_the_minimum_tier_to_the_microvm(tmp_path: Path) -> None:
    policy = load_policy(
        write(tmp_path, 'version = 1\n[trust]\nlevel = "trusted"\n[compliance]\nprofiles = ["soc2"]\n')
    )
    assert PolicyEngine(policy).allowed_tiers() == ("microvm",)
    plain = load_policy(write(tmp_path, 'version = 1\n[trust]\nlevel = "trusted"\n'))
    assert "process" in PolicyEngine(plain).allowed_tiers()
    from stockade.assembly.trust import choose_tier

    with pytest.raises(TierUnavailable, match="compliance profiles soc2"):
        choose_tier(PolicyEngine(policy), "process", None)


def test_every_requirement_says_what_it_found() -> None:
    policy = load_policy_text(COMPLIANT)
    setup_ = Setup(
        audit_url="memory:", audit_keyed=False, audit_redacts_personal_data=False,
        kill_switch=(True, "/tmp/kill"), failure_breaker=5, microvm=(True, "here"),
    )  # fmt: skip
    report = check_compliance(policy, setup_, role="clinician")
    assert len(report.findings) == sum(len(r) for r in PROFILES.values())
    failed = {f.requirement.id for f in report.unmet}
    assert failed == {"hipaa.164.312(b)", "soc2.cc7.2", "gdpr.art32", "gdpr.art17"}
    no_role = check_compliance(policy, setup_)
    assert "no role is given" in {f.detail for f in no_role.unmet}


def load_policy_text(text: str) -> Policy:
    from stockade.policy import parse_policy

    return parse_policy(text)


def test_policy_check_prints_every_requirement_met_or_not_and_how_to_fix_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    open_policy = write(
        tmp_path, 'version = 1\n[network]\nenabled = true\n[commands]\napprove = ["git push"]\n'
    )
    monkeypatch.delenv("STOCKADE_AUDIT_KEY", raising=False)
    args = [
        "policy",
        "check",
        str(open_policy),
        "--compliance",
        "hipaa",
        "--kill-target",
        str(tmp_path / "k"),
        "--no-host",  # a unit test starts no microVM
    ]
    shown = CliRunner().invoke(app, args)
    assert shown.exit_code == 1, shown.output
    assert "not certifications" in shown.output
    for requirement in PROFILES["hipaa"]:
        assert requirement.control in shown.output
    assert "not met" in shown.output and "fix:" in shown.output
    assert "the network is on for any host" in shown.output and "not checked (--no-host)" in shown.output
    as_json = CliRunner().invoke(app, [*args, "--compliance", "soc2", "--json"])
    body = json.loads(as_json.stdout)
    assert body["checkpoints_not_certifications"] and not body["ok"]
    deploys = next(r for r in body["requirements"] if r["id"] == "soc2.cc8.1")
    assert not deploys["met"] and "kubectl apply" in deploys["detail"] and "git push" not in deploys["detail"]
    monkeypatch.setenv("STOCKADE_AUDIT_KEY", "k" * 32)
    keyed = CliRunner().invoke(app, [*args, "--json"])
    audit = next(r for r in json.loads(keyed.stdout)["requirements"] if r["id"] == "hipaa.164.312(b)")
    assert audit["met"] and audit["fix"] is None
    unknown = CliRunner().invoke(app, ["policy", "check", str(open_policy), "--compliance", "iso27001"])
    assert unknown.exit_code == 2
    markup = CliRunner().invoke(app, ["policy", "check", str(open_policy), "--compliance", "[/x]"])
    assert markup.exit_code == 2 and "no profile [/x]" in markup.output  # named, not a MarkupError


def test_retention_erases_runs_older_than_the_period(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'audit.db'}"
    policy = 'version = 1\n[trust]\nlevel = "trusted"\n'
    config = setup(tmp_path, ScriptedModel(["done"]), policy, role=None, backend=FakeBackend(tier="process"))
    with build_agent(config) as agent:
        agent.run_sync("first", run_id="old")
    kept = CliRunner().invoke(app, ["runs", "erase", "--older-than", "30", "--db", db])
    assert kept.exit_code == 1  # nothing is 30 days old
    keyless = CliRunner().invoke(app, ["runs", "erase", "--older-than", "0", "--db", db])
    assert keyless.exit_code == 2 and "pass its key" in keyless.output  # its erasure goes in the trail
    env = {"STOCKADE_AUDIT_KEY": KEY.decode()}
    gone = CliRunner().invoke(app, ["runs", "erase", "--older-than", "0", "--db", db], env=env)
    assert gone.exit_code == 0 and "erased 1 run(s)" in gone.output, gone.output


@pytest.mark.parametrize(
    ("network", "met", "detail"),
    [
        ("", True, "the network is off"),
        ("[network]\nenabled = true\n", False, "the network is on for any host"),
        ('[network]\nallow = ["pypi.org"]\n', True, "only to pypi.org, through the egress proxy"),
        ('[network]\nenabled = true\nallow_hosts = ["pypi.org"]\n', True, "only to pypi.org"),
    ],
)
def test_egress_is_met_by_an_allowlist_in_either_spelling(network: str, met: bool, detail: str) -> None:
    policy = load_policy_text(f"version = 1\n{network}")
    setup_ = Setup(audit_url="memory:", audit_keyed=True, audit_redacts_personal_data=True)
    report = check_compliance(policy, setup_, profiles=["soc2"])
    (egress,) = [f for f in report.findings if "allowlisted hosts" in f.requirement.text]
    assert egress.met is met and detail in egress.detail
