"""Fixtures over real tiers. ``TIERS`` lists every tier the conformance suites run on."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Hashable, Iterator

import pytest

from stockade import Limits, Sandbox, StockadeError
from stockade.sandbox import _registry
from tests.conftest import require_tier
from tests.integration.microvm_images import microvm_boot_images  # noqa: F401 - a fixture
from tests.integration.service_env import postgres_url, redis_queue  # noqa: F401 - the service's fixtures

# Every tier must pass the same conformance and containment suites.
TIERS = [t for t in os.environ.get("STOCKADE_TEST_TIERS", ",".join(_registry.TIERS)).split(",") if t]

LIMITS = Limits(memory_mb=256, timeout_s=20, pids=64)


@pytest.fixture(params=TIERS)
def tier(request: pytest.FixtureRequest) -> str:
    name = str(request.param)
    require_tier(name)
    return name


class KeptSandboxes:
    """Sandboxes kept across a module's tests, one per configuration, and reset between
    tests as a pool resets between users (``SandboxPool``): a sandbox's start and close
    (a third of a second for a microVM, more on gVisor) is paid once per module and
    configuration, not once per test. A module's first test of each configuration gets a
    fresh sandbox, the others one that a reset made as it was at start-up, which is what a
    pool hands out: the suites hold on both. A sandbox a reset cannot bring back (a test
    killed it, or closed it) is closed, and the next test gets a fresh one."""

    def __init__(self) -> None:
        self._idle: dict[Hashable, Sandbox] = {}

    @contextlib.contextmanager
    def take(self, key: Hashable, create: Callable[[], Sandbox]) -> Iterator[Sandbox]:
        sandbox = self._idle.pop(key, None) or create()
        try:
            yield sandbox
        finally:
            if self._reset(sandbox):
                self._idle[key] = sandbox

    @staticmethod
    def _reset(sandbox: Sandbox) -> bool:
        if sandbox.alive:
            try:
                sandbox.reset()
                return True
            except StockadeError:
                pass  # a test left it past saving: it is closed below
        sandbox.close()
        return False

    def close(self) -> None:
        while self._idle:
            self._idle.popitem()[1].close()


@pytest.fixture(scope="module")
def kept_sandboxes() -> Iterator[KeptSandboxes]:
    kept = KeptSandboxes()
    try:
        yield kept
    finally:
        kept.close()


@pytest.fixture
def sbx(tier: str, kept_sandboxes: KeptSandboxes) -> Iterator[Sandbox]:
    with kept_sandboxes.take(tier, lambda: Sandbox.create(tier, limits=LIMITS)) as sandbox:
        yield sandbox
