"""What a durable run promises, on a real SQLite run store and the shipped fake sandbox: one owner
per run, the call in flight at a crash run again only if its tool is idempotent, the workspace
continued in a fresh sandbox, the audit trail reconciled with the ledger, and nothing reused or
overwritten. (The same, with real processes SIGKILLed: tests/integration/test_runs_durable.py.)"""

from __future__ import annotations

import os
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from stockade import Sandbox
from stockade.agent import (
    Agent,
    AgentEvent,
    ModelRequested,
    Observer,
    RunFinished,
    RunLimits,
    RunResult,
    RunStatus,
    ToolCalled,
    ToolRejected,
)
from stockade.audit import AuditLog, MemoryStore, verify
from stockade.audit.agent import AuditObserver
from stockade.cli.replay_cmds import load_tools
from stockade.exceptions import (
    ApprovalRequired,
    InvalidArgument,
    RunConflict,
    RunHistoryFull,
    RunLeased,
    RunStoreCorrupt,
    SeedTooLarge,
)
from stockade.models.messages import AssistantMessage, ModelRequest, ModelResponse
from stockade.models.scripted import FunctionModel, Turn
from stockade.runs import RunRecorder, RunStore, open_run_store
from stockade.runs.lease import owner_token
from stockade.testing import FakeBackend, MemoryWorkspace, ScriptedModel, tool_call
from stockade.tools import ToolContext, Toolset, default_toolset, idempotency_key, tool


class Crash(Exception):
    """A bug (not a stop): it propagates out of the run, like the process dying there."""


class Died(BaseException):
    """The process dying inside a tool: not a tool error the model would be told about."""


def sandbox(files: dict[str, bytes] | None = None) -> Sandbox:
    return Sandbox.create(backend=FakeBackend(MemoryWorkspace(files=dict(files or {}))))


def crash_on(name: str) -> Observer:
    def observe(event: AgentEvent) -> None:
        if isinstance(event, ToolCalled) and event.call.name == name:
            raise Crash(name)

    return observe


class Resumed:
    """What ``crash_then_resume`` resumed: the run's result, once its block has ended."""

    result: RunResult


@contextmanager
def crash_then_resume(
    store: RunStore,
    sbx: Sandbox,
    turns: list[Turn],
    log: AuditLog,
    observers: list[Observer],
    *,
    lost: bool = False,
) -> Iterator[Resumed]:
    """Run "r" until one of ``observers`` raises ``Crash`` (its process dies there), let the
    block look at what the crash left, then resume the run as a new process would: with a new
    audit log over the same trail. The crashed run's ``log`` is closed as its process ends, or
    ``lost``: its buffer dies with the process (a SIGKILL's)."""
    with pytest.raises(Crash):
        Agent(ScriptedModel(turns), checkpointer=store, observers=observers).run_sync(
            "t", sandbox=sbx, run_id="r"
        )
    if not lost:
        log.close()
    resumed = Resumed()
    yield resumed
    with AuditLog(log.store) as new_log:
        resumed.result = Agent(
            ScriptedModel(turns), checkpointer=store, observers=[AuditObserver(new_log), RunRecorder(store)]
        ).run_sync(resume="r", sandbox=sbx)


@pytest.fixture
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'runs.db'}"


def test_a_new_run_with_a_taken_id_is_refused(store: RunStore) -> None:
    with sandbox() as sbx:
        Agent(ScriptedModel(["done"]), checkpointer=store).run_sync("a", sandbox=sbx, run_id="r")
        with pytest.raises(RunConflict, match="already has a run 'r'"):
            Agent(ScriptedModel(["done"]), checkpointer=store).run_sync("b", sandbox=sbx, run_id="r")


def test_a_run_that_ended_is_never_resumed_nor_its_diff_overwritten(store: RunStore) -> None:
    turns: list[Turn] = [tool_call("write_file", {"path": "a.txt", "content": "a\n"}), "done"]
    with sandbox() as sbx:
        agent = Agent(ScriptedModel(turns), checkpointer=store, observers=[RunRecorder(store)])
        first = agent.run_sync("a", sandbox=sbx, run_id="r")
        sbx.files.write("a.txt", "changed afterwards\n")
        with pytest.raises(RunConflict, match=r"run r ended \(success\)"):
            agent.run_sync(resume="r", sandbox=sbx)
    trace = store.trace("r")
    assert trace is not None and trace.diff == first.diff


def test_one_process_at_a_time_owns_a_run(db: str) -> None:
    with open_run_store(db) as mine, open_run_store(db) as theirs:
        lease = mine.claim("r", new=True)
        with pytest.raises(RunLeased, match="running in another process") as refused:
            theirs.claim("r", new=False)
        assert refused.value.retryable and 0 < (refused.value.retry_after or 0) <= mine.lease_s
        lease.release()
        theirs.claim("r", new=False).release()  # released: anyone may take it now


def test_a_claim_waits_for_a_lease_that_is_released(db: str) -> None:
    import threading

    with open_run_store(db) as mine, open_run_store(db, namespace="runs") as theirs:
        lease = mine.claim("r", new=True)
        threading.Timer(0.3, lease.release).start()
        started = time.monotonic()
        theirs.claim("r", new=False, wait_s=5).release()
        assert 0.2 < time.monotonic() - started < 4


def test_a_run_whose_process_stopped_shows_as_interrupted_and_resumes(store: RunStore) -> None:
    turns: list[Turn] = [
        tool_call("list_files"),
        tool_call("write_file", {"path": "b", "content": "b"}),
        "done",
    ]
    with sandbox() as sbx:
        with pytest.raises(Crash):
            Agent(ScriptedModel(turns), checkpointer=store, observers=[crash_on("write_file")]).run_sync(
                "t", sandbox=sbx, run_id="r"
            )
        (summary,) = store.runs()
        assert summary.status == RunStatus.INTERRUPTED and "stockade agent --resume" in (summary.error or "")
        result = Agent(ScriptedModel(turns), checkpointer=store).run_sync(resume="r", sandbox=sbx)
    assert result.ok and "+b" in result.diff


def test_a_call_in_flight_runs_again_only_if_its_tool_is_idempotent(store: RunStore) -> None:
    keys: list[tuple[str, str]] = []

    @tool
    def pay(ctx: ToolContext, invoice: str) -> str:
        """Pay.

        Args:
            invoice: which.
        """
        keys.append(("pay", ctx.idempotency_key))
        raise Died("the process dies after the payment went out")

    @tool(idempotent=True)
    def notify(ctx: ToolContext, text: str) -> str:
        """Notify.

        Args:
            text: what.
        """
        keys.append(("notify", ctx.idempotency_key))
        if len(keys) == 1:
            raise Died("the process dies after the notice went out")
        return "sent"

    tools = default_toolset().including(pay, notify)
    turns: list[Turn] = [tool_call("notify", {"text": "hi"}), tool_call("pay", {"invoice": "42"}), "done"]
    with sandbox() as sbx:
        agent = Agent(ScriptedModel(turns), tools=tools, checkpointer=store, observers=[RunRecorder(store)])
        with pytest.raises(Died):
            agent.run_sync("t", sandbox=sbx, run_id="r")
        with pytest.raises(Died):  # notify runs again (idempotent), then pay dies in flight
            agent.run_sync(resume="r", sandbox=sbx)
        result = agent.run_sync(resume="r", sandbox=sbx)
    # notify: twice, with the same key; pay: once, never again
    notified, paid_key = idempotency_key("r", 1, 0, "call_0_0"), idempotency_key("r", 2, 0, "call_1_0")
    assert keys == [("notify", notified), ("notify", notified), ("pay", paid_key)]
    assert result.ok
    (paid,) = result.steps[1].tool_calls
    assert paid.error_type == "OutcomeUnknown" and "not run again" in paid.observation
    assert [r.error_type for r in store.tool_calls("r")] == [None, "OutcomeUnknown"]
    assert store.attempts("r") == {notified: 2, paid_key: 1}


def _payments(paid: list[str]) -> Toolset:
    @tool
    def pay(invoice: str) -> str:
        """Pay.

        Args:
            invoice: which.
        """
        paid.append(invoice)
        if invoice.startswith("dies"):
            raise Died("the process dies after the payment went out")
        return "paid"

    return default_toolset().including(pay)


def test_a_call_of_one_run_is_never_taken_for_another_runs_whatever_their_ids(store: RunStore) -> None:
    """Run "a:1" step 1 call "x" and run "a" step 1 call "1:x" (the model picks call ids) once
    shared a key; the call in flight was then recorded as the other run's, and run again."""
    paid: list[str] = []
    tools = _payments(paid)
    with sandbox() as sbx:
        Agent(
            ScriptedModel([tool_call("pay", {"invoice": "1"}, id="x"), "done"]),
            tools=tools,
            checkpointer=store,
        ).run_sync("t", sandbox=sbx, run_id="a:1")
        agent = Agent(
            ScriptedModel([tool_call("pay", {"invoice": "dies-2"}, id="1:x"), "done"]),
            tools=tools,
            checkpointer=store,
        )
        with pytest.raises(Died):
            agent.run_sync("t", sandbox=sbx, run_id="a")
        result = agent.run_sync(resume="a", sandbox=sbx)
    assert paid == ["1", "dies-2"]  # not paid twice
    assert result.ok and result.steps[0].tool_calls[0].error_type == "OutcomeUnknown"
    assert store.attempts("a") == {idempotency_key("a", 1, 0, "1:x"): 1}
    assert store.attempts("a:1") == {idempotency_key("a:1", 1, 0, "x"): 1}


def test_two_calls_with_one_id_in_a_response_are_two_calls(store: RunStore) -> None:
    """A model may give two calls the same id: each is run once, recorded once, resumed as itself."""
    paid: list[str] = []
    turns: list[Turn] = [
        [tool_call("pay", {"invoice": "1"}, id="same"), tool_call("pay", {"invoice": "dies-2"}, id="same")],
        "done",
    ]
    with sandbox() as sbx:
        agent = Agent(ScriptedModel(turns), tools=_payments(paid), checkpointer=store)
        with pytest.raises(Died):
            agent.run_sync("t", sandbox=sbx, run_id="r")
        result = agent.run_sync(resume="r", sandbox=sbx)
    assert paid == ["1", "dies-2"]
    first, second = result.steps[0].tool_calls
    assert (first.observation, second.error_type) == ("paid", "OutcomeUnknown")
    assert [r.idempotency_key for r in store.tool_calls("r")] == [
        idempotency_key("r", 1, k, "same") for k in (0, 1)
    ]


def test_a_call_an_earlier_version_started_is_still_known_on_resume(store: RunStore) -> None:
    """Its start was recorded under the key of then (``run:step:call``): not paid twice."""
    paid: list[str] = []
    turns: list[Turn] = [tool_call("pay", {"invoice": "1"}), "done"]
    with sandbox() as sbx:
        agent = Agent(
            ScriptedModel(turns), tools=_payments(paid), checkpointer=store, observers=[crash_on("pay")]
        )
        with pytest.raises(Crash):  # before its start is recorded: the earlier version records it
            agent.run_sync("t", sandbox=sbx, run_id="r")
        state = store.load("r")
        assert state is not None and state.current is not None
        store.call_started("r", 1, state.current.response.tool_calls[0], "r:1:call_0_0", idempotent=False)
        result = Agent(ScriptedModel(turns), tools=_payments(paid), checkpointer=store).run_sync(
            resume="r", sandbox=sbx
        )
    assert paid == [] and result.steps[0].tool_calls[0].error_type == "OutcomeUnknown"


def test_a_call_that_stopped_at_an_approval_runs_on_resume_not_outcome_unknown(store: RunStore) -> None:
    decided: list[bool] = []
    deployed: list[str] = []

    @tool
    def deploy(ctx: ToolContext, target: str) -> str:
        """Deploy.

        Args:
            target: where.
        """
        ctx.sandbox.files.write("deploy.log", f"deploying {target}\n")
        if not decided:
            raise ApprovalRequired(f"deploying to {target} needs a human", action=f"deploy {target}")
        deployed.append(ctx.idempotency_key)
        return f"deployed to {target}"

    tools = default_toolset().including(deploy)
    turns: list[Turn] = [tool_call("deploy", {"target": "prod"}), "done"]
    with sandbox() as sbx:
        agent = Agent(ScriptedModel(turns), tools=tools, checkpointer=store, observers=[RunRecorder(store)])
        paused = agent.run_sync("t", sandbox=sbx, run_id="r")
        assert paused.status == RunStatus.PAUSED and deployed == []
        decided.append(True)  # a human approves
        result = agent.run_sync(resume="r", sandbox=sbx)
    key = idempotency_key("r", 1, 0, "call_0_0")
    assert result.ok and deployed == [key]
    (call,) = result.steps[0].tool_calls
    assert call.error_type is None and call.observation == "deployed to prod"
    assert store.attempts("r") == {key: 1}  # the paused attempt is not counted as one


def test_a_resume_in_a_fresh_sandbox_continues_from_the_last_workspace(store: RunStore) -> None:
    turns: list[Turn] = [
        tool_call("write_file", {"path": "a.txt", "content": "a\n"}),
        tool_call("write_file", {"path": "src/b.txt", "content": "b\n"}),
        tool_call("list_files"),
        "done",
    ]
    seed = {"README.md": b"# project\n"}
    with sandbox(seed) as first, pytest.raises(Crash):
        Agent(ScriptedModel(turns), checkpointer=store, observers=[crash_on("list_files")]).run_sync(
            "t", sandbox=first, run_id="r"
        )
    with sandbox() as fresh:  # empty: another machine, say
        result = Agent(ScriptedModel(turns), checkpointer=store).run_sync(resume="r", sandbox=fresh)
        assert fresh.files.read("README.md") == "# project\n"
    assert result.ok
    assert result.diff == (
        "--- /dev/null\n+++ b/a.txt\n@@ -0,0 +1 @@\n+a\n--- /dev/null\n+++ b/src/b.txt\n@@ -0,0 +1 @@\n+b\n"
    )  # the seed's README is not "added": the baseline came back too


def test_only_what_changed_is_stored(store: RunStore) -> None:
    big = "x" * 100_000 + "\n"
    turns: list[Turn] = [
        tool_call("write_file", {"path": "big.txt", "content": big}),
        tool_call("write_file", {"path": "copy.txt", "content": big}),
        tool_call("write_file", {"path": "small.txt", "content": "s\n"}),
        "done",
    ]
    with sandbox() as sbx:
        Agent(ScriptedModel(turns), checkpointer=store).run_sync("t", sandbox=sbx, run_id="r")
    usage = store.workspace_usage("r")
    (blobs,) = store.db.query("SELECT COUNT(*) FROM runs_blobs")
    assert blobs[0] == 3  # baseline, big (stored once for two paths), small
    assert usage.versions == 4 and usage.blob_bytes < 2_000  # compressed


def test_a_workspace_over_the_cap_is_a_typed_error_that_says_how_to_raise_it(tmp_path: Path) -> None:
    with RunStore(open_run_store("memory:").db, max_workspace_bytes=1_000) as store:
        turns: list[Turn] = [tool_call("write_file", {"path": "big", "content": "x" * 2_000}), "done"]
        with sandbox() as sbx:
            result = Agent(ScriptedModel(turns), checkpointer=store).run_sync("t", sandbox=sbx, run_id="r")
    assert result.status == RunStatus.ERROR
    assert "SeedTooLarge" in (result.error or "") and "RunStore(max_workspace_bytes=...)" in (
        result.error or ""
    )
    assert SeedTooLarge.__doc__ and "snapshot" in SeedTooLarge.__doc__


NOISE = 20_000  # characters of hex a call writes: ~10 KB compressed


def rewrites(calls: int) -> list[Turn]:
    """``calls`` calls, each rewriting one file with new content (random hex)."""
    return [
        *(
            tool_call("write_file", {"path": "noise.txt", "content": os.urandom(NOISE // 2).hex()})
            for _ in range(calls)
        ),
        "done",
    ]


def test_a_runs_versions_together_are_capped_and_the_run_ends_on_a_typed_error(db: str) -> None:
    # Each version was capped, the run was not: every call that rewrote a file with new
    # content stored it again, kept until erased (12 calls of 200 MiB: a 2.4 GB database).
    trail = MemoryStore()
    cap = 25_000  # two rewrites, not three
    with RunStore(open_run_store(db).db, max_run_bytes=cap) as store:
        with AuditLog(trail) as log, sandbox() as sbx:
            observers: list[Observer] = [AuditObserver(log), RunRecorder(store)]
            result = Agent(ScriptedModel(rewrites(8)), checkpointer=store, observers=observers).run_sync(
                "t", sandbox=sbx, run_id="r"
            )
        assert result.status == RunStatus.ERROR
        assert "RunHistoryFull" in (result.error or "") and "RunStore(max_run_bytes=...)" in (
            result.error or ""
        )
        assert issubclass(RunHistoryFull, SeedTooLarge) and not RunHistoryFull("").retryable
        kept = store.workspace_usage("r").blob_bytes
        (stored,) = store.db.query("SELECT SUM(LENGTH(data)) FROM runs_blobs")
        assert 20_000 < kept <= cap and stored[0] == kept
        assert len(store.tool_calls("r")) == 3  # the call past the cap ran, and is in the ledger
        report = verify(trail, ledger=store)
        assert report.ok and report.found, report.problems
        assert store.erase(["r"]) == 1
        assert store.db.query("SELECT COUNT(*) FROM runs_blobs")[0][0] == 0


def test_what_a_run_kept_counts_in_the_process_that_resumes_it(db: str) -> None:
    turns = rewrites(4)
    cap = 35_000  # three rewrites, not four
    calls = 0

    def third(event: AgentEvent) -> None:  # two calls returned, the process dies at the third
        nonlocal calls
        calls += isinstance(event, ToolCalled)
        if calls == 3:
            raise Crash("write_file")

    with RunStore(open_run_store(db).db, max_run_bytes=cap) as first, sandbox() as sbx, pytest.raises(Crash):
        Agent(ScriptedModel(turns), checkpointer=first, observers=[RunRecorder(first), third]).run_sync(
            "t", sandbox=sbx, run_id="r"
        )
    # another process: it knows what the run kept only from the store
    with RunStore(open_run_store(db).db, max_run_bytes=cap) as store, sandbox() as fresh:
        before = store.workspace_usage("r").blob_bytes
        assert 20_000 < before < 25_000
        result = Agent(ScriptedModel(turns), checkpointer=store, observers=[RunRecorder(store)]).run_sync(
            resume="r", sandbox=fresh
        )
        assert result.status == RunStatus.ERROR and "RunHistoryFull" in (result.error or "")
        assert len(store.tool_calls("r")) == 4
        assert before < store.workspace_usage("r").blob_bytes <= cap  # the third kept, the fourth not


def test_a_malformed_row_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    with open_run_store(f"sqlite:///{path}") as store, sandbox() as sbx:
        Agent(ScriptedModel(["done"]), checkpointer=store).run_sync("t", sandbox=sbx, run_id="r")
    with sqlite3.connect(path) as conn:
        conn.execute(
            "UPDATE runs_messages SET body = '{\"role\": \"nobody\"}' WHERE run_id = 'r' AND idx = 1"
        )
    with (
        open_run_store(f"sqlite:///{path}") as store,
        pytest.raises(RunStoreCorrupt, match=r"runs_messages row \(run 'r', idx 1\)") as error,
    ):
        store.load("r")
    assert not error.value.retryable


def _crash_at_step_2(event: AgentEvent) -> None:
    if isinstance(event, ModelRequested) and event.step == 2:
        raise Crash("before the second model request")


@pytest.mark.parametrize(
    ("crash", "lost_kind", "gaps"),
    [
        # after write_file returned: its tool_call, in the ledger, is in the log's buffer only
        (_crash_at_step_2, "tool_call", ["not_in_trail"]),
        # the second answer came, its call not started: its model_call is in the buffer only
        (crash_on("list_files"), "model_call", []),
    ],
)
def test_the_trail_is_reconciled_on_resume_and_verify_cross_checks_the_ledger(
    store: RunStore, crash: Observer, lost_kind: str, gaps: list[str]
) -> None:
    """The log writes what it holds before each action (``AuditLog.check``): a crash loses what
    came after the last one, put back by the resume."""
    trail = MemoryStore()
    turns: list[Turn] = [
        tool_call("write_file", {"path": "a", "content": "a"}),
        tool_call("list_files"),
        "done",
    ]
    lost = AuditLog(trail, flush_interval_s=None)
    crashing: list[Observer] = [crash, AuditObserver(lost), RunRecorder(store)]  # it dies first
    with sandbox() as sbx, crash_then_resume(store, sbx, turns, lost, crashing, lost=True) as resumed:
        assert lost.pending
        found = verify(trail, ledger=store)
        assert [p.kind.value for p in found.problems] == gaps
    assert resumed.result.ok
    report = verify(trail, ledger=store)
    assert report.ok and report.found, report.problems
    kinds = [(e.kind.value, e.attributes.get("reconciled")) for e in trail.events(run_id="r")]
    assert (lost_kind, True) in kinds
    # the exception left the process alive, and it gave the run up: no crash (a SIGKILL is one:
    # tests/integration/test_runs_durable.py)
    assert ("run_crash", None) not in kinds


def test_a_run_killed_as_it_ends_resumes_and_its_trail_holds_every_call_once(db: str) -> None:
    """The process dies after the model's final answer and before the trail's last batch is
    written (while the diff is taken: the window of a SIGKILL there). Its checkpoints must not
    say yet that the run ended: a run that ended is never resumed, so its trail would never be
    reconciled, and the ledger's last calls would be missing from the trail for good."""

    def dies_as_it_ends(event: AgentEvent) -> None:
        if isinstance(event, RunFinished):
            raise Crash("the process dies before the trail's last events are written")

    trail = MemoryStore()
    turns: list[Turn] = [
        tool_call("write_file", {"path": "a", "content": "a"}),
        tool_call("list_files"),
        "done",
    ]
    lost = AuditLog(trail, flush_interval_s=None)
    with open_run_store(db) as store, sandbox() as sbx:
        crashing: list[Observer] = [dies_as_it_ends, AuditObserver(lost), RunRecorder(store)]
        with crash_then_resume(store, sbx, turns, lost, crashing, lost=True) as resumed:
            assert lost.pending and "run_end" not in {r.kind for r in trail.rows()}
        assert resumed.result.ok and "+a" in resumed.result.diff
        report = verify(trail, run_id="r", ledger=store)
        assert report.ok and report.found, [str(p) for p in report.problems]
        ledger = Counter(c.idempotency_key for c in store.ledger_calls("r"))
    assert _keys(trail, "r") == ledger and set(ledger.values()) == {1}  # every call in the trail, once


def _keys(trail: MemoryStore, run_id: str) -> Counter[str]:
    return Counter(
        str(e.attributes.get("idempotency_key"))
        for e in trail.events(run_id=run_id)
        if e.kind.value == "tool_call"
    )


def test_a_call_rejected_as_invalid_is_in_the_trail_once_after_a_kill_before_the_ledger(db: str) -> None:
    """The rejection's event is written (a batch of one here), then the process dies before the
    checkpoint that puts the call in the ledger: the resume rejects it again, and must not log
    a second event with its key."""

    def dies_after_the_rejection(event: AgentEvent) -> None:
        if isinstance(event, ToolRejected):
            raise Crash("the process dies after the trail's batch, before the checkpoint")

    trail = MemoryStore()
    turns: list[Turn] = [
        tool_call("write_file", {"path": "a", "content": "a"}),
        tool_call("no_such_tool", {"x": 1}),
        "done",
    ]
    log = AuditLog(trail, batch_size=1, flush_interval_s=None)
    with open_run_store(db) as store, sandbox() as sbx:
        crashing: list[Observer] = [AuditObserver(log), dies_after_the_rejection, RunRecorder(store)]
        with crash_then_resume(store, sbx, turns, log, crashing) as resumed:
            written, rejected = idempotency_key("r", 1, 0, "call_0_0"), idempotency_key("r", 2, 0, "call_1_0")
            assert _keys(trail, "r") == {written: 1, rejected: 1}
            assert [c.idempotency_key for c in store.ledger_calls("r")] == [written]
        result = resumed.result
        assert result.ok and result.steps[1].tool_calls[0].error_type == "InvalidToolCall"
        report = verify(trail, run_id="r", ledger=store)
        assert report.ok and report.found, [str(p) for p in report.problems]
        ledger = Counter(c.idempotency_key for c in store.ledger_calls("r"))
    assert _keys(trail, "r") == ledger and set(ledger.values()) == {1}


def test_a_run_killed_after_its_ends_trail_and_before_its_checkpoint_logs_its_end_once(db: str) -> None:
    """The end's last batch (the final model call, its step, ``run_end``) is written, then the
    process dies before the checkpoint saying the run ended: the resume sends the final request
    again (a repeat: it was sent, and cost, twice) and ends the run as the trail says already."""

    def dies_after_the_trail(event: AgentEvent) -> None:
        if isinstance(event, RunFinished):
            raise Crash("the process dies after the trail's last batch, before the checkpoint")

    trail = MemoryStore()
    turns: list[Turn] = [tool_call("write_file", {"path": "a", "content": "a"}), "done"]
    log = AuditLog(trail)
    with open_run_store(db) as store, sandbox() as sbx:
        crashing: list[Observer] = [AuditObserver(log), RunRecorder(store), dies_after_the_trail]
        with crash_then_resume(store, sbx, turns, log, crashing) as resumed:
            assert [e.kind.value for e in trail.events(run_id="r")][-1] == "run_end"
        assert resumed.result.ok and "+a" in resumed.result.diff
        report = verify(trail, run_id="r", ledger=store)
        assert report.ok and report.found, [str(p) for p in report.problems]
    events = list(trail.events(run_id="r"))
    assert [e.attributes["status"] for e in events if e.kind.value == "run_end"] == ["success"]
    final = [e.attributes.get("repeat") for e in events if e.kind.value == "model_call" and e.step == 2]
    assert final == [None, True]  # the final request, and its repeat by the resume
    assert [e.step for e in events if e.kind.value == "model_call" and e.step == 1] == [1]
    assert set(_keys(trail, "r").values()) == {1}


def test_a_repeated_final_request_that_ends_otherwise_is_a_marked_second_end(db: str) -> None:
    """The model need not answer the repeated request as it did: the run ends as the repeat says,
    and its ``run_end`` follows the first, marked as a repeat (verify lets it pass)."""

    def dies_after_the_trail(event: AgentEvent) -> None:
        if isinstance(event, RunFinished):
            raise Crash("the process dies after the trail's last batch, before the checkpoint")

    answers = iter(["done", "done, said otherwise"])

    async def model(request: ModelRequest) -> ModelResponse:
        if not any(isinstance(m, AssistantMessage) for m in request.messages):
            return ModelResponse(tool_calls=(tool_call("list_files", id="c1"),), finish_reason="tool_calls")
        return ModelResponse(text=next(answers), finish_reason="stop")

    trail = MemoryStore()
    with open_run_store(db) as store, sandbox() as sbx:
        with AuditLog(trail) as log, pytest.raises(Crash):
            Agent(
                FunctionModel(model), checkpointer=store, observers=[AuditObserver(log), dies_after_the_trail]
            ).run_sync("t", sandbox=sbx, run_id="r")
        with AuditLog(trail) as log:
            result = Agent(FunctionModel(model), checkpointer=store, observers=[AuditObserver(log)]).run_sync(
                resume="r", sandbox=sbx
            )
        report = verify(trail, run_id="r", ledger=store)
        assert report.ok, [str(p) for p in report.problems]
    assert result.answer == "done, said otherwise"
    ends = [e.attributes for e in trail.events(run_id="r") if e.kind.value == "run_end"]
    assert [(a["answer"], a.get("repeat")) for a in ends] == [("done", None), ("done, said otherwise", True)]


def test_replay_takes_the_runs_own_tools() -> None:
    tools = load_tools(["stockade.tools.builtin:shell"])
    assert "shell" in tools and "write_file" in tools
    with pytest.raises(InvalidArgument, match="not a Tool"):
        load_tools(["os:path"])
    with pytest.raises(InvalidArgument, match="MODULE:ATTR"):
        load_tools(["nothing"])


def test_the_time_a_killed_process_spent_past_its_checkpoint_counts_in_the_wall_time(db: str) -> None:
    """A process SIGKILLed in a long call kept that call's time only in memory: resumed again
    and again, the run ran past ``max_wall_s`` (an attack: 38 s of a 10 s budget over three
    kills). The resume counts the dead process's time to its lease's last renewal."""
    turns: list[Turn] = [
        tool_call("list_files"),
        tool_call("write_file", {"path": "b", "content": "b"}),
        "done",
    ]
    limits = RunLimits(max_wall_s=10.0)
    with open_run_store(db) as store, sandbox() as sbx:
        with pytest.raises(Crash):
            Agent(
                ScriptedModel(turns), checkpointer=store, limits=limits, observers=[crash_on("write_file")]
            ).run_sync("t", sandbox=sbx, run_id="r")
        # as a SIGKILL leaves it: the lease of a process that is gone, renewed 20 s after the
        # last checkpoint (the call ran on), and no word of how the run stopped
        saved = store.db.query("SELECT MAX(created_ns) FROM runs_checkpoints WHERE run_id = 'r'")[0][0]
        alive = int(str(saved)) + 20 * 1_000_000_000
        gone = owner_token().replace(f"/{os.getpid()}/", "/999999999/")
        store.db.write(
            [
                (
                    "UPDATE runs_leases SET owner = ?, expires_ns = ? WHERE run_id = 'r'",
                    [(gone, alive + round(store.lease_s * 1e9))],
                )
            ]
        )
        result = Agent(ScriptedModel(turns), checkpointer=store, limits=limits).run_sync(
            resume="r", sandbox=sbx
        )
    assert result.status == RunStatus.BUDGET, (result.status, result.error)
    assert result.state.elapsed_s >= 20.0


def test_a_call_running_under_a_held_lease_is_not_in_flight_one_an_exception_cut_is_until_resumed(
    store: RunStore,
) -> None:
    """``in_flight`` is a call no live process runs and nothing in the trail closed: not one
    running now (its run's lease is held). An exception escaping the run (a crash in Python)
    releases the lease but writes no ``run_end``: the trail has the call's start and nothing
    after it, as after a death, until a resume records the call."""
    trail = MemoryStore()
    seen: list[list[str]] = []

    @tool
    def slow(ctx: ToolContext) -> str:
        """Look at the trail mid-call."""
        if seen:
            return "done this time"
        log.flush()
        seen.append([p.kind.value for p in verify(trail, ledger=store).problems])
        raise Died("the process stops here")

    def agent(turns: list[Turn]) -> Agent:
        return Agent(
            ScriptedModel(turns),
            tools=default_toolset().including(slow),
            checkpointer=store,
            observers=[AuditObserver(log), RunRecorder(store)],
        )

    with sandbox() as sbx, AuditLog(trail, flush_interval_s=None) as log:
        with pytest.raises(Died):
            agent([tool_call("slow"), "done"]).run_sync("t", sandbox=sbx, run_id="r")
        assert seen == [[]]  # live: its lease is held
        assert store.calls_in_flight("r") == []  # the run store's word: released by its own process
        (cut,) = verify(trail, ledger=store).problems  # the trail's: nothing ended the run
        assert cut.kind.value == "in_flight" and "slow" in cut.detail
        resumed = agent([tool_call("slow"), "done"]).run_sync(resume="r", sandbox=sbx)
        assert resumed.status == RunStatus.SUCCESS, resumed.error
    assert verify(trail, ledger=store).ok
    assert [e.attributes["tool"] for e in trail.events() if e.kind.value == "tool_call_start"] == ["slow"]
