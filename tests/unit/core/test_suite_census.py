"""The suite's own check that it leaves no trace (tests/conftest.py): what a leaked sandbox
would leave, it sees."""

from __future__ import annotations

import subprocess

from tests.conftest import _CHECKOUT, _checkout_files, _tier_processes, wait_for


def test_a_tier_process_left_running_is_counted_as_a_trace() -> None:
    before = set(_tier_processes(mine_only=True))
    leaked = subprocess.Popen(["bash", "-c", "exec -a stockade-leaked-sandbox sleep 60"])

    def counted() -> list[str]:
        new = set(_tier_processes(mine_only=True)) - before
        return [cmd for pid, cmd in new if pid == leaked.pid and cmd.startswith("stockade-leaked-sandbox")]

    try:  # bash takes its new name at its exec, a moment after Popen returns (longer on a busy host)
        wait_for(counted, what="the census to count the leaked process by its new name")
    finally:
        leaked.kill()
        leaked.wait()
    assert leaked.pid not in {pid for pid, _ in _tier_processes(mine_only=True)}


def test_a_file_left_in_the_checkout_is_counted_as_a_trace() -> None:
    stray = _CHECKOUT / "tests" / "stray-output.txt"
    stray.write_text("written where it should not be")
    try:
        assert "tests/stray-output.txt" in _checkout_files()
    finally:
        stray.unlink()
    assert "tests/stray-output.txt" not in _checkout_files()
