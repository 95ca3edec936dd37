"""An ``AuditLog`` its owner never closed writes what it queued when the interpreter exits:
its flusher is a daemon thread, frozen then, and its interval (here longer than the run)
would otherwise lose the last events. A forked child does not write its parent's queue."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from stockade.audit.stores import SQLiteStore

HOST = r"""
import os, sys
from stockade.audit.events import EventKind
from stockade.audit.log import AuditLog
from stockade.audit.stores import SQLiteStore

log = AuditLog(SQLiteStore(sys.argv[1]), flush_interval_s=60.0)
for i in range(3):
    log.record(EventKind.EGRESS, run_id="r", attributes={"i": i})
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the child ends as a program does: it writes nothing of the parent's
os.waitpid(pid, 0)
"""


def test_an_audit_log_left_open_is_written_at_exit(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    db = tmp_path / "audit.db"
    command = [sys.executable, "-c", HOST, str(db)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    store = SQLiteStore(db)
    try:
        assert [e.attributes["i"] for e in store.events()] == [0, 1, 2]  # once: not the child's copy
    finally:
        store.close()
