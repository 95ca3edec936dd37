from __future__ import annotations

from collections.abc import Iterator

import pytest
import stamina

from stockade.runtime.clock import ManualClock
from stockade.runtime.events import RuntimeEvent


@pytest.fixture(autouse=True)
def no_waiting() -> Iterator[None]:
    """stamina's test mode: retries happen, waits are zero."""
    stamina.set_testing(True, attempts=10, cap=True)
    yield
    stamina.set_testing(False)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def events() -> list[RuntimeEvent]:
    return []
