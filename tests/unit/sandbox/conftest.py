"""The supervisor's own modules, imported as the supervisor imports them (by name, from its
folder): what the exec judge runs inside every sandbox, tested here on the host."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stockade.sandbox import _judge

SUPERVISOR = Path(_judge.SOURCE).parent


@pytest.fixture(scope="module")
def execjudge() -> Iterator[Any]:
    sys.path.insert(0, str(SUPERVISOR))  # the supervisor's modules import each other by name
    try:
        yield importlib.import_module("execjudge")
    finally:
        sys.path.remove(str(SUPERVISOR))
