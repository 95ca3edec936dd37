"""``verify(..., ledger=)`` finds what the audit trail holds twice: a tool call's idempotency key,
or the end of a run that ended for good (``duplicate_in_trail``); ``stockade audit verify``
shows it."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from pathlib import Path

from typer.testing import CliRunner

from stockade import Sandbox
from stockade.agent import Agent
from stockade.audit import AuditLog, EventKind, MemoryStore, SQLiteStore, verify
from stockade.audit.agent import AuditObserver
from stockade.audit.ledger import ForgedRow, LedgerCall
from stockade.cli.main import app
from stockade.models.scripted import ScriptedModel, Turn, tool_call
from stockade.runs import open_run_store
from stockade.testing import FakeBackend, MemoryWorkspace

runner = CliRunner()


class Ledger:
    """A run store's ledger as verify reads it: the calls of run ``r``."""

    def __init__(self, *keys: str, runs: Iterable[str] = ("r",)) -> None:
        self.calls = [
            LedgerCall(run_id=run, step=1, idempotency_key=k, tool="list_files") for run in runs for k in keys
        ]

    def ledger_calls(self, run_id: str | None = None) -> Iterable[LedgerCall]:
        return [c for c in self.calls if run_id in (None, c.run_id)]

    def calls_in_flight(self, run_id: str | None = None) -> Iterable[LedgerCall]:
        return []

    def forged_rows(self, run_id: str | None = None) -> Iterable[ForgedRow]:
        return []

    def live_runs(self, run_ids: Collection[str]) -> Collection[str]:
        return ()

    def stored_runs(self, run_ids: Collection[str]) -> Collection[str]:
        return {c.run_id for c in self.calls}


def call(log: AuditLog, key: str, run: str = "r") -> None:
    log.record(
        EventKind.TOOL_CALL, run_id=run, step=1, attributes={"tool": "list_files", "idempotency_key": key}
    )


def end(log: AuditLog, status: str, **extra: bool) -> None:
    log.record(EventKind.RUN_END, run_id="r", attributes={"status": status, "steps": 1, **extra})


def test_a_key_or_a_final_end_twice_is_a_duplicate_a_stop_or_a_marked_repeat_is_not() -> None:
    trail = MemoryStore()
    with AuditLog(trail) as log:
        call(log, "r:1:a")  # seq 1
        end(log, "paused")  # 2: a paused run ends once per stop
        end(log, "paused")  # 3
        call(log, "r:1:a")  # 4: the same call twice
        end(log, "success")  # 5
        end(log, "success", repeat=True)  # 6: a repeated final request that ended otherwise
        end(log, "success")  # 7: a second end, unmarked
    report = verify(trail, ledger=Ledger("r:1:a"))
    assert [(p.seq, p.kind.value) for p in report.problems] == [
        (4, "duplicate_in_trail"),
        (7, "duplicate_in_trail"),
    ]
    assert "the first is seq 1" in report.problems[0].detail
    assert verify(trail).ok  # without the ledger, the chain alone is intact
    assert verify(trail, run_id="other", ledger=Ledger("r:1:a")).problems_elsewhere == 0


def test_a_calls_late_outcome_beside_a_resumes_unknown_one_is_no_duplicate() -> None:
    """A process stalled past its lease (SIGSTOP, a frozen VM) wakes and writes what its call
    returned after the run was resumed elsewhere, whose resume recorded that call's outcome as
    unknown: verify reported the tenant's trail broken for good (found from outside). One
    event of each is the truth of what happened; two of either is a duplicate."""
    unknown = {"outcome": "unknown", "reconciled": True}
    trail = MemoryStore()
    with AuditLog(trail) as log:
        for key, events in (("k1", [unknown, {}]), ("k2", [{}, unknown]), ("k3", [unknown, {}, {}])):
            for extra in events:
                log.record(
                    EventKind.TOOL_CALL,
                    run_id="r",
                    step=1,
                    attributes={"tool": "list_files", "idempotency_key": key, **extra},
                )
    report = verify(trail, ledger=Ledger("k1", "k2", "k3"))
    assert [(p.seq, p.kind.value) for p in report.problems] == [(7, "duplicate_in_trail")]


def test_calls_are_matched_within_their_run_whatever_their_keys_look_like() -> None:
    """Keys of earlier versions (``run:step:call``) could be two runs' at once ("a:1" step 1 call
    "x", "a" step 1 call "1:x"); today's are digests, with no run to read out of them."""
    trail = MemoryStore()
    with AuditLog(trail) as log:
        call(log, "a:1:1:x", run="a:1")
        call(log, "a:1:1:x", run="a")  # the other run's call, not a second event of the first
        call(log, "0f" * 32, run="a")  # a call the ledger lacks
    report = verify(trail, ledger=Ledger("a:1:1:x", runs=("a", "a:1")))
    assert [(p.seq, p.kind.value, p.run_id) for p in report.problems] == [(3, "not_in_ledger", "a")]


def test_audit_verify_shows_a_call_twice_in_the_trail(tmp_path: Path) -> None:
    runs, audit = f"sqlite:///{tmp_path / 'runs.db'}", tmp_path / "audit.db"
    trail = SQLiteStore(audit)
    with (
        open_run_store(runs) as store,
        Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sbx,
        AuditLog(trail) as log,
    ):
        turns: list[Turn] = [tool_call("list_files"), "done"]
        Agent(ScriptedModel(turns), checkpointer=store, observers=[AuditObserver(log)]).run_sync(
            "t", sandbox=sbx, run_id="r"
        )
        (key,) = [c.idempotency_key for c in store.ledger_calls("r")]
        call(log, key)
    trail.close()
    result = runner.invoke(
        app, ["audit", "verify", "--db", f"sqlite:///{audit}", "--runs-db", runs, "--json"]
    )
    assert result.exit_code == 1, result.output
    (problem,) = json.loads(result.output)["problems"]
    assert problem["kind"] == "duplicate_in_trail" and key in problem["detail"]


def test_a_crashed_run_that_was_erased_has_no_call_in_flight_any_more() -> None:
    # A process killed during a call leaves its start and nothing after: in flight, until a
    # resume records the crash. Erased, the run is never resumed: its erasure closes the call
    # (else the chain could never verify intact again).
    key, store = b"chain-key-0123456789abcdef", MemoryStore()
    with AuditLog(store, key=key, flush_interval_s=None) as log:
        log.seal_run("r", subject="alice")
        log.record(EventKind.RUN_START, run_id="r", attributes={"task": "t"})
        log.record(EventKind.TOOL_CALL_START, run_id="r", step=1,
                   attributes={"tool": "run_code", "idempotency_key": "k1"})  # fmt: skip
    crashed = verify(store, key=key, ledger=Ledger())
    assert [p.kind.value for p in crashed.problems] == ["in_flight"], crashed.problems
    with AuditLog(store, key=key, flush_interval_s=None) as later:
        assert later.erase(run_ids=["r"]) == ["r"]
    erased = verify(store, key=key, ledger=Ledger())
    assert erased.ok, erased.problems


def test_a_crashed_run_deleted_unsealed_has_no_call_in_flight_any_more() -> None:
    # Not sealed, its deletion (by `runs erase` or the service) is a note in its trail: it
    # closes the call the crash left open, as a sealed run's run_erased does.
    key, store = b"chain-key-0123456789abcdef", MemoryStore()
    with AuditLog(store, key=key, flush_interval_s=None) as log:
        log.record(EventKind.RUN_START, run_id="u", attributes={"task": "t"})
        log.record(EventKind.TOOL_CALL_START, run_id="u", step=1,
                   attributes={"tool": "run_code", "idempotency_key": "k1"})  # fmt: skip
    assert [p.kind.value for p in verify(store, key=key, ledger=Ledger()).problems] == ["in_flight"]
    with AuditLog(store, key=key, flush_interval_s=None) as later:
        later.record(EventKind.NOTE, run_id="u", actor="stockade", attributes={"action": "delete"})
    deleted = verify(store, key=key, ledger=Ledger())
    assert deleted.ok, deleted.problems
