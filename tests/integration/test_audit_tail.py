"""`stockade audit tail --follow`: a second process appends events, the tail prints them as
they land (and only once), like `tail -f`."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

from stockade.audit import AuditLog, EventKind, SQLiteStore

DEADLINE_S = 10.0


def append(path: Path, *steps: int, run: str = "run-a") -> None:
    store = SQLiteStore(path)
    with AuditLog(store) as log:
        for step in steps:
            log.record(EventKind.COMMAND, run_id=run, step=step, attributes={"argv": ["echo", str(step)]})
    store.close()


def lines_of(process: subprocess.Popen[str]) -> queue.Queue[str]:
    """The process's stdout, line by line, without blocking the test on a read."""
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def test_follow_prints_new_events_as_they_are_appended(tmp_path: Path) -> None:
    path = tmp_path / "audit.db"
    append(path, 1, 2)
    command = [sys.executable, "-c", "from stockade.cli.main import app; app()"]
    args = ["audit", "tail", "--db", f"sqlite:///{path}", "-n", "1", "--follow", "--interval", "0.05"]
    # a pipe, as in `stockade audit tail -f | grep ...`: block-buffered unless the tail flushes
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with subprocess.Popen([*command, *args], stdout=subprocess.PIPE, text=True, env=env) as tail:
        try:
            lines = lines_of(tail)
            first = lines.get(timeout=DEADLINE_S)
            assert first.split()[0] == "2"  # -n 1: only the last event, then it waits

            append(path, 3, 4, run="run-b")
            new = [lines.get(timeout=DEADLINE_S), lines.get(timeout=DEADLINE_S)]
            assert [line.split()[0] for line in new] == ["3", "4"]
            assert all("run-b" in line and "command" in line for line in new)
            assert tail.poll() is None  # still following
        finally:
            tail.terminate()
            tail.wait(timeout=DEADLINE_S)
        assert lines.empty()  # nothing printed twice


def test_follow_keeps_following_a_writer_that_appends_while_it_reads(tmp_path: Path) -> None:
    """A writer appending while the tail reads made the read unproven ("changed while it was
    read"), and the tail stopped with that error: the one thing `tail -f` is for (CI 158). It
    reads on from the last event it printed, each event once."""
    path = tmp_path / "audit.db"
    append(path, 0)
    command = [sys.executable, "-c", "from stockade.cli.main import app; app()"]
    # reads back to back, so that they overlap the writes (at 1 ms apart they rarely did): a
    # core for the second the 300 writes take
    args = ["audit", "tail", "--db", f"sqlite:///{path}", "-n", "1", "--follow", "--interval", "0"]
    steps = 300
    with subprocess.Popen(
        [*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as tail:
        try:
            lines = lines_of(tail)
            assert lines.get(timeout=3 * DEADLINE_S).split()[0] == "1"  # its seq (the CLI's start)
            store = SQLiteStore(path)
            with AuditLog(store, flush_interval_s=None) as log:  # each event its own write
                for step in range(1, steps + 1):
                    log.record(EventKind.COMMAND, run_id="run-a", step=step, attributes={"argv": ["echo"]})
                    log.flush()
            store.close()
            seen = [int(lines.get(timeout=DEADLINE_S).split()[0]) for _ in range(steps)]
            assert seen == list(range(2, steps + 2))
            assert tail.poll() is None, tail.stderr.read() if tail.stderr else ""
        finally:
            tail.terminate()
            tail.wait(timeout=DEADLINE_S)
