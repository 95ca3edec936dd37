from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from stockade import exceptions as exc
from stockade.runtime.events import KillRequested, RuntimeEvent
from stockade.runtime.killswitch import FileKillSource, KillSwitch, MemoryKillSource
from stockade.sandbox.ops import RunCommand
from stockade.testing import FakeInstance
from stockade.types import CommandResult


def test_a_kill_file_stops_the_run_between_steps(tmp_path: Path) -> None:
    source = FileKillSource(tmp_path)
    switch = KillSwitch("run-1", [source])
    switch.check()
    FileKillSource(tmp_path).kill("run-1", "operator said so")  # e.g. another process
    with pytest.raises(exc.RunKilled) as killed:
        switch.check()
    assert killed.value.status == "killed" and killed.value.reason == "operator said so"


@pytest.mark.parametrize("plant", ["folder", "fifo", "link"])
def test_anything_but_a_file_in_the_switchs_place_kills_and_kill_still_works(
    tmp_path: Path, plant: str
) -> None:
    """A folder planted as `<kill dir>/run-1` made reading it fail, which the watcher took for
    an unreachable source: the run could not be killed there (and a FIFO blocked the read)."""
    target = tmp_path / "run-1"
    if plant == "folder":
        (target / "x").mkdir(parents=True)
    elif plant == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(exc.RunKilled, match="not a file"):
        KillSwitch("run-1", [FileKillSource(tmp_path)]).check()
    if plant == "folder":
        FileKillSource(tmp_path).kill("run-1", "operator said so")
        assert FileKillSource(tmp_path).reason("run-1") == "operator said so"


def test_another_run_is_not_affected(tmp_path: Path) -> None:
    FileKillSource(tmp_path).kill("run-2", "x")
    KillSwitch("run-1", [FileKillSource(tmp_path)]).check()


def test_killing_closes_every_attached_sandbox_and_refuses_further_ops(events: list[RuntimeEvent]) -> None:
    switch = KillSwitch("run-1", observer=events.append)
    inner = FakeInstance(lambda op: CommandResult(exit_code=0, stdout="", stderr="", duration_s=0), "fake", 1)
    instance = switch.attach(inner)
    switch.kill("stop")
    assert inner.closed
    with pytest.raises(exc.RunKilled):
        instance.execute(RunCommand(argv=("true",)))
    assert events == [KillRequested(run_id="run-1", reason="stop", killed_instances=1)]


def test_an_op_interrupted_by_the_kill_reports_the_kill_not_a_crash() -> None:
    switch = KillSwitch("run-1")
    started = threading.Event()

    def handler(op):  # type: ignore[no-untyped-def]
        started.set()
        assert stopped.wait(5)
        raise exc.SandboxClosed("closed under us")

    stopped = threading.Event()
    inner = FakeInstance(handler, "fake", 1)
    instance = switch.attach(inner)

    def pull() -> None:
        started.wait(5)
        switch.kill("enough")
        stopped.set()

    threading.Thread(target=pull).start()
    with pytest.raises(exc.RunKilled):
        instance.execute(RunCommand(argv=("sleep", "1000")))


def test_the_watcher_polls_the_sources() -> None:
    source = MemoryKillSource()
    switch = KillSwitch("run-1", [source], poll_s=0.01)
    inner = FakeInstance(lambda op: None, "fake", 1)
    switch.attach(inner)
    with switch.watch():
        source.kill("run-1", "api call")
        for _ in range(500):
            if inner.closed:
                break
            threading.Event().wait(0.01)
    assert inner.closed and switch.killed


def test_an_unreachable_source_does_not_kill_the_run() -> None:
    class Broken:
        def reason(self, run_id: str) -> str | None:
            raise ConnectionError("redis down")

        def kill(self, run_id: str, reason: str) -> None: ...
        def clear(self, run_id: str) -> None: ...

    KillSwitch("run-1", [Broken()]).check()


def test_run_ids_cannot_name_other_files(tmp_path: Path) -> None:
    with pytest.raises(exc.ConfigurationError):
        FileKillSource(tmp_path).kill("../etc", "x")


def test_the_kill_cli_says_when_there_is_no_live_run_and_pulls_nothing(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from stockade.cli.main import app

    result = CliRunner().invoke(app, ["kill", "made-up", "--target", str(tmp_path)])
    assert result.exit_code == 1 and "no live run made-up" in result.output
    assert FileKillSource(tmp_path).reason("made-up") is None


def test_the_kill_cli_stops_a_live_run_and_says_so(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from stockade.cli.main import app

    switch = KillSwitch("live-1", [FileKillSource(tmp_path)], poll_s=0.01)
    watching, done = threading.Event(), threading.Event()

    def run() -> None:  # a run: it watches its switch until it is pulled, then ends
        with switch.watch():
            watching.set()
            while not switch.killed:
                done.wait(0.01)

    thread = threading.Thread(target=run)
    thread.start()
    assert watching.wait(5)
    assert FileKillSource(tmp_path).live("live-1") is not None
    result = CliRunner().invoke(app, ["kill", "live-1", "--target", str(tmp_path), "--reason", "enough"])
    thread.join(5)
    assert result.exit_code == 0, result.output
    assert (
        "kill switch pulled for live run live-1 (pid" in result.output
        and "run live-1 stopped" in result.output
    )
    # the run ended: its switch is cleared, so a later run that reuses the id is not killed
    assert (
        FileKillSource(tmp_path).reason("live-1") is None and FileKillSource(tmp_path).live("live-1") is None
    )
    KillSwitch("live-1", [FileKillSource(tmp_path)]).check()


def test_a_switch_nobody_acted_upon_expires(tmp_path: Path) -> None:
    import os
    import time

    source = FileKillSource(tmp_path, ttl_s=3600)
    source.kill("gone", "long ago")
    old = time.time() - 7200
    os.utime(tmp_path / "gone", (old, old))
    assert source.reason("gone") is None and not (tmp_path / "gone").exists()
    memory = MemoryKillSource(ttl_s=0.0)
    memory.kill("gone", "now")
    time.sleep(0.01)
    assert memory.reason("gone") is None


def test_a_dead_runs_live_mark_goes_stale(tmp_path: Path) -> None:
    import os
    import time

    from stockade.runtime.killswitch import LIVE_FOR_S

    source = FileKillSource(tmp_path)
    source.mark_live("crashed", "pid 1 on elsewhere")
    assert source.live("crashed") == "pid 1 on elsewhere"
    old = time.time() - LIVE_FOR_S - 1
    os.utime(tmp_path / ".live" / "crashed", (old, old))  # its process died: no more heartbeats
    assert source.live("crashed") is None
