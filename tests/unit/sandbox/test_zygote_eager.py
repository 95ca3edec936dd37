"""When the zygote loads ``site`` at once (supervisor/zygote.py ``eager``): only where a CPU is
likely free for it. Elsewhere the load would compete with the create and a first command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import stockade.sandbox.supervisor as supervisor_package

FOLDER = str(Path(supervisor_package.__file__).parent)


def eager(loadavg: Path, cpus: set[int]) -> bool:
    """``zygote.eager`` in a process of its own, which runs on ``cpus`` only and imports
    the zygote as the supervisor does (its sibling modules on the path)."""
    script = (
        f"import os, sys; os.sched_setaffinity(0, {sorted(cpus)!r}); sys.path.insert(0, {FOLDER!r}); "
        f"import zygote; print(zygote.eager({str(loadavg)!r}))"
    )
    out = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def two_cpus() -> set[int]:
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("this host gives us one CPU")
    return set(mine[:2])


def test_a_quiet_host_with_two_cpus_loads_at_once(tmp_path: Path) -> None:
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.42 0.30 0.20 1/180 4242\n")
    assert eager(loadavg, two_cpus())


def test_a_busy_host_loads_on_the_first_request(tmp_path: Path) -> None:
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("2.50 1.10 0.70 3/180 4242\n")
    assert not eager(loadavg, two_cpus())


def test_one_cpu_loads_on_the_first_request(tmp_path: Path) -> None:
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.00 0.00 0.00 1/180 4242\n")
    assert not eager(loadavg, {min(os.sched_getaffinity(0))})


def test_a_load_that_is_not_known_loads_on_the_first_request(tmp_path: Path) -> None:
    """gVisor's /proc/loadavg: 0 and no tasks, whatever the host does."""
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.00 0.00 0.00 0/0 0\n")
    assert not eager(loadavg, two_cpus())
    assert not eager(tmp_path / "absent", two_cpus())
