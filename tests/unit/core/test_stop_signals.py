"""A stop signal (SIGTERM, SIGINT, SIGHUP) that arrives while a command removes its sandboxes
waits for the removal to end, then stops the command with its exit code (128 + its number): cut
short, the close left behind what it was removing. Each case runs in a process of its own,
whose close signals that very process (as a client closing stdin, then signalling, does)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MCP = """
import os, signal, sys
from stockade.cli.mcp_cmds import _served

class Face:  # stockade mcp's face, whose close (every session's) a signal reaches midway
    def close(self):
        os.kill(os.getpid(), SIGNUM)
        print("every sandbox removed", flush=True)

print("exit code", _served(Face(), lambda: None), flush=True)
"""

CLOSED_WHOLE = """
import contextlib, os, signal
from stockade.cli._signals import Interrupted, closed_whole, interruptible

@contextlib.contextmanager
def sandbox():
    try:
        yield "sbx"
    finally:
        os.kill(os.getpid(), SIGNUM)  # the close is under way: the signal is held
        print("removed", flush=True)

try:
    with interruptible(), closed_whole(sandbox()) as sbx:
        FIRST
    print("not stopped", flush=True)
except Interrupted as stop:
    print("stopped by", stop, flush=True)
"""


def _run(program: str, signum: int, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(program).replace("SIGNUM", str(int(signum))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_while_stockade_mcp_closes_its_sessions_waits_for_the_close(
    signum: int, tmp_path: Path
) -> None:
    """The close ran with the default handlers back: SIGTERM ended the process at once, SIGINT
    raised KeyboardInterrupt inside it, and the sessions' sandboxes stayed."""
    done = _run(MCP, signum, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["every sandbox removed", f"exit code {128 + signum}"], done.stderr
    assert f"stopped by {signal.Signals(signum).name}" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_a_sandbox_is_removed_stops_the_command_once_it_is_removed(
    signum: int, tmp_path: Path
) -> None:
    """`stockade exec`'s command ended, its sandbox was being removed: the signal raised
    Interrupted inside the removal."""
    done = _run(CLOSED_WHOLE.replace("FIRST", "pass"), signum, tmp_path)
    assert done.stdout.splitlines() == ["removed", f"stopped by {signal.Signals(signum).name}"], done.stderr


def test_a_second_signal_while_the_first_ones_removal_runs_is_held(tmp_path: Path) -> None:
    """A second Ctrl-C (or a supervisor's second SIGTERM) raised Interrupted inside the removal
    the first one began; it ends now, and the first signal is the one reported."""
    first = "os.kill(os.getpid(), signal.SIGHUP)"
    done = _run(CLOSED_WHOLE.replace("FIRST", first), signal.SIGINT, tmp_path)
    assert done.stdout.splitlines() == ["removed", "stopped by SIGHUP"], done.stderr
