"""The kill switch against the real process tier: a kill from another process stops a
``sleep 1000`` inside the sandbox within a second."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from stockade import Limits, Sandbox
from stockade import exceptions as exc
from stockade.runtime.killswitch import FileKillSource, KillSwitch
from tests.conftest import require_tier

pytestmark = pytest.mark.process


def test_a_kill_from_another_process_stops_sleep_1000_within_a_second(tmp_path: Path) -> None:
    require_tier("process")
    switch = KillSwitch("run-kill-1", [FileKillSource(tmp_path)], poll_s=0.05)
    with Sandbox.create("process", limits=Limits(timeout_s=1200)) as raw:
        sbx = Sandbox(switch.attach(raw.instance))
        killer = subprocess.Popen(
            [sys.executable, "-c",
             "import sys, time; from stockade.runtime.killswitch import FileKillSource;"
             "time.sleep(1.0); FileKillSource(sys.argv[1]).kill('run-kill-1', 'from another process');"
             "print(time.time(), flush=True)", str(tmp_path)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        with switch.watch():
            started = time.time()
            with pytest.raises(exc.RunKilled) as killed:
                sbx.commands.run("sleep 1000")
            stopped = time.time()
        killed_at = float(killer.communicate(timeout=10)[0])
        assert killed.value.reason == "from another process"
        assert stopped - killed_at < 1.0, f"took {stopped - killed_at:.2f}s after the kill"
        assert stopped - started < 10
        assert not raw.alive
