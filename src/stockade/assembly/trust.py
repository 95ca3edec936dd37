"""What trust decides before anything starts: the policy with the caller's trust merged in
(the stricter wins: a caller can tighten the policy, never loosen it), and the tier that trust
allows on this host (an explicit one outside them fails closed with ``TierUnavailable``).

Functions of the policy and the request alone, apart from the agent they configure:
``stockade policy check`` asks ``effective_trust`` without assembling one.
"""

from __future__ import annotations

from pathlib import Path

from stockade._checks import check_choice
from stockade.exceptions import TierUnavailable
from stockade.policy.engine import PolicyEngine
from stockade.policy.load import load_policy
from stockade.policy.schema import Policy, TrustRules
from stockade.sandbox._registry import Preference
from stockade.sandbox.base import Backend
from stockade.types import Trust

__all__ = ["choose_tier", "effective_trust", "load_with_trust"]

# Weakest to strictest: a caller may tighten the policy's trust, never loosen it.
_TRUST_ORDER = (Trust.TRUSTED, Trust.INTERNAL, Trust.UNTRUSTED, Trust.MULTI_TENANT)


def effective_trust(policy: Policy, trust: Trust | None) -> Trust:
    """The stricter of the policy's trust and the caller's."""
    if trust is None:
        return policy.trust.level
    return max(policy.trust.level, check_choice(Trust, trust, argument="trust"), key=_TRUST_ORDER.index)


def load_with_trust(policy: str | Path | Policy | None, trust: Trust | None) -> Policy:
    if policy is None:  # no file: the caller's trust is the only word (default: untrusted)
        level = check_choice(Trust, trust, argument="trust") if trust is not None else Trust.UNTRUSTED
        return Policy(trust=TrustRules(level=level))
    loaded = policy if isinstance(policy, Policy) else load_policy(policy)
    level = effective_trust(loaded, trust)
    return loaded.model_copy(update={"trust": loaded.trust.model_copy(update={"level": level})})


def choose_tier(
    engine: PolicyEngine, tier: str | None, backend: Backend | None, prefer: Preference | None = None
) -> tuple[str, str]:
    """The tier, and in words why it is that one."""
    asked = backend.tier if backend is not None else tier
    level = engine.policy.trust.level.value
    if asked is None:
        order = prefer or engine.policy.trust.prefer
        chosen = engine.select_tier(order)
        return chosen, f"the {order} tier trust {level!r} allows on this host"
    allowed = engine.allowed_tiers()
    if asked not in allowed:
        hint = (
            "a declared compliance profile needs the strongest isolation"
            if engine.policy.compliance.profiles
            else 'or, if your own team wrote the code this agent runs, set trust = "trusted" (the '
            "policy's [trust] level, or --trust trusted)"
        )
        raise TierUnavailable(
            f"tier {asked!r} is weaker than {engine.why_tiers()} allows (one of: "
            f"{', '.join(allowed) or 'none'}); use one of those tiers; {hint}"
        )
    return asked, f"{'the backend given' if backend is not None else 'asked for'}; trust {level!r} allows it"
