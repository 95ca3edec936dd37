"""How a sandbox starts: its settings (``SandboxSpec``), its tier (by name or by trust), and
the settings of a sandbox started from a snapshot or resumed from a pause."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from stockade import exceptions as exc
from stockade._checks import check_choice, check_envs, check_instance, check_labels
from stockade.sandbox import _registry
from stockade.sandbox._approver import Approver, check_approver
from stockade.sandbox._supervised import spec_from_state
from stockade.sandbox.base import AsyncBackend, Backend, SandboxSpec
from stockade.sandbox.snapshots import SnapshotStore
from stockade.types import (
    Limits,
    NetworkPolicy,
    ReadOnly,
    SandboxRules,
    Snapshot,
    SnapshotKind,
    Trust,
)

__all__ = [
    "check_backend",
    "check_store",
    "choose_tier",
    "from_snapshot",
    "rules_changed",
    "sandbox_spec",
    "store_of",
]


def sandbox_spec(
    limits: Limits | None,
    network: NetworkPolicy | None,
    envs: Mapping[str, str] | None,
    allow_weaker: bool,
    labels: Mapping[str, str] | None,
    *,
    rules: SandboxRules | None = None,
    approver: Approver | None = None,
) -> SandboxSpec:
    if limits is not None and not isinstance(limits, Limits):
        raise exc.InvalidArgument(
            f"limits must be a Limits, got {type(limits).__name__}",
            argument="limits",
            fix="give Limits(memory_mb=..., timeout_s=...)",
        )
    if network is not None:
        check_instance(
            network, NetworkPolicy, argument="network", fix='give NetworkPolicy(allow_hosts=("pypi.org",))'
        )
    if rules is not None:
        check_instance(rules, SandboxRules, argument="rules", fix='give SandboxRules(deny=("curl",))')
    if not isinstance(allow_weaker, bool):
        raise exc.InvalidArgument(
            f"allow_weaker must be True or False, got {type(allow_weaker).__name__}",
            argument="allow_weaker",
            fix="give True to accept weaker enforcement, or leave it out",
        )
    check_approver(approver)
    return SandboxSpec(
        limits=limits or Limits(),
        network=network or NetworkPolicy(),
        envs=check_envs(envs),
        allow_weaker=allow_weaker,
        labels=check_labels(labels),
        rules=rules,
        approver=approver,
    )


def check_store(store: object) -> SnapshotStore:
    """``store``, or the default one where none is given."""
    if store is None:
        return SnapshotStore.default()
    return check_instance(
        store,
        SnapshotStore,
        argument="store",
        fix="give SnapshotStore(root), or leave it out for the default one",
    )


def check_backend(backend: object, *, asynchronous: bool = False) -> None:
    """A backend given is a ``Backend`` (or, to an async sandbox, an ``AsyncBackend``) instance."""
    kinds: tuple[type, ...] = (Backend, AsyncBackend) if asynchronous else (Backend,)
    if backend is None or isinstance(backend, kinds):
        return
    wanted = "a Backend or AsyncBackend" if asynchronous else "a Backend"
    fix = "give an instance (ProcessBackend()), or leave it out and choose the tier with tier="
    if isinstance(backend, str):  # a tier's name given where its backend goes
        fix = (
            f"to choose the tier by name give tier={backend!r}; backend= takes an instance (ProcessBackend())"
        )
    elif isinstance(backend, type):
        fix = f"give an instance of it ({backend.__name__}()), not the class"
    raise exc.InvalidArgument(
        f"backend must be {wanted} instance, got {backend!r} ({type(backend).__name__})",
        argument="backend",
        fix=fix,
    )


def store_of(snapshot: Snapshot | str, store: SnapshotStore | None) -> SnapshotStore:
    """The store a sandbox starting from ``snapshot`` reads: ``store``, else a ``Snapshot``'s
    own, else the default one."""
    if not isinstance(snapshot, Snapshot | str):
        raise exc.InvalidArgument(
            f"snapshot must be a Snapshot or its id, got {type(snapshot).__name__}", argument="snapshot"
        )
    if store is not None or not isinstance(snapshot, Snapshot):
        return check_store(store)
    return SnapshotStore(Path(snapshot.store))


def from_snapshot(
    snapshot: Snapshot | str,
    store: SnapshotStore | None,
    tier: str | None,
    spec: SandboxSpec,
    given: Mapping[str, object],
    *,
    sandbox_id: str | None = None,
) -> tuple[str, SandboxSpec]:
    """The tier and settings of a sandbox started from ``snapshot``: the snapshot's, but what
    the caller gave (``given``: only what was not None). Memory keeps its machine: a snapshot
    of memory refuses other limits, and other rules (its supervisor, its masks and its kernel's
    confinement are the snapshot's: restored, they would enforce the old rules while the
    sandbox reported the new), and restores on another tier only its files, if it has them.
    """
    chosen = store_of(snapshot, store)
    manifest = chosen.load(snapshot)
    value = manifest.snapshot
    kept = spec_from_state(manifest.spec)
    if value.kind is SnapshotKind.MEMORY and (tier is None or tier == value.tier):
        changed = sorted(k for k, v in given.items() if v is not None and k != "envs")
        if changed or given.get("envs"):
            raise exc.SnapshotIncompatible(
                f"snapshot {value.id} keeps a running sandbox's memory: its {', '.join(changed) or 'envs'} "
                "cannot change (take a files snapshot, memory=False, to start from it with other settings)"
            )
        differences = rules_changed(kept.rules, spec.rules)
        if differences:
            raise exc.SnapshotIncompatible(
                f"snapshot {value.id} keeps a running sandbox's memory, under the rules it was taken "
                f"with: its rules cannot change ({'; '.join(differences)}); take a files snapshot, "
                "memory=False, to start from it under other rules"
            )
        spec = dataclasses.replace(spec, rules=kept.rules)  # the rules in force, as Sandbox.rules says
    limits = given.get("limits")
    network = given.get("network")
    envs = given.get("envs")
    merged = SandboxSpec(
        limits=limits if isinstance(limits, Limits) else kept.limits,
        network=network if isinstance(network, NetworkPolicy) else kept.network,
        envs={**kept.envs, **(envs if isinstance(envs, Mapping) else {})},
        allow_weaker=spec.allow_weaker or kept.allow_weaker,
        labels={**kept.labels, **spec.labels},
        rules=spec.rules if spec.rules is not None else kept.rules,
        approver=spec.approver,
        snapshot=value,
        sandbox_id=sandbox_id,
    )
    return tier or value.tier, merged


def rules_changed(kept: SandboxRules | None, asked: SandboxRules | None) -> list[str]:
    """How the rules ``asked`` for differ from those a memory snapshot ``kept`` (each field
    that differs: ``deny ('whoami',), not ()``); none when none were asked for (the snapshot's
    hold). No rules and the empty ``SandboxRules()`` enforce the same: they do not differ."""
    if asked is None:
        return []
    then, now = kept or SandboxRules(), asked
    return [
        f"{field.name} {getattr(now, field.name)!r}, not {getattr(then, field.name)!r}"
        for field in dataclasses.fields(SandboxRules)
        if _enforced(getattr(now, field.name)) != _enforced(getattr(then, field.name))
    ]


def _enforced(rules: tuple[str | ReadOnly, ...]) -> frozenset[object]:
    """One field of ``SandboxRules`` as a sandbox enforces it: a set. A command matches if any
    pattern does, a path if any glob does, whatever their order or repeats (a policy that only
    reordered its ``commands.deny`` made every paused memory sandbox incompatible)."""
    return frozenset((frozenset(r.paths), r.setting) if isinstance(r, ReadOnly) else r for r in rules)


def choose_tier(
    tier: str | None, trust: Trust | str | None, prefer: _registry.Preference = "cheapest"
) -> str:
    if prefer not in ("cheapest", "strongest") or not isinstance(prefer, str):
        raise exc.InvalidArgument(
            f"prefer is {prefer!r}", argument="prefer", fix="give 'cheapest' or 'strongest'"
        )
    if tier is not None and (not isinstance(tier, str) or tier not in _registry.TIERS):
        raise exc.InvalidArgument(
            f"unknown tier {tier!r}", argument="tier", fix=f"give one of {', '.join(_registry.TIERS)}"
        )
    if trust is None:
        return tier or "process"
    level = check_choice(Trust, trust, argument="trust")
    allowed = _registry.allowed_tiers(level)
    if tier is not None:
        if tier not in allowed:
            raise exc.TierUnavailable(
                f"tier {tier!r} is too weak for trust {level.value!r}; allowed: {', '.join(allowed)}"
            )
        return tier
    return _registry.select_tier(level, prefer=prefer)
