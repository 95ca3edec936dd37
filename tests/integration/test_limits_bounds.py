"""The largest limits ``Limits`` accepts start a sandbox: its ranges are what the tier takes."""

from __future__ import annotations

import pytest

from stockade import Limits, Sandbox
from stockade.types._limits import _LIMIT_RANGES
from tests.conftest import require_tier

pytestmark = pytest.mark.process


def test_the_top_of_every_range_starts_on_the_process_tier() -> None:
    require_tier("process")
    top = {name: (int(high) if integer else high) for name, (integer, _, high, _) in _LIMIT_RANGES.items()}
    # The files are memory: at the top of memory_mb, their bytes and the top count of files
    # (3 KiB each) take under three quarters of it.
    top["disk_mb"] = top["memory_mb"] // 2
    top["tmp_mb"] = top["memory_mb"] // 16
    with Sandbox.create("process", limits=Limits(**top)) as sbx:  # type: ignore[arg-type]
        assert sbx.commands.run("echo ok").stdout == "ok\n"
