"""What a principal's role allows, asked before anything runs: tiers (by the tenant policy's
trust and the role's list), the network, models and tools.

A call of the sandbox API amounts to one of the agent's tools, and the role's ``tools`` list
holds over it as over a run's calls (``SANDBOX_TOOLS``): a role of read tools runs no code by
any route, which is what ``PolicyEngine.code_tools`` (and so the data classes its sandboxes
hold) takes it at."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

from stockade import exceptions as exc
from stockade.egress._rules import Judge, ip_literal
from stockade.policy.engine import Decision, PolicyEngine
from stockade.policy.guards import OpContext, OpGuard, describe, op_policy_guard
from stockade.policy.schema import Policy, Verdict
from stockade.sandbox._rules import check_holdable
from stockade.sandbox.base import Backend
from stockade.sandbox.ops import (
    GetArchive,
    ListDir,
    MakeDir,
    Op,
    Pause,
    PutArchive,
    ReadFile,
    Remove,
    Reset,
    RunCode,
    RunCommand,
    Stat,
    TakeExecs,
    TakeSnapshot,
    WriteFile,
)
from stockade.server.tenants import Principal
from stockade.types import NetworkPolicy, Trust

__all__ = [
    "OP_CALLS",
    "SANDBOX_TOOLS",
    "check_acceptance_check",
    "check_approver",
    "check_model",
    "check_network",
    "check_run_rules",
    "check_sandbox_tool",
    "check_sandbox_tools",
    "check_tier_network",
    "choose_tier",
    "effective_policy",
    "engine_for",
    "may_approve",
    "sandbox_op_guard",
]

# The tool each call of the sandbox API amounts to: a command is the raw shell, code is
# run_code; a file's content, its entry and a folder's download are read_file, a listing is
# list_files; what brings files in or takes them away is write_file (a write, a folder made,
# a removal, an upload, a reset; a restore from a snapshot, and a resume, bring its files back,
# and a pause is kept for its resume). A snapshot copies the files to the host's store, never
# to the caller: read_file. Looking at, killing or deleting a sandbox is none: a role can
# always stop what it holds.
SANDBOX_TOOLS: dict[str, tuple[str, str]] = {  # call: (tool, the call in words)
    "command": ("shell", "running a command"),
    "code": ("run_code", "running code"),
    "read": ("read_file", "reading a file"),
    "stat": ("read_file", "looking at a file"),
    "download": ("read_file", "downloading a folder"),
    "snapshot": ("read_file", "taking a snapshot"),
    "list": ("list_files", "listing a folder"),
    "write": ("write_file", "writing a file"),
    "make_dir": ("write_file", "making a folder"),
    "remove": ("write_file", "removing a file"),
    "upload": ("write_file", "uploading a folder"),
    "reset": ("write_file", "emptying the workspace"),
    "restore": ("write_file", "starting from a snapshot"),
    "pause": ("write_file", "pausing a sandbox (its resume brings its files back)"),
    "resume": ("write_file", "resuming a sandbox"),
}

# The call of ``SANDBOX_TOOLS`` each op of a sandbox amounts to: the API's op guard judges the op
# with that call's tool (``sandbox_op_guard``). Code in a language but Python is the command that
# runs it (a program on stdin), judged as the raw shell: an argv sent to ``/commands`` could be
# the same, and must not pass for code.
OP_CALLS: dict[type[Op[Any]], str | None] = {
    RunCommand: "command",
    RunCode: "code",
    ReadFile: "read",
    Stat: "stat",
    GetArchive: "download",
    TakeSnapshot: "snapshot",
    ListDir: "list",
    WriteFile: "write",
    MakeDir: "make_dir",
    Remove: "remove",
    PutArchive: "upload",
    Reset: "reset",
    Pause: "pause",
    TakeExecs: None,  # the audit layer's own, below the guard: no call sends it
}

# Weakest to strictest: a request may tighten the tenant's trust, never loosen it.
_TRUST_ORDER = (Trust.TRUSTED, Trust.INTERNAL, Trust.UNTRUSTED, Trust.MULTI_TENANT)


def effective_policy(principal: Principal, trust: Trust | None) -> Policy:
    policy = principal.tenant.policy
    if trust is None:
        return policy
    level = max(policy.trust.level, trust, key=_TRUST_ORDER.index)
    return policy.model_copy(update={"trust": policy.trust.model_copy(update={"level": level})})


def engine_for(principal: Principal, trust: Trust | None = None) -> PolicyEngine:
    return PolicyEngine(effective_policy(principal, trust), role=principal.role)


def choose_tier(engine: PolicyEngine, tier: str | None, prefer: str | None = None) -> tuple[str, str]:
    """The tier to use and why; ``PolicyDenied`` (403) for a tier the role or trust forbids."""
    allowed = engine.allowed_tiers()
    level = engine.policy.trust.level.value
    if tier is None:
        order = "strongest" if prefer == "strongest" else engine.policy.trust.prefer
        return engine.select_tier("strongest" if order == "strongest" else "cheapest"), (
            f"the {order} tier trust {level!r} and role {engine.role_name!r} allow on this host"
        )
    if tier not in allowed:
        raise exc.PolicyDenied(
            f"tier {tier!r} is not allowed for role {engine.role_name!r} under trust {level!r}; "
            f"allowed: {', '.join(allowed) or 'none'}",
            rule="trust"
            if engine.role.tiers == () or tier in engine.role.tiers
            else f"roles.{engine.role_name}.tiers",
            action=f"use tier {tier}",
        )
    return tier, f"asked for; trust {level!r} and role {engine.role_name!r} allow it"


def check_network(engine: PolicyEngine, network: NetworkPolicy) -> NetworkPolicy:
    """The network a sandbox asked for, if the tenant's policy gives it (``PolicyDenied``
    otherwise): its hosts must be among those the role may reach (``[network] allow``), or
    the policy must give the whole network. What it gets is the policy's own rules for those
    hosts (ports, methods, addresses, limits, and the credentials the proxy adds), never
    more than the request names. A list narrowed from the whole network is the tenant's, with
    the policy's addresses and pins (``_check_narrowed``)."""
    granted = engine.network_policy()
    if (network.enabled or network.egress) and not (granted.enabled or granted.egress):
        raise exc.PolicyDenied(
            "the tenant's policy keeps the network off; leave network.enabled false and allow_hosts empty",
            rule="network.enabled",
            action="enable the network",
        )
    if not network.egress:
        if network.enabled and not granted.unrestricted:
            raise exc.PolicyDenied(
                f"the tenant's policy lets the network reach only {_spell(granted)}",
                rule="network.allow_hosts",
                action="reach any host",
            )
        return network
    if granted.unrestricted:  # the whole network is allowed: any list narrows it
        _check_narrowed(granted, network)
        # The proxy runs on the service host: what it may reach past the public internet (its
        # addresses, pins, trusted CAs) is the operator's to say, never the tenant's.
        return dataclasses.replace(
            network,
            allow_addresses=granted.allow_addresses,
            resolve=granted.resolve,
            credentials=(),
            upstream_ca=granted.upstream_ca,
            max_requests_per_minute=min(network.max_requests_per_minute, granted.max_requests_per_minute),
            max_bytes_per_minute=min(network.max_bytes_per_minute, granted.max_bytes_per_minute),
        )
    wanted = {rule.host for rule in network.host_rules}
    extra = sorted(wanted - {rule.host for rule in granted.host_rules})
    if extra:
        raise exc.PolicyDenied(
            f"the tenant's policy lets the network reach only {_spell(granted)}",
            rule="network.allow_hosts",
            action="reach " + ", ".join(extra),
        )
    rules = tuple(rule for rule in granted.host_rules if rule.host in wanted)
    credentials = tuple(c for c in granted.credentials if any(h in wanted for h in c.hosts))
    return dataclasses.replace(granted, enabled=True, rules=rules, credentials=credentials)


def network_changed(kept: NetworkPolicy, now: NetworkPolicy) -> list[str]:
    """How the network the policy gives now (``check_network`` of a snapshot's own) differs
    from the one a memory snapshot's egress proxy holds (each setting that differs: ``hosts
    pypi.org ports 80,443 methods GET, not ...``). Order changes nothing the proxy does, and
    credentials are not kept in a snapshot: neither is a difference."""

    def spelled(network: NetworkPolicy) -> dict[str, str]:
        hosts = sorted(
            f"{r.host} ports {','.join(map(str, sorted(set(r.ports))))} "
            f"methods {','.join(sorted(set(r.methods))) or 'any'}"
            for r in set(network.host_rules)
        )
        pins = sorted(f"{name}={','.join(sorted(set(a)))}" for name, a in network.resolve.items())
        return {
            "enabled": str(network.enabled or network.egress),
            "hosts": "; ".join(hosts) or "none",
            "allow_addresses": ", ".join(sorted(set(network.allow_addresses))) or "none",
            "resolve": ", ".join(pins) or "none",
            "max_requests_per_minute": str(network.max_requests_per_minute),
            "max_bytes_per_minute": str(network.max_bytes_per_minute),
            "upstream_ca": "set" if network.upstream_ca else "none",
        }

    then, given = spelled(kept), spelled(now)
    if then["upstream_ca"] == given["upstream_ca"] == "set" and kept.upstream_ca != now.upstream_ca:
        then["upstream_ca"], given["upstream_ca"] = "the one it was taken with", "another"
    return [f"network {name} {given[name]}, not {then[name]}" for name in then if given[name] != then[name]]


def _check_narrowed(granted: NetworkPolicy, network: NetworkPolicy) -> None:
    """``PolicyDenied`` for what an allowlist narrowed from the whole network must not name
    unless the operator's policy does: the whole network is the public internet, but the
    egress proxy connects from the service host, so an IP literal that is not public
    (``127.0.0.1:6443``, ``169.254.169.254``), an ``allow_addresses`` network or a
    ``resolve`` pin would reach the service host's loopback or its private network."""
    operator = Judge(NetworkPolicy(allow_addresses=granted.allow_addresses))  # no rule: its addresses
    for rule in network.host_rules:
        literal = ip_literal(rule.host)
        refusal = operator.address(literal) if literal is not None else None
        if refusal is not None:
            raise exc.PolicyDenied(
                f"{rule.host} is not a public address: the tenant's policy gives the whole network, "
                "the public internet, not the service host's own or its private network (but what "
                "the policy's allow_addresses name)",
                rule="network.allow_hosts",
                action=f"reach {rule.host}",
            )
    networks = [ipaddress.ip_network(text, strict=False) for text in granted.allow_addresses]
    for text in network.allow_addresses:
        asked = ipaddress.ip_network(text, strict=False)
        if not any(asked.version == n.version and asked.subnet_of(n) for n in networks):  # type: ignore[arg-type]
            raise exc.PolicyDenied(
                f"allow_addresses {text!r}: the tenant's policy gives no address that is not public "
                f"but {', '.join(granted.allow_addresses) or 'none'}",
                rule="network.allow_addresses",
                action=f"reach {text}",
            )
    for name, addresses in network.resolve.items():
        pinned = granted.resolve.get(name, ())
        if not set(addresses) <= set(pinned):
            raise exc.PolicyDenied(
                f"resolve {name!r}: the tenant's policy pins it to {', '.join(pinned) or 'nothing'}",
                rule="network.resolve",
                action=f"pin {name} to {', '.join(addresses)}",
            )


def check_tier_network(backend: Backend, network: NetworkPolicy | None) -> None:
    """``LimitNotEnforceable`` (422) for the whole network on a tier that cannot wall it off
    from the service host and its private network (``Backend.unwalled_network``: the process
    tier without its walls shares the host's stack, the docker tier without its firewall rules
    reaches the engine host's listeners and 169.254.169.254), whatever the request's
    ``allow_weaker``: a policy that grants the whole network means the internet, never the
    service's own hosts."""
    if network is None or not network.unrestricted:
        return
    why = backend.unwalled_network()
    if why is None:
        return
    advice = (
        "use network.allow_hosts (an allowlist through the egress proxy), or a tier this host walls "
        "off (docker, or process, as root with iptables and slirp4netns)"
    )
    raise exc.LimitNotEnforceable(
        f"the whole network on the {backend.tier} tier would reach the service host or its private "
        f"network ({why}); the service never gives it, whatever allow_weaker: {advice}",
        setting="network",
        fix=advice,
    )


def _spell(granted: NetworkPolicy) -> str:
    return ", ".join(dict.fromkeys(rule.host for rule in granted.host_rules)) or "no host"


def check_model(engine: PolicyEngine, name: str, provider: str = "") -> None:
    decision = engine.model(name, provider)
    if not decision.allowed:
        raise exc.PolicyDenied(decision.reason, rule=decision.rule, action=f"use model {name}")


def check_sandbox_tool(principal: Principal, call: str) -> None:
    """``PolicyDenied`` (403) unless the principal's role may use the tool the sandbox API's
    ``call`` amounts to (``SANDBOX_TOOLS``)."""
    _check_tool(engine_for(principal), call)


def _check_tool(engine: PolicyEngine, call: str, *, what: str = "") -> None:
    tool, doing = SANDBOX_TOOLS[call]
    decision = engine.tool(tool)
    if decision.verdict is Verdict.DENY:  # one to approve is the op guard's to ask, per op
        raise exc.PolicyDenied(
            f"{decision.reason}, which {what or doing} amounts to", rule=decision.rule, action=doing
        )


def check_acceptance_check(engine: PolicyEngine, command: str) -> None:
    """``PolicyDenied`` (403) unless the role may run ``command`` as a run's acceptance check.
    The check is the caller's shell line, run in the run's sandbox outside the model's guards
    (its own records' view): it is judged as the caller running it through ``POST .../commands``
    would be, the role's command tool, then the policy's rules over the op (its command rules,
    its paths, ``execute`` and the other categories), with the API's op guard and so the same
    tool (a data class's ``tools`` hold: judged with no tool, a class kept from the shell was
    read by a check). An op that needs approval is refused as there: no one is asked for a
    check. Before, a role of read tools ran any code this way."""
    _check_tool(engine, "command", what="the run's acceptance check (a command)")
    sandbox_op_guard(engine)(OpContext(role=engine.role_name), RunCommand(argv=("/bin/sh", "-c", command)))


def check_run_rules(engine: PolicyEngine) -> None:
    """``LimitNotEnforceable`` (422) for a run whose sandbox no tier would start under the
    role's rules (``_rules.check_holdable``: a write rule that is a pattern, a read-only data
    class beneath a written folder): asked when the run is submitted, since a run takes no
    ``allow_weaker`` and would otherwise be queued and end ``error`` at its start."""
    try:
        check_holdable(engine.sandbox_rules())
    except exc.LimitNotEnforceable as refused:
        raise exc.LimitNotEnforceable(
            f"role {engine.role_name!r}'s runs get no sandbox: {refused}",
            setting=refused.setting,
            fix=refused.fix,
        ) from None


def check_sandbox_tools(engine: PolicyEngine) -> None:
    """``PolicyDenied`` (403) for a sandbox that its role could use by no call: none of the
    tools of ``SANDBOX_TOOLS`` is the role's."""
    tools = dict.fromkeys(tool for tool, _ in SANDBOX_TOOLS.values())
    if all(engine.tool(tool).verdict is Verdict.DENY for tool in tools):
        raise exc.PolicyDenied(
            f"role {engine.role_name!r} may use none of the tools a sandbox's calls amount to "
            f"({', '.join(tools)})",
            rule=f"roles.{engine.role_name}.tools",
            action="create a sandbox",
        )


def sandbox_op_guard(engine: PolicyEngine) -> OpGuard:
    """The policy over each op of a sandbox of the API, judged with the tool of the call it
    amounts to (``OP_CALLS``), as a run's ops are with the tool that issued them: a data class's
    ``tools`` hold over the API too. Judged with no tool, a class kept to ``read_file`` was
    listed, written and removed by the API's other calls.

    ``engine`` is the policy the sandbox started under, and its rules were made for what its
    role could do then: a role that ran no code got no read-only data classes, nor were the
    classes kept to tools that run no code left out (``PolicyEngine.sandbox_rules``). Its
    sandbox runs no code afterwards either, though the tenants file, loaded again, gives the
    role a tool that does: a new sandbox gets the rules for it."""
    judge = op_policy_guard(engine)
    ran_no_code = not engine.code_tools()

    def guard(ctx: OpContext, op: Op[Any]) -> Op[Any]:
        call = OP_CALLS.get(type(op))
        tool = SANDBOX_TOOLS[call][0] if call is not None else ""
        judged = judge(dataclasses.replace(ctx, tool=tool), op)  # the policy's own refusal first
        if ran_no_code and call in _CODE_CALLS:
            raise _started_without_code(engine.tool(tool), op)
        return judged

    return guard


_CODE_CALLS = ("command", "code")


def _started_without_code(decision: Decision, op: Op[Any]) -> exc.PolicyDenied:
    """The refusal of code in a sandbox whose role ran none when it started (``decision``: its
    tool then, denied)."""
    action = describe(op)
    return exc.PolicyDenied(
        f"{action}: {decision.reason} when this sandbox started, and its rules keep nothing from "
        "code that only the role's tools were to touch; create a new sandbox to run code in",
        rule=decision.rule,
        action=action,
    )


def check_approver(principal: Principal) -> None:
    """``PolicyDenied`` (403) unless the principal's role may decide approvals."""
    engine = engine_for(principal)
    if not engine.role.can_approve:
        raise exc.PolicyDenied(
            f"role {engine.role_name!r} may not approve or deny actions",
            rule=f"roles.{engine.role_name}.can_approve",
            action="decide an approval",
        )


def may_approve(principal: Principal) -> bool:
    return engine_for(principal).role.can_approve
