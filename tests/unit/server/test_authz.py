"""What a token's role allows (``stockade.server.authz``), asked before anything runs: tiers by
the tenant's trust and the role's list, the network, models. A request may tighten the
tenant's trust, never loosen it."""

from __future__ import annotations

import pytest

from stockade import exceptions as exc
from stockade.policy.schema import (
    CredentialRule,
    HostAllow,
    ModelRegistry,
    NetworkRules,
    Policy,
    Role,
    TrustRules,
)
from stockade.server.authz import check_model, check_network, choose_tier, effective_policy, engine_for
from stockade.server.tenants import Principal, Tenant
from stockade.types import NetworkPolicy, Trust

POLICY = Policy(
    trust=TrustRules(level=Trust.INTERNAL),
    roles={"dev": Role(tiers=("docker", "gvisor")), "ops": Role(), "narrow": Role(tiers=("process",))},
    network=NetworkRules(enabled=True, allow_hosts=("pypi.org", "files.pythonhosted.org")),
    models=ModelRegistry(approved=("openai:gpt-4.1*", "scripted*")),
)


def principal(role: str | None = "dev", policy: Policy = POLICY) -> Principal:
    return Principal(tenant=Tenant(id="acme", policy=policy), role=role, token_id="0123456789ab")


@pytest.mark.parametrize(
    ("asked", "effective"),
    [
        (None, Trust.INTERNAL),
        (Trust.TRUSTED, Trust.INTERNAL),  # looser than the tenant's: the tenant's holds
        (Trust.INTERNAL, Trust.INTERNAL),
        (Trust.UNTRUSTED, Trust.UNTRUSTED),
        (Trust.MULTI_TENANT, Trust.MULTI_TENANT),
    ],
)
def test_a_request_tightens_trust_and_never_loosens_it(asked: Trust | None, effective: Trust) -> None:
    assert effective_policy(principal(), asked).trust.level is effective
    assert POLICY.trust.level is Trust.INTERNAL  # the tenant's policy itself is unchanged


def test_a_tier_the_role_lists_and_trust_allows_is_granted_with_why() -> None:
    tier, why = choose_tier(engine_for(principal()), "docker")
    assert tier == "docker" and "'internal'" in why and "'dev'" in why


def test_a_tier_below_the_trust_minimum_is_denied_by_the_trust_rule() -> None:
    with pytest.raises(exc.PolicyDenied) as denied:
        choose_tier(engine_for(principal("ops")), "process")
    assert denied.value.rule == "trust" and denied.value.action == "use tier process"
    assert "allowed: docker, gvisor" in str(denied.value)


def test_a_tier_trust_allows_but_the_role_does_not_list_is_denied_by_the_role() -> None:
    untrusted = principal("dev")
    with pytest.raises(exc.PolicyDenied) as denied:
        choose_tier(engine_for(untrusted, Trust.MULTI_TENANT), "docker")
    assert denied.value.rule == "trust"  # docker is below the multi-tenant minimum as well
    with pytest.raises(exc.PolicyDenied) as role:
        choose_tier(engine_for(principal("dev")), "microvm")
    assert role.value.rule == "roles.dev.tiers"


def test_a_role_with_no_tier_left_is_refused_and_never_probes_the_host() -> None:
    engine = engine_for(principal("narrow"))  # lists only process; internal trust needs docker or more
    assert engine.allowed_tiers() == ()
    with pytest.raises(exc.TierUnavailable, match="may use no tier"):
        choose_tier(engine, None)


def test_no_role_under_a_policy_with_roles_is_refused_and_a_role_of_nothing_gets_the_trust_table() -> None:
    with pytest.raises(exc.ConfigurationError, match="defines roles"):
        engine_for(principal(None))
    with pytest.raises(exc.ConfigurationError, match="not defined"):
        engine_for(principal("admin"))
    assert engine_for(principal("ops")).allowed_tiers() == ("docker", "gvisor", "microvm")
    roleless = principal(None, Policy(trust=TrustRules(level=Trust.INTERNAL)))
    assert engine_for(roleless).allowed_tiers() == ("docker", "gvisor", "microvm")


@pytest.mark.parametrize(
    ("network", "rule"),
    [
        (NetworkPolicy(enabled=False), None),
        (NetworkPolicy(enabled=True, allow_hosts=("pypi.org",)), None),
        (NetworkPolicy(enabled=True, allow_hosts=("pypi.org", "evil.example")), "network.allow_hosts"),
        (NetworkPolicy(enabled=True), "network.allow_hosts"),  # anywhere: more than the list
    ],
)
def test_the_network_asked_for_must_fit_the_tenants_rules(network: NetworkPolicy, rule: str | None) -> None:
    engine = engine_for(principal())
    if rule is None:
        check_network(engine, network)
        return
    with pytest.raises(exc.PolicyDenied) as denied:
        check_network(engine, network)
    assert denied.value.rule == rule and "pypi.org" in str(denied.value)


def test_no_network_at_all_when_the_tenant_keeps_it_off() -> None:
    closed = engine_for(principal(policy=Policy(roles={"dev": Role()})))
    with pytest.raises(exc.PolicyDenied) as denied:
        check_network(closed, NetworkPolicy(enabled=True, allow_hosts=("pypi.org",)))
    assert denied.value.rule == "network.enabled"


def test_an_allowlist_asked_for_with_the_network_off_is_still_refused() -> None:
    # allow_hosts without enabled still opens a way out (the egress proxy): the same rule holds
    closed = engine_for(principal(policy=Policy(roles={"dev": Role()})))
    with pytest.raises(exc.PolicyDenied) as denied:
        check_network(closed, NetworkPolicy(allow_hosts=("evil.example",)))
    assert denied.value.rule == "network.enabled"


def test_the_sandbox_gets_the_policys_rules_and_credentials_for_the_hosts_it_names() -> None:
    policy = Policy(
        roles={"ci": Role(credentials=("gh",)), "dev": Role()},
        network=NetworkRules(
            allow=(
                "pypi.org",
                HostAllow(host="api.github.com", ports=(443,), methods=("GET",), roles=("ci",)),
            )
        ),
        credentials={"gh": CredentialRule(source="env:GH_TOKEN", hosts=("api.github.com",))},
    )
    got = check_network(engine_for(principal("ci", policy)), NetworkPolicy(allow_hosts=("api.github.com",)))
    assert [(r.host, r.ports, r.methods) for r in got.host_rules] == [("api.github.com", (443,), ("GET",))]
    assert [c.name for c in got.credentials] == ["gh"]
    only_pypi = check_network(engine_for(principal("ci", policy)), NetworkPolicy(allow_hosts=("pypi.org",)))
    assert [r.host for r in only_pypi.host_rules] == ["pypi.org"] and only_pypi.credentials == ()
    with pytest.raises(exc.PolicyDenied) as denied:  # another role's host
        check_network(engine_for(principal("dev", policy)), NetworkPolicy(allow_hosts=("api.github.com",)))
    assert denied.value.rule == "network.allow_hosts" and "pypi.org" in str(denied.value)


@pytest.mark.parametrize("spelled", ["API.GitHub.com", "api.github.com."])
def test_a_credential_for_a_host_spelled_otherwise_goes_with_its_host(spelled: str) -> None:
    policy = Policy(
        roles={"ci": Role(credentials=("gh",))},
        network=NetworkRules(allow=(HostAllow(host="api.github.com", roles=("ci",)),)),
        credentials={"gh": CredentialRule(source="env:GH_TOKEN", hosts=(spelled,))},
    )
    got = check_network(engine_for(principal("ci", policy)), NetworkPolicy(allow_hosts=("api.github.com",)))
    assert [c.name for c in got.credentials] == ["gh"]


def test_only_registered_models_are_allowed() -> None:
    engine = engine_for(principal())
    check_model(engine, "gpt-4.1-mini", "openai")
    check_model(engine, "scripted", "scripted")
    with pytest.raises(exc.PolicyDenied) as denied:
        check_model(engine, "claude-x", "anthropic")
    assert denied.value.rule == "models.approved" and denied.value.action == "use model claude-x"
    assert "'anthropic:claude-x'" in str(denied.value)


def test_a_registry_entry_that_names_a_provider_holds_for_that_provider_only() -> None:
    """``openai:gpt-4.1*`` is not gpt-4.1 served by anyone; ``scripted:*`` is not a real model
    that happens to be named like the test doubles."""
    registry = ModelRegistry(approved=("openai:gpt-4.1*", "scripted:*", "claude-*"))
    assert registry.allows("gpt-4.1-mini", "openai") and not registry.allows("gpt-4.1-mini", "anthropic")
    assert registry.allows("scripted", "scripted") and not registry.allows("scripted-evil", "openai")
    assert registry.allows("claude-x", "anthropic") and registry.allows(
        "claude-x", "openai"
    )  # no provider named
    assert not registry.allows("gpt-4.1")  # a model of one's own, with no provider
