"""Whether a sandbox may start as it is asked: what a start checks beyond the role's tiers and tools.

A snapshot's network is judged again by the tenant's policy as it is now; a memory snapshot
comes back only under the rules and network it was taken with; a tier's weaker enforcement
is accepted only where the tenants file lets the tenant accept it. Apart from the registry
(``server/sandbox_registry.py``): each is a decision over values, none holds a sandbox.
"""

from __future__ import annotations

import contextlib

from stockade import exceptions as exc
from stockade.policy.engine import PolicyEngine
from stockade.sandbox._startup import rules_changed
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.facade import Sandbox
from stockade.server.authz import check_network, network_changed
from stockade.server.tenants import Tenant, check_weaker
from stockade.types import NetworkPolicy

__all__ = ["consented", "judged_network", "same_rules", "unconsented"]


def judged_network(engine: PolicyEngine, kept: SandboxSpec) -> NetworkPolicy | None:
    """A snapshot's network, judged again by the tenant's policy as it is now."""
    if not (kept.network.enabled or kept.network.egress):
        return None
    return check_network(engine, kept.network)


def same_rules(engine: PolicyEngine, kept: SandboxSpec, snapshot: str, what: str, fix: str) -> None:
    """A memory snapshot comes back only under the rules and network it was taken with:
    its supervisor and kernel hold those rules, its egress proxy that network. A tenant
    whose policy changed since is refused (the sandbox would enforce the old ones), with
    what changed; its files still come back under the policy as it is now, from a files
    snapshot. A host no longer allowed is ``PolicyDenied``, as for a new sandbox; one still
    allowed whose methods, ports or rates the policy changed is such a change (it came back
    with the old ones)."""
    differences = rules_changed(kept.rules, engine.sandbox_rules())
    judged = judged_network(engine, kept)
    if judged is not None:
        differences += network_changed(kept.network, judged)
    if differences:
        raise exc.SnapshotIncompatible(
            f"{what} {snapshot} keeps a running sandbox's memory under the sandbox rules and "
            f"network the tenant's policy gave when it was taken; the policy has changed since "
            f"({'; '.join(differences)}) and its memory cannot come back under the new ones: {fix}"
        )


def consented(tenant: Tenant, sandbox: Sandbox) -> None:
    """Close ``sandbox`` and refuse it (``PolicyDenied``) where it is weaker than asked and
    the tenants file does not let its tenant accept that."""
    try:
        check_weaker(tenant, sandbox.enforcement.weakened, what="this sandbox")
    except exc.PolicyDenied:
        with contextlib.suppress(Exception):
            sandbox.close()
        raise


def unconsented(tenant: Tenant, asked: bool, refused: exc.LimitNotEnforceable) -> exc.StockadeError:
    """What a tenant is told of a tier's refusal: its advice to pass ``allow_weaker`` holds
    here only where the tenants file lets the tenant accept weaker enforcement."""
    if tenant.allow_weaker:
        return refused
    weakened = (f"{refused.setting}: {refused}" if refused.setting else str(refused),)
    if asked:  # the request asked for what only the operator can give
        try:
            check_weaker(tenant, weakened, what="this sandbox")
        except exc.PolicyDenied as denied:
            return denied
    fix = (
        f"{refused.fix} (here allow_weaker counts only where the tenants file sets "
        f"allow_weaker = true under [tenants.{tenant.id}])"
    )
    return exc.LimitNotEnforceable(str(refused), setting=refused.setting, fix=fix)
