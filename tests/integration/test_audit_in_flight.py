"""A call cut by its process's death stays ``in_flight`` in ``audit verify --ledger`` whatever
the run store's rows are made to say (found from outside: a lease released, deleted or shown
held by another machine, or the call's start row deleted, hid it); the trail decides, the run
store only proves a run live. On SQLite and PostgreSQL, with a real SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from stockade import Sandbox
from stockade.agent import Agent, RunStatus
from stockade.audit import AuditLog, AuditStore, open_store, verify
from stockade.audit.agent import AuditObserver
from stockade.exceptions import BudgetExceeded, RunInterrupted, RunKilled, RunStopped
from stockade.runs import RunRecorder, RunStore, open_run_store
from stockade.runs._db import Statement
from stockade.runs.lease import owner_token
from stockade.testing import FakeBackend, MemoryWorkspace, ScriptedModel, tool_call
from stockade.tools import Tool, ToolContext, default_toolset, tool
from tests.conftest import wait_for
from tests.integration.run_stores import StoreTarget, run_store_target  # noqa: F401

CHILD = Path(__file__).with_name("inflight_child.py")
KEY = b"k" * 32  # the child's


@pytest.fixture
def target(run_store_target: StoreTarget) -> StoreTarget:  # noqa: F811 - the fixture
    """The run store under test; its audit trail beside it (tables ``<ns>_audit_*``)."""
    return run_store_target


@contextmanager
def stores(target: StoreTarget, key: bytes | None = KEY) -> Iterator[tuple[RunStore, AuditStore]]:
    with (
        open_run_store(target.url, namespace=target.namespace, key=key) as runs,
        open_store(target.url, namespace=f"{target.namespace}_audit") as audit,
    ):
        yield runs, audit


def problems(runs: RunStore, audit: AuditStore) -> list[str]:
    return [p.kind.value for p in verify(audit, key=KEY, ledger=runs).problems]


def agent(runs: RunStore, log: AuditLog, slow: Tool) -> Agent:
    return Agent(
        ScriptedModel([tool_call("slow"), "done"]),
        tools=default_toolset().including(slow),
        checkpointer=runs,
        observers=[AuditObserver(log), RunRecorder(runs)],
    )


def test_a_killed_runs_call_stays_in_flight_whatever_its_run_store_rows_say(
    target: StoreTarget, tmp_path: Path
) -> None:
    ns, run = target.namespace, "cut"
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), target.url, ns, run, str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, what="the child's call", timeout_s=60)
        assert proc.poll() is None, proc.communicate()
        with stores(target) as (runs, audit):
            assert problems(runs, audit) == []  # live: its lease is held, signed and renewed
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)

    with stores(target) as (runs, audit):
        (start,) = [e.seq for e in audit.events(run_id=run) if e.kind.value == "tool_call_start"]
        found = verify(audit, key=KEY, ledger=runs).problems
        assert [(p.kind.value, p.seq) for p in found] == [("in_flight", start)]
        lease = runs.db.query(f"SELECT * FROM {ns}_leases")
        started = runs.db.query(f"SELECT * FROM {ns}_calls_started")
        assert len(lease) == 1 and len(started) == 1
        boot = owner_token().split("/", 1)[0]
        elsewhere = owner_token().replace(boot, "0" * len(boot))  # another machine's: never judged gone
        edits: dict[str, list[Statement]] = {
            "released": [(f"UPDATE {ns}_leases SET expires_ns = 0", [()])],
            "lease deleted": [(f"DELETE FROM {ns}_leases", [()])],
            "held elsewhere": [
                (f"UPDATE {ns}_leases SET owner = ?, expires_ns = ?", [(elsewhere, time.time_ns() + 10**13)])
            ],
            "start deleted": [(f"DELETE FROM {ns}_calls_started", [()])],
        }
        hidden = []
        for edit, statements in edits.items():
            runs.db.write(statements)
            found = verify(audit, key=KEY, ledger=runs).problems
            if ("in_flight", start) not in [(p.kind.value, p.seq) for p in found]:
                hidden.append(edit)
            with stores(target, key=None) as (unkeyed, _):  # a store opened without the key works
                if "in_flight" not in problems(unkeyed, audit):
                    hidden.append(f"{edit}, read without the key")
            runs.db.write(  # put the rows back as the child left them
                [
                    (f"DELETE FROM {ns}_leases", [()]),
                    (f"DELETE FROM {ns}_calls_started", [()]),
                    (f"INSERT INTO {ns}_leases VALUES ({', '.join('?' * len(lease[0]))})", lease),
                    (f"INSERT INTO {ns}_calls_started VALUES ({', '.join('?' * len(started[0]))})", started),
                ]
            )
        assert hidden == []
        assert problems(runs, audit) == ["in_flight"]

        @tool
        def slow(ctx: ToolContext) -> str:
            """Take a long time."""
            return "done"

        with AuditLog(audit, key=KEY, flush_interval_s=None) as log, Sandbox.create(
            backend=FakeBackend(MemoryWorkspace())
        ) as sandbox:  # fmt: skip
            resumed = agent(runs, log, slow).run_sync(resume=run, sandbox=sandbox)
        assert resumed.status == RunStatus.SUCCESS, resumed.error
        assert problems(runs, audit) == []  # the resume recorded the crash and the call, once
        kinds = [e.kind.value for e in audit.events(run_id=run)]
        assert kinds.count("run_crash") == 1 and kinds.count("tool_call") == 1


@pytest.mark.parametrize(
    "stop", [RunKilled("stop"), RunInterrupted("ctrl-c"), BudgetExceeded("spent", kind="dollars")]
)
def test_a_run_its_own_process_stopped_mid_call_is_not_in_flight(
    target: StoreTarget, stop: RunStopped
) -> None:
    """A stop cuts the call and releases the lease: the run's ``run_end`` closes the call."""

    @tool
    def slow(ctx: ToolContext) -> str:
        """Stop the run inside the call."""
        raise stop

    with stores(target) as (runs, audit):
        with AuditLog(audit, key=KEY, flush_interval_s=None) as log, Sandbox.create(
            backend=FakeBackend(MemoryWorkspace())
        ) as sandbox:  # fmt: skip
            result = agent(runs, log, slow).run_sync("t", sandbox=sandbox, run_id="stopped")
        assert result.status == RunStatus(stop.status)
        kinds = [e.kind.value for e in audit.events(run_id="stopped")]
        assert "tool_call_start" in kinds and "tool_call" not in kinds and kinds[-1] == "run_end"
        assert problems(runs, audit) == []
