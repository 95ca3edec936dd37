"""Tier names to lazily imported backends; tier choice by trust (the README's trust table).

Importing stockade never imports docker-py or probes the host: a tier module is imported
the first time someone asks for that tier.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import threading
from typing import Literal

from stockade.exceptions import ConfigurationError, TierUnavailable
from stockade.sandbox.base import Backend
from stockade.types import TierReport, Trust

# Weakest to strongest isolation, which is also cheapest to dearest to start (docs/benchmarks.md).
TIERS: dict[str, tuple[str, str, str]] = {
    "process": ("stockade.sandbox.process", "ProcessBackend", "apt-get install bubblewrap"),
    "docker": ("stockade.sandbox.docker", "DockerBackend", 'pip install "stockade[docker]"'),
    "gvisor": (
        "stockade.sandbox.gvisor",
        "GVisorBackend",
        'pip install "stockade[docker]"; apt-get install runsc',
    ),
    "microvm": ("stockade.sandbox.microvm", "MicroVMBackend", "apt-get install qemu-system-x86"),
}
STRENGTH = tuple(TIERS)
# The tiers in words, for help texts: "process, docker, gvisor or microvm".
NAMES = f"{', '.join(STRENGTH[:-1])} or {STRENGTH[-1]}"

# The minimum tier for each kind of trust, and the tiers that satisfy it.
_ALLOWED: dict[Trust, tuple[str, ...]] = {
    Trust.TRUSTED: STRENGTH,
    Trust.INTERNAL: ("docker", "gvisor", "microvm"),
    Trust.UNTRUSTED: ("microvm",),
    Trust.MULTI_TENANT: ("microvm",),
}

_cache: dict[str, Backend] = {}
_probes: dict[str, TierReport] = {}
_lock = threading.Lock()


def _forked() -> None:
    """A forked child starts its own backends: the parent's hold what the parent started ahead
    (a spare, a QEMU waiting), which a child's create would take from under the parent."""
    if _lock.locked():  # by a thread of the parent's, which the child does not have
        _lock.release()
    _cache.clear()


os.register_at_fork(after_in_child=_forked)


def backend(tier: str) -> Backend:
    """The backend of a tier, created once per process."""
    if tier not in TIERS:
        raise ConfigurationError(f"unknown tier {tier!r}; choose one of {', '.join(TIERS)}")
    with _lock:
        found = _cache.get(tier)
        if found is not None:
            return found
        module_name, cls_name, hint = TIERS[tier]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name == module_name:
                raise TierUnavailable(f"tier {tier!r} is not part of this stockade version") from None
            raise TierUnavailable(f"tier {tier!r} needs {err.name!r}: {hint}") from None
        created: Backend = getattr(module, cls_name)()
        _cache[tier] = created
        return created


def stop_background() -> None:
    """Stop what this process's backends run ahead of need (the microVM tier's QEMU started
    ahead of the next create). Sandboxes live on. A process that ends by a signal (a service's
    SIGTERM: uvicorn raises it again once the app is closed) runs no finalizer, and such a
    QEMU left its folder and cgroup behind: a long-running process calls this as it closes."""
    with _lock:
        backends = list(_cache.values())
    for found in backends:
        stop = getattr(found, "close", None)  # a backend that runs something in the background
        if callable(stop):
            with contextlib.suppress(Exception):  # each is stopped, whatever one of them says
                stop()


def probe(tier: str) -> TierReport:
    with _lock:
        cached = _probes.get(tier)
    if cached is not None:
        return cached
    module_name, _, hint = TIERS[tier]
    if importlib.util.find_spec(module_name) is None:
        report = TierReport(tier=tier, available=False, detail="not implemented in this stockade version")
    else:
        try:
            report = backend(tier).probe()
        except (TierUnavailable, ConfigurationError) as err:
            report = TierReport(tier=tier, available=False, detail=str(err), fixes=(hint,))
    with _lock:
        _probes[tier] = report
    return report


def allowed_tiers(trust: Trust, *, allow_gvisor_for_untrusted: bool = False) -> tuple[str, ...]:
    allowed = _ALLOWED[trust]
    if trust is Trust.UNTRUSTED and allow_gvisor_for_untrusted:
        allowed = ("gvisor", *allowed)
    return allowed


Preference = Literal["cheapest", "strongest"]


def choose(allowed: tuple[str, ...], *, prefer: Preference = "cheapest", why: str) -> str:
    """Of the ``allowed`` tiers, the cheapest this host supports (or the strongest, if
    ``prefer="strongest"``); fail closed when none works. ``why`` says what allowed them."""
    if prefer not in ("cheapest", "strongest"):
        from stockade.exceptions import InvalidArgument  # lazily: only a wrong call pays for it

        raise InvalidArgument(
            f"prefer is {prefer!r}", argument="prefer", fix='give "cheapest" (the default) or "strongest"'
        )
    order = STRENGTH if prefer == "cheapest" else tuple(reversed(STRENGTH))
    tried = []
    for tier in order:
        if tier in allowed:
            report = probe(tier)
            if report.available:
                return tier
            tried.append(f"{tier}: {report.detail}")
    raise TierUnavailable(
        f"{why} needs one of {', '.join(allowed) or 'no tier'}, and none works on this host "
        f"({'; '.join(tried) or 'nothing to try'}). stockade refuses to fall back to a weaker tier."
    )


def select_tier(
    trust: Trust, *, allow_gvisor_for_untrusted: bool = False, prefer: Preference = "cheapest"
) -> str:
    """The cheapest tier this host supports that the trust table allows (trust sets the
    minimum), or the strongest with ``prefer="strongest"``; fail closed."""
    allowed = allowed_tiers(trust, allow_gvisor_for_untrusted=allow_gvisor_for_untrusted)
    return choose(allowed, prefer=prefer, why=f"trust {trust.value!r}")
