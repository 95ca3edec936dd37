"""Fixtures over real tiers. ``TIERS`` lists every tier the conformance suites run on."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from stockade import Limits, NetworkPolicy, Sandbox, SandboxPool, SandboxRules
from stockade.sandbox import _registry
from tests.conftest import require_tier
from tests.integration.microvm_images import microvm_boot_images  # noqa: F401 - a fixture
from tests.integration.service_env import postgres_url, redis_queue  # noqa: F401 - the service's fixtures
from tests.integration.written_library import written_library  # noqa: F401 - a fixture

# Every tier must pass the same conformance and containment suites.
TIERS = [t for t in os.environ.get("STOCKADE_TEST_TIERS", ",".join(_registry.TIERS)).split(",") if t]

LIMITS = Limits(memory_mb=256, timeout_s=20, pids=64)


def fork_bomb_limits(tier: str) -> Limits:
    """64 slots, and memory for 64 copies of Python: on gVisor their pages filled 512 MiB under
    load and ended the whole sandbox (the memory limit's job, not a fork bomb test's subject).
    The microVM's guest kernel shares a fork's pages until written, as the host's does for the
    process and Docker tiers; there a guest of 2 GiB would be a machine of its own, whose boot
    image (20 s under TCG) nothing else in the run starts from: its default 512 MiB."""
    return Limits(pids=64, memory_mb=512 if tier == "microvm" else 2048)


@pytest.fixture(params=TIERS)
def tier(request: pytest.FixtureRequest) -> str:
    name = str(request.param)
    require_tier(name)
    return name


class KeptSandboxes:
    """A pool of one sandbox per tier and policy (``SandboxPool``, size 1), kept across a
    module's tests: a start and close (a third of a second for a microVM, more on gVisor) is
    paid once per module, tier and policy, not once per test. A module's first test of each tier gets a fresh
    sandbox, the others one the pool's reset made as it was at start-up, which is what a pool
    hands its users: the suites hold on both. One a test killed or closed is replaced."""

    def __init__(self) -> None:
        self._pools: dict[tuple[str, SandboxRules | None, str], SandboxPool] = {}

    def acquire(
        self, tier: str, rules: SandboxRules | None = None, network: NetworkPolicy | None = None
    ) -> contextlib.AbstractContextManager[Sandbox]:
        """One of ``tier`` under ``rules`` (on gVisor, which holds only their masks, weaker)
        and ``network``."""
        key = (tier, rules, repr(network))  # a policy holds a dict: its text is the key
        if key not in self._pools:
            weaker = rules is not None and tier == "gvisor"
            self._pools[key] = SandboxPool(
                tier, size=1, limits=LIMITS, rules=rules, network=network, allow_weaker=weaker
            )
        return self._pools[key].acquire()

    def close(self) -> None:
        while self._pools:
            self._pools.popitem()[1].close()


@pytest.fixture(scope="module")
def kept_sandboxes() -> Iterator[KeptSandboxes]:
    kept = KeptSandboxes()
    try:
        yield kept
    finally:
        kept.close()


@pytest.fixture
def sbx(tier: str, kept_sandboxes: KeptSandboxes) -> Iterator[Sandbox]:
    with kept_sandboxes.acquire(tier) as sandbox:
        yield sandbox
