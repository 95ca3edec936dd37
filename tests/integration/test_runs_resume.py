"""A run killed with SIGKILL right after a side-effecting tool call resumes in a new process from
its last completed step, and the side effect happened exactly once (both run stores, a real
process-tier sandbox in each process)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from stockade.agent import RunState, RunStatus
from stockade.runs import open_run_store
from stockade.tools import idempotency_key
from tests.conftest import require_tier
from tests.integration.run_stores import StoreTarget, run_store_target  # noqa: F401 - a fixture

CHILD = Path(__file__).with_name("runs_child.py")


def child(mode: str, target: StoreTarget, host_file: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(CHILD), mode, target.url, target.namespace, "run-kill-9", str(host_file)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def test_a_killed_run_resumes_without_repeating_its_side_effect(
    run_store_target: StoreTarget,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    require_tier("process")
    host_file = tmp_path / "payments.log"

    started = child("start", run_store_target, host_file)
    assert started.returncode == -signal.SIGKILL, started.stderr
    assert host_file.read_text() == "paid invoice 42\n"

    with open_run_store(run_store_target.url, namespace=run_store_target.namespace) as store:
        # The loop had not checkpointed the call when the process died: the ledger has it.
        (row,) = store.db.query(
            f"SELECT body FROM {store.ns}_checkpoints WHERE run_id = ? ORDER BY seq DESC LIMIT 1",
            ("run-kill-9",),
        )
        at_death = RunState.model_validate_json(str(row[0]).replace("{", '{"messages":[],"steps":[],', 1))
        assert at_death.current is not None and at_death.current.tool_calls == ()
        assert [r.call.name for r in store.tool_calls("run-kill-9")] == ["append_line"]

    resumed = child("resume", run_store_target, host_file)
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout)
    assert report["status"] == RunStatus.SUCCESS and report["answer"] == "invoice 42 is paid"
    assert report["diff"] == "--- /dev/null\n+++ b/receipt.txt\n@@ -0,0 +1 @@\n+paid\n"
    assert host_file.read_text() == "paid invoice 42\n"  # exactly once

    with open_run_store(run_store_target.url, namespace=run_store_target.namespace) as store:
        keys = [r.idempotency_key for r in store.tool_calls("run-kill-9")]
        expected = [
            idempotency_key("run-kill-9", 1, 0, "call_0_0"),
            idempotency_key("run-kill-9", 2, 0, "call_1_0"),
        ]
        assert keys == expected
        summary = store.summary("run-kill-9")
        assert summary is not None and (summary.status, summary.steps) == (RunStatus.SUCCESS, 3)
