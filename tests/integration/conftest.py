"""Fixtures over real tiers. ``TIERS`` lists every tier the conformance suites run on."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from stockade import Limits, Sandbox
from stockade.sandbox import _registry
from tests.conftest import require_tier
from tests.integration.microvm_images import microvm_boot_images  # noqa: F401 - a fixture
from tests.integration.service_env import postgres_url, redis_queue  # noqa: F401 - the service's fixtures

# Every tier must pass the same conformance and containment suites.
TIERS = [t for t in os.environ.get("STOCKADE_TEST_TIERS", ",".join(_registry.TIERS)).split(",") if t]


@pytest.fixture(params=TIERS)
def tier(request: pytest.FixtureRequest) -> str:
    name = str(request.param)
    require_tier(name)
    return name


@pytest.fixture
def sbx(tier: str) -> Iterator[Sandbox]:
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=20, pids=64)) as sandbox:
        yield sandbox
