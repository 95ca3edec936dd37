"""Build ahead what the sandboxes of a policy start from (the microVM's ready images), so
that an operator pays the boot at deploy time and no sandbox's first start does.

A sandbox of a policy carries the policy's rules as its role sees them (``sandbox_rules``):
one configuration per role, each with its own ready image on the microVM. Used by
``stockade prepare`` and by the service at its start (``ServiceConfig.prepare_tiers``).
"""

from __future__ import annotations

from stockade.policy.engine import PolicyEngine
from stockade.policy.schema import Policy
from stockade.sandbox._startup import sandbox_spec
from stockade.sandbox.base import Backend
from stockade.types import Limits

__all__ = ["prepare_policy"]


def prepare_policy(
    backend: Backend, policy: Policy | None, *, limits: Limits | None = None, allow_weaker: bool = False
) -> dict[str, str]:
    """For each role of ``policy`` (its only one without roles; no rules without a policy),
    have ``backend`` build what a sandbox created as the service creates it (those limits,
    the policy's rules, no network) starts from: role ("" for none) -> what the next such
    start starts from (``Backend.prepare_for``)."""
    roles: tuple[str | None, ...] = (None,)
    if policy is not None and policy.roles:
        roles = tuple(policy.roles)
    done: dict[str, str] = {}
    for role in roles:
        rules = PolicyEngine(policy, role=role).sandbox_rules() if policy is not None else None
        spec = sandbox_spec(limits, None, None, allow_weaker, None, rules=rules)
        done[role or ""] = backend.prepare_for(spec)
    return done
