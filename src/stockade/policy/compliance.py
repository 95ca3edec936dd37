"""Compliance checkpoints: what a declared profile requires of the policy, the configuration and
the host, checked before any run starts.

    [compliance]
    profiles = ["soc2", "hipaa", "gdpr"]
    retention_days = 30

Each profile is a list of ``Requirement`` values, each mapped to the control it serves (HIPAA
§164.312(b) audit controls, SOC 2 CC6.1 logical access, GDPR Art. 17 erasure, ...) and each
checked against a ``Setup``: what an agent would start with (its audit trail, its run store,
its kill switch, its monitors) and what this host has (the microVM tier). ``build_agent``
refuses to start when a declared profile has a requirement not met (``ComplianceNotMet``), and
``stockade policy check --compliance hipaa`` prints every requirement: met or not, and how to
fix it.

These are checkpoints, not certifications. They check what stockade can see and enforce; a
certification also audits people, processes and everything around stockade. A profile met
here is evidence for an auditor, not a verdict.

A declared profile also raises the minimum tier to the microVM (``PolicyEngine.allowed_tiers``):
the strongest isolation, failing closed where the host has none.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from stockade.policy.engine import PolicyEngine
from stockade.policy.schema import Policy, Verdict
from stockade.sandbox.ops import RunCommand

__all__ = [
    "DEPLOY_COMMANDS",
    "PROFILES",
    "ComplianceReport",
    "Finding",
    "Requirement",
    "Setup",
    "check_compliance",
    "kill_target_reachable",
    "microvm_on_host",
]

# What a deploy looks like on the command line: each must need a human's approval (or be denied).
DEPLOY_COMMANDS = (
    "git push origin main",
    "kubectl apply -f deploy.yaml",
    "terraform apply",
    "helm upgrade app ./chart",
    "docker push registry.example.com/app:latest",
)


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What the requirements see besides the policy: the configuration and the host."""

    audit_url: str  # where the audit trail goes ("memory:" when it is not kept)
    audit_keyed: bool  # an HMAC key seals the chain
    audit_redacts_personal_data: bool
    telemetry_redacts_personal_data: bool | None = None  # None: no telemetry configured
    runs_erasable: bool = False  # runs are recorded in a run store that can erase them
    kill_switch: tuple[bool, str] = (False, "no kill target")  # reachable, and where
    anomaly_monitor: bool = True
    failure_breaker: int | None = None  # the agent's breaker threshold; None: off
    microvm: tuple[bool, str] = (False, "not probed")  # available here, and why (not)


Check = Callable[[PolicyEngine, Setup], tuple[bool, str]]


@dataclass(frozen=True, kw_only=True)
class Requirement:
    id: str
    profile: str
    control: str  # the control it serves, as the framework names it
    text: str  # what must hold
    check: Check
    fix: str  # what to do when it does not


@dataclass(frozen=True, kw_only=True)
class Finding:
    requirement: Requirement
    met: bool
    detail: str  # what was found


@dataclass(frozen=True, kw_only=True)
class ComplianceReport:
    profiles: tuple[str, ...]
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return all(f.met for f in self.findings)

    @property
    def unmet(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if not f.met)

    def summary(self) -> str:
        lines = [
            f"{f.requirement.control}: {f.requirement.text} — not met: {f.detail}; fix: {f.requirement.fix}"
            for f in self.unmet
        ]
        return "; ".join(lines)


# -- checks -----------------------------------------------------------------------------------


def _durable_keyed_audit(engine: PolicyEngine, setup: Setup) -> tuple[bool, str]:
    if setup.audit_url == "memory:":
        return False, "the audit trail is kept in memory only"
    if not setup.audit_keyed:
        return False, f"{setup.audit_url} is a plain SHA-256 chain (anyone who can write it can rewrite it)"
    return True, f"{setup.audit_url}, HMAC-SHA256 chain"


def _roles(engine: PolicyEngine, setup: Setup) -> tuple[bool, str]:
    policy = engine.policy
    if not policy.roles:
        return False, "the policy defines no roles"
    if engine.role_name is None:
        return False, "no role is given"
    if not engine.role.tools:
        return False, f"role {engine.role_name!r} may use every tool"
    return True, f"role {engine.role_name!r} with tools {', '.join(engine.role.tools)}"


def _least_privilege(engine: PolicyEngine, setup: Setup) -> tuple[bool, str]:
    met, detail = _roles(engine, setup)
    if not met:
        return met, detail
    shell = engine.tool("shell")
    risk = engine.risk("high", tool="shell")
    if shell.verdict is Verdict.ALLOW and risk.verdict is Verdict.ALLOW:
        return False, "the raw shell (a high-risk tool) runs without a human's approval"
    return True, f"{detail}; high-risk tools: {risk.verdict.value if shell.allowed else shell.verdict.value}"


def _egress(engine: PolicyEngine, setup: Setup) -> tuple[bool, str]:
    network = engine.network_policy()  # the role's: [network] allow, allow_hosts
    if network.egress:
        hosts = dict.fromkeys(rule.host for rule in network.host_rules)
        return True, f"only to {', '.join(hosts)}, through the egress proxy"
    if not network.enabled:
        return True, "the network is off"
    return False, "the network is on for any host"


def _deploys(engine: PolicyEngine, setup: Setup) -> tuple[bool, str]:
    free = [
        command
        for command in DEPLOY_COMMANDS
        if engine.op(RunCommand(argv=("/bin/sh", "-c", command))).verdict is Verdict.ALLOW
    ]
    if free:
        return False, f"these run without approval: {'; '.join(free)}"
    return True, "git push, kubectl apply, terraform apply, helm upgrade, docker push: approval or denied"


def _monitoring(engine: PolicyEngine, setup: Setup) -> tuple[bool, str]:
    if setup.audit_url == "memory:":
        return False, "the audit trail is kept in memory only"
    if not (setup.anomaly_monitor and engine.policy.anomaly.enabled):
        return False, "the anomaly monitor is off"
    return True, f"audit trail {setup.audit_url}; the anomaly monitor is on"


def _incident_response(engine: PolicyEngine, setup: Setup) -> tuple[bool, str]:
    reachable, where = setup.kill_switch
    if not reachable:
        return False, f"the kill switch is not reachable: {where}"
    if setup.failure_breaker is None:
        return False, "the agent's circuit breaker is off"
    return True, f"kill switch at {where}; the breaker stops a run after {setup.failure_breaker} failures"


def _isolation(engine: PolicyEngine, setup: Setup) -> tuple[bool, str]:
    available, why = setup.microvm
    return available, why


def _data_classified(engine: PolicyEngine, setup: Setup) -> tuple[bool, str]:
    policy = engine.policy
    if not policy.data:
        return False, "the policy does not say where protected data lives ([[data]])"
    tiers = {entry.tier for entry in policy.data}
    open_tiers = sorted(t.value for t in tiers if t not in policy.data_access)
    if open_tiers:
        return False, f"no [data_access] rule for {', '.join(open_tiers)}"
    return True, f"{len(policy.data)} data classes, each with access rules"


def _redaction(engine: PolicyEngine, setup: Setup) -> tuple[bool, str]:
    if not setup.audit_redacts_personal_data:
        return False, "the audit trail does not redact personal data"
    if setup.telemetry_redacts_personal_data is False:
        return False, "the traces and logs of the telemetry do not redact personal data"
    traced = "" if setup.telemetry_redacts_personal_data is None else " and telemetry"
    return True, f"the audit trail{traced} redact e-mail addresses, phone numbers, IPs, card numbers, ..."


def _retention(engine: PolicyEngine, setup: Setup) -> tuple[bool, str]:
    days = engine.policy.compliance.retention_days
    if days is None:
        return False, "no retention period is set"
    return True, f"{days} days (erase older runs with: stockade runs erase --older-than {days})"


def _erasure(engine: PolicyEngine, setup: Setup) -> tuple[bool, str]:
    if not setup.runs_erasable:
        return False, "runs are not recorded in a run store, so no subject's run data can be erased"
    try:
        import cryptography  # noqa: F401 - the runs' audit events are sealed with it
    except ImportError:
        return False, 'a subject\'s audit events cannot be sealed: pip install "stockade[gdpr]"'
    return True, (
        "runs go to a run store and a subject's audit events are sealed under keys of their own: "
        "stockade runs erase --subject ID forgets both (the audit chain verifies as before)"
    )


# -- profiles ---------------------------------------------------------------------------------

_AUDIT_FIX = (
    'keep the audit trail in a database and key its chain: audit="sqlite:///.stockade/audit.db" '
    "(or postgresql://...) and audit_key=<16+ bytes> (the CLI: STOCKADE_AUDIT_KEY)"
)
_ROLES_FIX = "define [roles.NAME] with the tools = [...] each needs, and start runs with role=NAME"
_EGRESS_FIX = 'set [network] enabled = false, or allow = ["the.hosts.you.need"]'
_ISOLATION_FIX = "run on a host with the microVM tier (stockade doctor says what it misses)"

PROFILES: dict[str, tuple[Requirement, ...]] = {
    "soc2": (
        Requirement(
            id="soc2.cc6.1", profile="soc2", control="SOC 2 CC6.1/CC6.3 logical access",
            text="runs start under a role with listed tools, and the raw shell needs a human",
            check=_least_privilege, fix=_ROLES_FIX + '; and set [risk] high = "approve"',
        ),
        Requirement(
            id="soc2.cc6.6", profile="soc2", control="SOC 2 CC6.6 boundary protection",
            text="no network, or only to allowlisted hosts", check=_egress, fix=_EGRESS_FIX,
        ),
        Requirement(
            id="soc2.cc6.8", profile="soc2", control="SOC 2 CC6.8 unauthorized software",
            text="untrusted code runs in the microVM tier, available on this host",
            check=_isolation, fix=_ISOLATION_FIX,
        ),
        Requirement(
            id="soc2.cc8.1", profile="soc2", control="SOC 2 CC8.1 change management",
            text="deploys (git push, kubectl apply, terraform apply, ...) need a human's approval",
            check=_deploys,
            fix='[commands] approve = ["git push", "kubectl apply", "terraform apply", "helm upgrade", '
            '"docker push"]',
        ),
        Requirement(
            id="soc2.cc7.2", profile="soc2", control="SOC 2 CC7.2 monitoring",
            text="a durable audit trail, and the anomaly monitor on", check=_monitoring,
            fix='audit="sqlite:///.stockade/audit.db" (or postgresql://...); AgentConfig(anomaly=True) '
            "and [anomaly] enabled = true",
        ),
        Requirement(
            id="soc2.cc7.4", profile="soc2", control="SOC 2 CC7.3/CC7.4 incident response",
            text="a reachable kill switch, and the agent's circuit breaker on",
            check=_incident_response,
            fix="a writable kill directory or a reachable redis:// kill target (kill_target=...), and "
            "max_consecutive_failures set",
        ),
    ),
    "hipaa": (
        Requirement(
            id="hipaa.164.312(b)", profile="hipaa", control="HIPAA §164.312(b) audit controls",
            text="a durable audit trail with a keyed (HMAC) hash chain", check=_durable_keyed_audit,
            fix=_AUDIT_FIX,
        ),
        Requirement(
            id="hipaa.164.312(a)(1)", profile="hipaa", control="HIPAA §164.312(a)(1) access control",
            text="runs start under a role with listed tools", check=_roles, fix=_ROLES_FIX,
        ),
        Requirement(
            id="hipaa.164.308(a)(4)", profile="hipaa",
            control="HIPAA §164.308(a)(4) information access management",
            text="the policy says where protected data lives and who may touch it", check=_data_classified,
            fix='add [[data]] paths = ["records/**"] tier = "restricted", and [data_access.restricted] '
            'read = ["ROLE"] write = [...]',
        ),
        Requirement(
            id="hipaa.164.312(e)(1)", profile="hipaa", control="HIPAA §164.312(e)(1) transmission security",
            text="no network, or only to allowlisted hosts", check=_egress, fix=_EGRESS_FIX,
        ),
        Requirement(
            id="hipaa.164.308(a)(1)", profile="hipaa", control="HIPAA §164.308(a)(1)(ii)(B) risk management",
            text="untrusted code runs in the microVM tier, available on this host",
            check=_isolation, fix=_ISOLATION_FIX,
        ),
    ),
    "gdpr": (
        Requirement(
            id="gdpr.art32", profile="gdpr", control="GDPR Art. 32 / Art. 5(1)(c) security, minimisation",
            text="personal data is redacted from the audit trail, the logs and the traces",
            check=_redaction,
            fix="declare the gdpr profile (build_agent then redacts it), or pass "
            "AuditLog(..., redactor=Redactor(personal_data=True)) and the same to Telemetry",
        ),
        Requirement(
            id="gdpr.art5(1)(e)", profile="gdpr", control="GDPR Art. 5(1)(e) storage limitation",
            text="a retention period for run data", check=_retention,
            fix="set [compliance] retention_days = N, and erase older runs daily: "
            "stockade runs erase --older-than N",
        ),
        Requirement(
            id="gdpr.art17", profile="gdpr", control="GDPR Art. 17 right to erasure",
            text="a subject's run data can be erased without breaking the audit chain's verification",
            check=_erasure,
            fix='record runs in a run store (audit="sqlite:///..." or runs_url=...) and tag them '
            "(run_sync(..., subject=ID)); erase with stockade runs erase --subject ID",
        ),
        Requirement(
            id="gdpr.art32(1)(b)", profile="gdpr", control="GDPR Art. 32(1)(b) confidentiality of processing",
            text="untrusted code runs in the microVM tier, available on this host",
            check=_isolation, fix=_ISOLATION_FIX,
        ),
    ),
}  # fmt: skip


def check_compliance(
    policy: Policy, setup: Setup, *, role: str | None = None, profiles: Iterable[str] | None = None
) -> ComplianceReport:
    """Every requirement of ``profiles`` (default: the policy's own), checked."""
    chosen = tuple(dict.fromkeys(profiles if profiles is not None else policy.compliance.profiles))
    engine = PolicyEngine(policy, role=role) if (role is not None or not policy.roles) else _roleless(policy)
    findings = []
    for profile in chosen:
        for requirement in PROFILES[profile]:
            met, detail = requirement.check(engine, setup)
            findings.append(Finding(requirement=requirement, met=met, detail=detail))
    return ComplianceReport(profiles=chosen, findings=tuple(findings))


def _roleless(policy: Policy) -> PolicyEngine:
    """An engine for a policy with roles when none is given (the role checks then fail)."""
    bare = policy.model_copy(update={"roles": {}})
    engine = PolicyEngine(bare)
    engine.policy = policy  # the checks read the roles from here, and find no role given
    return engine


# -- what the host and the configuration offer ------------------------------------------------


def kill_target_reachable(target: str | None) -> tuple[bool, str]:
    """Whether ``stockade kill`` could reach a run watching ``target`` (a folder or redis://...)."""
    if target and target.startswith(("redis://", "rediss://", "unix://")):
        try:
            import redis

            redis.Redis.from_url(target, socket_timeout=1.0).ping()
        except Exception as err:  # not installed, not running, refused
            return False, f"{target}: {err}"
        return True, target
    from stockade.runtime.kill_sources import default_kill_dir

    folder = Path(target) if target else default_kill_dir()
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the folder is made when the first run watches it
    if not os.access(probe, os.W_OK | os.X_OK):
        return False, f"{folder} cannot be written"
    return True, str(folder)


def microvm_on_host(backend_tier: str | None = None) -> tuple[bool, str]:
    """Whether the microVM tier is there (``backend_tier``: the tier of a backend given instead)."""
    if backend_tier is not None:
        if backend_tier == "microvm":
            return True, "the backend given is a microvm"
        return False, f"the backend given is {backend_tier!r}; a declared compliance profile needs microvm"
    from stockade.sandbox import _registry

    report = _registry.probe("microvm")
    return report.available, report.detail or ("available" if report.available else "unavailable")
