"""A Ctrl-C inside the Docker tier's start or close leaves no container: one interrupted while
the engine answered its create (its id not known yet) was left until ``stockade gc``, and one
interrupted mid-removal was left for good (its finalizer was spent before the removal ended)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import require_tier

CHILD = Path(__file__).with_name("interrupt_child.py")
ROOT = Path(__file__).resolve().parents[2]


def _containers(label: str) -> list[str]:
    argv = ["docker", "ps", "-aq", "--filter", f"label=stockade.creator={label}"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()


def _interrupted(where: str) -> tuple[str, str]:
    """The child's creator token and what it printed, once it has exited."""
    require_tier("docker")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(CHILD), where], capture_output=True, text=True, timeout=300, check=False, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    token, said = done.stdout.split()[-2:]
    return token, said


def test_an_interrupt_while_the_engine_answers_the_create_leaves_no_container() -> None:
    token, left = _interrupted("create")
    assert left == "[]"  # gone once the start raised
    assert _containers(token) == []


def test_an_interrupt_mid_close_leaves_no_container_after_exit() -> None:
    token, _ = _interrupted("close")
    assert _containers(token) == []
