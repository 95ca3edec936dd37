from __future__ import annotations

from collections.abc import Iterator

import pytest
import stamina

from stockade.runs import RunStore, open_run_store


@pytest.fixture(autouse=True)
def no_waiting() -> Iterator[None]:
    """stamina's test mode: retries happen, waits are zero (the reported delays stay real)."""
    stamina.set_testing(True, attempts=10, cap=True)
    yield
    stamina.set_testing(False)


@pytest.fixture
def store() -> Iterator[RunStore]:
    with open_run_store("memory:") as opened:
        yield opened
