"""A Ctrl-C inside a tier's start or close leaves nothing on the host. Docker's container
interrupted while the engine answered its create (its id not known yet) was left until
``stockade gc``; on every tier, a close interrupted mid-teardown left the sandbox's processes,
container, cgroups, mounts or folders for good (its finalizer was spent before the teardown
ended, and the kill marked done)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from stockade.sandbox._guest import default_state_dir
from tests.conftest import require_tier

CHILD = Path(__file__).with_name("interrupt_child.py")
ROOT = Path(__file__).resolve().parents[2]


def _interrupted(tier: str, where: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """What the child said, once it has exited (its exit hooks run)."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT / "src")}
    argv = [sys.executable, str(CHILD), tier, where]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return report


def _containers(label: str) -> list[str]:
    argv = ["docker", "ps", "-aq", "--filter", f"label={label}"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()


def _traces(sid: str) -> list[str]:
    """What of sandbox ``sid`` is on this host: processes, mounts, cgroups, folders, containers."""
    mark = sid.removeprefix("sbx-")
    found = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            if mark.encode() in Path(cmdline).read_bytes():
                found.append(cmdline)
        except OSError:
            continue  # gone meanwhile
    found += [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if mark in line]
    for pattern in (
        "/sys/fs/cgroup/*",
        "/sys/fs/cgroup/*/*",
        "/sys/fs/cgroup/*/*/*",
        f"{default_state_dir()}/*",
    ):
        found += [path for path in glob.glob(pattern) if mark in path]
    return found + _containers(f"stockade.id={sid}")


def test_an_interrupt_while_the_engine_answers_the_create_leaves_no_container() -> None:
    require_tier("docker")
    report = _interrupted("docker", "create")
    assert report["left"] == []  # gone once the start raised
    assert _containers(f"stockade.creator={report['token']}") == []


def test_an_interrupt_mid_close_leaves_nothing_after_exit(tier: str) -> None:
    report = _interrupted(tier, "close")
    assert report["sid"] is not None
    assert _traces(report["sid"]) == []


def test_an_interrupt_mid_close_of_runsc_without_docker_leaves_nothing_after_exit() -> None:
    require_tier("gvisor")
    report = _interrupted("gvisor", "close", {"STOCKADE_GVISOR_MODE": "runsc"})
    assert report["sid"] is not None
    assert _traces(report["sid"]) == []
