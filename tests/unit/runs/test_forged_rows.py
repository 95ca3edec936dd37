"""A writer of the run store's database without the audit key cannot choose what a resume does:
the rows a resume acts on carry a MAC under a key derived from the audit key, a resume refuses
a row whose MAC is wrong or missing, and ``audit verify`` reports it. (The same attack with a
SIGKILLed process: the call pending in the killed turn edited in the store.)"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import zlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stockade import Sandbox
from stockade.agent import Agent, AgentEvent, Observer, ToolCalled
from stockade.audit import AuditLog, MemoryStore, verify
from stockade.audit.agent import AuditObserver
from stockade.cli.main import app
from stockade.exceptions import RunStoreCorrupt
from stockade.models.scripted import Turn
from stockade.runs import RunRecorder, open_run_store
from stockade.testing import FakeBackend, MemoryWorkspace, ScriptedModel, tool_call
from stockade.tools import ToolContext, Toolset, default_toolset, tool

KEY = b"k" * 32


class Crash(Exception):
    """The process dying as a call starts (it propagates out of the run)."""


def crash_once(name: str) -> Observer:
    crashed: list[bool] = []

    def observe(event: AgentEvent) -> None:
        if isinstance(event, ToolCalled) and event.call.name == name and not crashed:
            crashed.append(True)
            raise Crash(name)

    return observe


def code_runner(ran: list[str]) -> Toolset:
    @tool
    def run(ctx: ToolContext, code: str) -> str:
        """Run code.

        Args:
            code: what to run.
        """
        ran.append(code)
        return "ok"

    return default_toolset().including(run)


def crash_in_first_call(path: Path, trail: MemoryStore, ran: list[str]) -> None:
    """One model turn asks for two calls; the process dies as the first starts (the second is
    still to run, as the checkpoint says)."""
    turns: list[Turn] = [
        [tool_call("run", {"code": "slow()"}), tool_call("run", {"code": "print('benign')"})]
    ]
    crash_at_run(path, trail, ran, turns)


def crash_at_run(path: Path, trail: MemoryStore, ran: list[str], turns: list[Turn]) -> None:
    """``turns`` played until the process dies as the first ``run`` call starts."""
    with (
        open_run_store(f"sqlite:///{path}", key=KEY) as store,
        AuditLog(trail, key=KEY) as log,
        Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sbx,
        pytest.raises(Crash),
    ):
        observers: list[Observer] = [AuditObserver(log), RunRecorder(store), crash_once("run")]
        Agent(ScriptedModel(turns), tools=code_runner(ran), checkpointer=store, observers=observers).run_sync(
            "t", sandbox=sbx, run_id="r"
        )


def resume(path: Path, trail: MemoryStore, ran: list[str], turns: list[Turn]) -> None:
    with (
        open_run_store(f"sqlite:///{path}", key=KEY) as store,
        AuditLog(trail, key=KEY) as log,
        Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sbx,
    ):
        observers: list[Observer] = [AuditObserver(log), RunRecorder(store)]
        Agent(ScriptedModel(turns), tools=code_runner(ran), checkpointer=store, observers=observers).run_sync(
            resume="r", sandbox=sbx
        )


def verified(path: Path, trail: MemoryStore) -> list[str]:
    with open_run_store(f"sqlite:///{path}", key=KEY) as store:
        return [p.kind.value for p in verify(trail, key=KEY, ledger=store).problems]


def test_an_untouched_run_resumes_and_verifies(tmp_path: Path) -> None:
    path, trail, ran = tmp_path / "runs.db", MemoryStore(), list[str]()
    crash_in_first_call(path, trail, ran)
    resume(path, trail, ran, ["done"])
    assert ran == ["slow()", "print('benign')"]
    assert verified(path, trail) == []


def test_a_pending_call_edited_in_the_store_is_refused_on_resume_and_reported(tmp_path: Path) -> None:
    path, trail, ran = tmp_path / "runs.db", MemoryStore(), list[str]()
    crash_in_first_call(path, trail, ran)
    with sqlite3.connect(path) as conn:  # what the model asked for, rewritten in every row
        for table in ("runs_checkpoints", "runs_messages", "runs_steps"):
            edited = conn.execute(
                f"UPDATE {table} SET body = replace(body, 'print(''benign'')', 'open(''PWNED'',''w'')')"
            ).rowcount
            assert table != "runs_checkpoints" or edited
    with pytest.raises(RunStoreCorrupt, match="does not match its MAC") as error:
        resume(path, trail, ran, ["done"])
    assert not error.value.retryable
    assert not any("PWNED" in code for code in ran)
    assert "store_forged" in verified(path, trail)


def test_a_row_whose_mac_was_removed_is_refused(tmp_path: Path) -> None:
    path, trail, ran = tmp_path / "runs.db", MemoryStore(), list[str]()
    crash_in_first_call(path, trail, ran)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE runs_checkpoints SET mac = NULL")
    with pytest.raises(RunStoreCorrupt, match="carries no MAC"):
        resume(path, trail, ran, ["done"])
    assert "store_forged" in verified(path, trail)


def test_an_unsigned_lease_as_earlier_versions_wrote_is_no_forgery_a_wrong_mac_is(tmp_path: Path) -> None:
    # An unsigned lease proves no run live (so it hides no call in flight): a store that an
    # earlier version wrote, whose leases carry no MAC, verifies as it did. A lease whose MAC
    # is wrong was edited: reported.
    path, trail, ran = tmp_path / "runs.db", MemoryStore(), list[str]()
    crash_in_first_call(path, trail, ran)
    resume(path, trail, ran, ["done"])
    with sqlite3.connect(path) as conn:
        assert conn.execute("UPDATE runs_leases SET mac = NULL").rowcount == 1
    assert verified(path, trail) == []
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE runs_leases SET mac = 'edited'")
    assert verified(path, trail) == ["store_forged"]


def test_a_swapped_workspace_manifest_row_is_refused(tmp_path: Path) -> None:
    path, trail, ran = tmp_path / "runs.db", MemoryStore(), list[str]()
    turns: list[Turn] = [
        tool_call("write_file", {"path": "a.txt", "content": "good\n"}),
        tool_call("run", {"code": "slow()"}),
        "done",
    ]
    crash_at_run(path, trail, ran, turns)
    good = hashlib.sha256(b"good\n").hexdigest()
    evil = b"evil\n"
    digest = hashlib.sha256(evil).hexdigest()
    with sqlite3.connect(path) as conn:  # a blob true to its digest, and the manifest pointed at it
        conn.execute(
            "INSERT INTO runs_blobs (digest, bytes, data) VALUES (?, ?, ?)",
            (digest, len(evil), zlib.compress(evil)),
        )
        assert conn.execute(
            "UPDATE runs_workspace SET body = replace(body, ?, ?) WHERE path = 'a.txt'", (good, digest)
        ).rowcount
    with pytest.raises(RunStoreCorrupt, match=r"runs_workspace row \(run_id 'r'.*'a\.txt'\)"):
        resume(path, trail, ran, ["done"])
    assert "store_forged" in verified(path, trail)


def test_a_database_made_before_rows_had_macs_gains_the_column(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    with sqlite3.connect(path) as conn:  # an earlier version's table
        conn.execute(
            "CREATE TABLE runs_messages (run_id TEXT NOT NULL, idx INTEGER NOT NULL, body TEXT NOT NULL, "
            "PRIMARY KEY (run_id, idx))"
        )
    for _ in range(2):  # and a second open finds it there
        with open_run_store(f"sqlite:///{path}", key=KEY) as store:
            assert "mac" in {str(r[1]) for r in store.db.query("PRAGMA table_info(runs_messages)")}


def test_a_replays_policy_loosened_in_the_database_is_refused(tmp_path: Path) -> None:
    """What a replay runs under (the run's policy, role, tier) is signed like what a resume
    acts on: a writer of the database who loosens the kept policy gets no replay under it."""
    from stockade.policy.schema import Policy
    from stockade.runs.records import RunSetup

    path = tmp_path / "runs.db"
    strict = Policy.model_validate({"commands": {"deny": ["curl"]}})
    with open_run_store(f"sqlite:///{path}", key=KEY) as store:
        store.record_setup("r", RunSetup(policy=strict, role=None, tier="microvm"))
        assert store.setup("r") is not None and store.forged_rows() == []
    with sqlite3.connect(path) as db:
        db.execute("UPDATE runs_setups SET policy = ?, tier = 'process'", (Policy().model_dump_json(),))
    with open_run_store(f"sqlite:///{path}", key=KEY) as store:
        with pytest.raises(RunStoreCorrupt, match="runs_setups"):
            store.setup("r")
        assert [row.run_id for row in store.forged_rows()] == ["r"]


def test_a_diff_or_budgets_edited_in_the_database_are_refused(tmp_path: Path) -> None:
    """What a reviewer reads of a run (its diff) and what a replay runs under (its budgets)
    are signed: the diff was a column of the run's row, unsigned, which a writer of the
    database edited into one that hid a change while `audit verify` said intact (found from
    outside)."""
    from stockade.agent import RunLimits
    from stockade.policy.schema import Policy
    from stockade.runs.records import RunSetup

    path, trail, ran = tmp_path / "runs.db", MemoryStore(), list[str]()
    crash_in_first_call(path, trail, ran)
    with open_run_store(f"sqlite:///{path}", key=KEY) as store:
        setup = RunSetup(policy=Policy(), role=None, tier="process", limits=RunLimits(max_wall_s=10))
        store.record_setup("r", setup)
        store.record_diff("r", "+a change\n+another\n")
        trace = store.trace("r")
        assert trace is not None and trace.diff == "+a change\n+another\n"
        assert store.setup("r") == setup
        assert store.forged_rows() == []
    with sqlite3.connect(path) as db:
        db.execute("UPDATE runs_run_diffs SET diff = '+another\n'")
        db.execute("UPDATE runs_run_limits SET body = ?", ('{"max_wall_s": 900.0}',))
    with open_run_store(f"sqlite:///{path}", key=KEY) as store:
        with pytest.raises(RunStoreCorrupt, match="runs_run_diffs"):
            store.trace("r")
        with pytest.raises(RunStoreCorrupt, match="runs_run_limits"):
            store.setup("r")
        assert [row.run_id for row in store.forged_rows()] == ["r", "r"]


def test_a_run_swept_as_interrupted_stays_the_stores_own(tmp_path: Path) -> None:
    """The sweep that marks a dead process's run ``interrupted`` signs the row again: the run
    reads as it is, verifies, and resumes."""
    path, trail, ran = tmp_path / "runs.db", MemoryStore(), list[str]()
    crash_in_first_call(path, trail, ran)
    with open_run_store(f"sqlite:///{path}", key=KEY) as store:
        (summary,) = store.runs()
        assert summary.status.value == "interrupted" and not summary.forged
        assert store.forged_rows() == []
    resume(path, trail, ran, ["done"])
    assert verified(path, trail) == []


def test_a_run_row_edited_in_the_database_is_shown_forged_and_never_resumed(tmp_path: Path) -> None:
    """The run's row says what `runs list`, the viewer and the service show of a run (status,
    steps, tokens, cost), and the service takes a redelivered run's status from it: it was the
    one row a run wrote unsigned, so an edit showed a failed run as another status, with any
    cost, while `audit verify` said intact (found from outside). A resume of the edited run is
    refused as forged (before, the checkpoint's own status refused it as ended)."""
    path, trail, ran = tmp_path / "runs.db", MemoryStore(), list[str]()
    crash_in_first_call(path, trail, ran)
    resume(path, trail, ran, ["done"])
    assert ran == ["slow()", "print('benign')"]
    with sqlite3.connect(path) as db:
        db.execute("UPDATE runs_runs SET status = 'interrupted', cost_usd = 0, input_tokens = 1")
    with open_run_store(f"sqlite:///{path}", key=KEY) as store:
        (summary,) = store.runs()
        assert summary.forged
        with pytest.raises(RunStoreCorrupt, match="runs_runs row"):
            store.summary("r")
        assert [row.run_id for row in store.forged_rows()] == ["r"]
    env = {"STOCKADE_AUDIT_KEY": KEY.decode()}  # `runs list` and `runs show` with the key
    listed = CliRunner().invoke(app, ["runs", "list", "--db", f"sqlite:///{path}", "--json"], env=env)
    assert [(r["status"], r["forged"]) for r in json.loads(listed.output)] == [("interrupted", True)]
    shown = CliRunner().invoke(app, ["runs", "show", "r", "--db", f"sqlite:///{path}"], env=env)
    assert shown.exit_code != 0 and "does not match its MAC" in shown.output
    with pytest.raises(RunStoreCorrupt, match="does not match its MAC"):
        resume(path, trail, ran, [tool_call("run", {"code": "again()"}), "done"])
    assert ran == ["slow()", "print('benign')"]
    assert verified(path, trail) == ["store_forged"]


def test_approvals_and_retries_edited_in_the_database_are_refused(tmp_path: Path) -> None:
    """`runs show` says what was approved and what was tried again: a denial edited into an
    approval of another action, and a retry made up, read as the run's own while `audit
    verify` said intact (found from outside)."""
    from stockade.runs.records import ApprovalEntry, RetryEntry

    path, trail, ran = tmp_path / "runs.db", MemoryStore(), list[str]()
    crash_in_first_call(path, trail, ran)
    approval = ApprovalEntry(
        step=1, request_id="q1", action="run `rm -r src`", rule="decisions.approve", reason="asked",
        decision="denied", recorded_ns=5,
    )  # fmt: skip
    retry = RetryEntry(
        step=1, call_id=None, subject="model", attempt=1, delay_s=0.25, reason="503", recorded_ns=6
    )
    with open_run_store(f"sqlite:///{path}", key=KEY) as store:
        store.record_approval("r", approval)
        store.record_retry("r", retry)
        assert store.approvals("r") == [approval] and store.retries("r") == [retry]
        assert store.forged_rows() == []
    with sqlite3.connect(path) as db:
        db.execute("UPDATE runs_approvals SET decision = 'approved', action = 'run `ls`'")
        db.execute("INSERT INTO runs_retries (run_id, step, call_id, subject, attempt, delay_s, reason, "
                   "recorded_ns) VALUES ('r', 1, NULL, 'model', 2, 0.5, 'vendor outage', 7)")  # fmt: skip
    with open_run_store(f"sqlite:///{path}", key=KEY) as store:
        with pytest.raises(RunStoreCorrupt, match="runs_approvals row"):
            store.approvals("r")
        with pytest.raises(RunStoreCorrupt, match="runs_retries row"):
            store.retries("r")
        found = sorted(row.detail.split(" row")[0] for row in store.forged_rows())
        assert found == ["the runs_approvals", "the runs_retries"], found


def test_a_runs_acceptance_check_is_signed(tmp_path: Path) -> None:
    """A check edited away in the database would replay a run that failed it as a success."""
    from stockade.policy.schema import Policy
    from stockade.runs.records import RunSetup

    path, trail, ran = tmp_path / "runs.db", MemoryStore(), list[str]()
    crash_in_first_call(path, trail, ran)
    with open_run_store(f"sqlite:///{path}", key=KEY) as store:
        setup = RunSetup(policy=Policy(), role=None, tier="process", check="pytest -q", check_timeout_s=60)
        store.record_setup("r", setup)
        assert store.setup("r") == setup
    with sqlite3.connect(path) as db:
        db.execute("UPDATE runs_run_checks SET body = ?", ('{"command": null, "timeout_s": null}',))
    with (
        open_run_store(f"sqlite:///{path}", key=KEY) as store,
        pytest.raises(RunStoreCorrupt, match="runs_run_checks"),
    ):
        store.setup("r")
