"""What a snapshot keeps of a sandbox's settings: its ``SandboxSpec`` and ``Enforcement`` as
JSON, in the snapshot's manifest, and back. Credentials are never kept."""

from __future__ import annotations

import dataclasses
from typing import Any

from stockade import exceptions as exc
from stockade.sandbox.base import SandboxSpec
from stockade.types import (
    Enforcement,
    HostRule,
    HostShare,
    Limits,
    Mechanism,
    NetworkPolicy,
    ReadOnly,
    SandboxRules,
    limits_from_fields,
    limits_of_old_places,
)

__all__ = ["enforcement_from_state", "enforcement_state", "spec_from_state", "spec_state"]


def spec_state(spec: SandboxSpec) -> dict[str, Any]:
    return {
        "limits": dataclasses.asdict(spec.limits),
        "files_counted": True,  # its places sized by today's rule (``limits_of_old_places``)
        "network": _network_state(spec.network),
        "envs": dict(spec.envs),
        "allow_weaker": spec.allow_weaker,
        "labels": dict(spec.labels),
        "rules": None
        if spec.rules is None
        else {k: list(v) for k, v in dataclasses.asdict(spec.rules).items()},
    }


def spec_from_state(state: dict[str, Any]) -> SandboxSpec:
    """The settings a snapshot's sandbox had (the approver, a callable, is the caller's)."""
    try:
        rules = state.get("rules")
        network = state.get("network") or {}
        return SandboxSpec(
            limits=_limits_from_state(state),
            network=_network_from_state(network),
            envs={str(k): str(v) for k, v in dict(state.get("envs") or {}).items()},
            allow_weaker=bool(state.get("allow_weaker")),
            labels={str(k): str(v) for k, v in dict(state.get("labels") or {}).items()},
            rules=None if rules is None else _rules_from_state(rules),
        )
    except (TypeError, ValueError, KeyError, exc.ConfigurationError) as err:
        raise exc.SnapshotIncompatible(f"the snapshot's settings do not fit this stockade: {err}") from None


def _limits_from_state(state: dict[str, Any]) -> Limits:
    """Every snapshot kept its Limits whole: one kept before a file's kernel memory counted
    (2026-12-06, no ``files_counted``) names the old default count outright, its places sized
    by the old rule; it is restored with those places, in more memory, so its files fit again."""
    limits = dict(state.get("limits") or {})
    return limits_from_fields(limits) if state.get("files_counted") else limits_of_old_places(limits)


def _rules_from_state(rules: dict[str, Any]) -> SandboxRules:
    fields = {k: tuple(v) for k, v in rules.items() if k != "read_only"}
    kept = tuple(
        ReadOnly(paths=tuple(r["paths"]), setting=str(r["setting"])) for r in rules.get("read_only", ())
    )
    return SandboxRules(**fields, read_only=kept)


def _network_state(network: NetworkPolicy) -> dict[str, Any]:
    """All of the policy but its credentials: their sources may hold the secrets themselves,
    and a sandbox that has some is not snapshotted (``SupervisedInstance._snapshot``)."""
    return {
        "enabled": network.enabled,
        "allow_hosts": list(network.allow_hosts),
        "rules": [
            {"host": r.host, "ports": list(r.ports), "methods": list(r.methods)} for r in network.rules
        ],
        "allow_addresses": list(network.allow_addresses),
        "resolve": {name: list(addresses) for name, addresses in network.resolve.items()},
        "max_requests_per_minute": network.max_requests_per_minute,
        "max_bytes_per_minute": network.max_bytes_per_minute,
        "upstream_ca": network.upstream_ca,
    }


def _network_from_state(state: dict[str, Any]) -> NetworkPolicy:
    defaults = NetworkPolicy()
    upstream_ca = state.get("upstream_ca")
    return NetworkPolicy(
        enabled=bool(state.get("enabled")),
        allow_hosts=tuple(str(h) for h in state.get("allow_hosts") or ()),
        rules=tuple(
            HostRule(
                host=str(r["host"]),
                ports=tuple(int(p) for p in r.get("ports") or (80, 443)),
                methods=tuple(str(m) for m in r.get("methods") or ()),
            )
            for r in state.get("rules") or ()
        ),
        allow_addresses=tuple(str(a) for a in state.get("allow_addresses") or ()),
        resolve={str(k): tuple(str(a) for a in v) for k, v in dict(state.get("resolve") or {}).items()},
        max_requests_per_minute=int(state.get("max_requests_per_minute", defaults.max_requests_per_minute)),
        max_bytes_per_minute=int(state.get("max_bytes_per_minute", defaults.max_bytes_per_minute)),
        upstream_ca=None if upstream_ca is None else str(upstream_ca),
    )


def enforcement_state(enforcement: Enforcement) -> dict[str, Any]:
    return dataclasses.asdict(enforcement)


def enforcement_from_state(state: dict[str, Any]) -> Enforcement:
    fields = dict(state)
    host = fields.pop("host", None)
    weakened = tuple(str(w) for w in fields.pop("weakened", ()))
    try:
        margin = float(fields.pop("timeout_margin_s", Enforcement.timeout_margin_s))
        return Enforcement(
            **{k: Mechanism(str(v)) for k, v in fields.items()},
            host=None if host is None else HostShare(**host),
            weakened=weakened,
            timeout_margin_s=margin,
        )
    except (TypeError, ValueError) as err:
        raise exc.SnapshotIncompatible(f"the snapshot's enforcement does not fit here: {err}") from None
