"""One suite, both run stores (SQLite and PostgreSQL): checkpoints are append-only rows, load
returns the latest state, another process resumes where this one stopped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stockade import Sandbox
from stockade.agent import Agent, AgentEvent, RunState, RunStatus, ToolReturned
from stockade.exceptions import ConfigurationError, RunStoreCorrupt, RunStoreError
from stockade.models.messages import UserMessage
from stockade.models.scripted import Turn
from stockade.runs import RunRecorder, RunStore, open_run_store
from stockade.testing import FakeBackend, ScriptedModel, tool_call
from tests.integration.run_stores import StoreTarget, run_store_target  # noqa: F401 - a fixture

TURNS: list[Turn] = [
    tool_call("write_file", {"path": "notes.txt", "content": "one\n"}),
    [tool_call("read_file", {"path": "notes.txt"}), tool_call("list_files", {})],
    "done",
]


@pytest.fixture
def store(run_store_target: StoreTarget) -> Iterator[RunStore]:  # noqa: F811 - the fixture above
    with open_run_store(run_store_target.url, namespace=run_store_target.namespace) as opened:
        yield opened


def reopen(store: RunStore, target: StoreTarget) -> RunStore:
    """The same database, as another process would open it."""
    return open_run_store(target.url, namespace=target.namespace)


def count(store: RunStore, table: str, run_id: str) -> int:
    (row,) = store.db.query(f"SELECT COUNT(*) FROM {store.ns}_{table} WHERE run_id = ?", (run_id,))
    return int(str(row[0]))


async def test_every_checkpoint_loads_back_as_the_live_state(store: RunStore) -> None:
    sbx = Sandbox.create(backend=FakeBackend())
    async with Agent(ScriptedModel(TURNS), checkpointer=store).iter("note", sandbox=sbx, run_id="r1") as run:
        async for _ in run:
            loaded = store.load("r1")
            assert loaded is not None
            if run.state.status.finished and run.result is None:
                # The node that ended the run is not saved as ended: End's checkpoint is the
                # first to say so, after the diff and the trail's last events (the unit test
                # of the checkpointer says why).
                assert loaded.status == RunStatus.RUNNING and len(loaded.steps) == len(run.state.steps) - 1
            else:
                assert loaded.model_dump() == run.state.model_dump()
    final = store.load("r1")
    assert final is not None and final.status == RunStatus.SUCCESS
    assert final.model_dump() == run.state.model_dump()
    assert store.load("nope") is None


async def test_a_save_appends_rows_and_writes_each_message_and_step_once(store: RunStore) -> None:
    sbx = Sandbox.create(backend=FakeBackend())
    saves = 0

    class Counting:
        def save(self, state: RunState) -> None:
            nonlocal saves
            saves += 1
            store.save(state)

        def load(self, run_id: str) -> RunState | None:
            return store.load(run_id)

    result = await Agent(ScriptedModel(TURNS), checkpointer=Counting()).run("note", sandbox=sbx, run_id="r1")
    assert count(store, "checkpoints", "r1") == saves  # one small row per save
    assert count(store, "messages", "r1") == len(result.state.messages)
    assert count(store, "steps", "r1") == len(result.steps) == 3
    assert count(store, "tool_calls", "r1") == 3  # the ledger, by idempotency key


async def test_a_rewritten_conversation_is_saved_from_the_first_change(store: RunStore) -> None:
    sbx = Sandbox.create(backend=FakeBackend())
    result = await Agent(ScriptedModel(TURNS), checkpointer=store).run("note", sandbox=sbx, run_id="r1")
    state = result.state
    state.messages[0] = UserMessage(content="note (the task, compacted)")  # e.g. context compaction
    del state.messages[3:]
    store.save(state)
    loaded = store.load("r1")
    assert loaded is not None and loaded.messages == state.messages


async def test_another_process_resumes_from_the_ledger_and_keeps_numbering(
    store: RunStore,
    run_store_target: StoreTarget,  # noqa: F811 - the fixture
) -> None:
    ran: list[str] = []

    def note(event: AgentEvent) -> None:
        if isinstance(event, ToolReturned):
            ran.append(event.record.call.name)

    def stop_after_read(event: AgentEvent) -> None:
        if isinstance(event, ToolReturned) and event.record.call.name == "read_file":
            raise KeyboardInterrupt  # the process goes away mid-step, read_file done, list_files not

    sbx = Sandbox.create(backend=FakeBackend())
    agent = Agent(
        ScriptedModel(TURNS), checkpointer=store, observers=[RunRecorder(store), note, stop_after_read]
    )
    with pytest.raises(KeyboardInterrupt):
        await agent.run("note", sandbox=sbx, run_id="r1")
    checkpoints = count(store, "checkpoints", "r1")

    with reopen(store, run_store_target) as other:
        agent = Agent(ScriptedModel(TURNS), checkpointer=other, observers=[RunRecorder(other), note])
        result = await agent.run(resume="r1", sandbox=sbx)
        assert result.status == RunStatus.SUCCESS
        assert ran == ["write_file", "read_file", "list_files"]  # each once
        assert [r.call.name for r in result.steps[1].tool_calls] == ["read_file", "list_files"]
        assert count(other, "checkpoints", "r1") > checkpoints  # numbering went on, no conflict


async def test_runs_are_listed_newest_first_with_their_usage(store: RunStore) -> None:
    sbx = Sandbox.create(backend=FakeBackend())
    for run_id in ("first", "second"):
        await Agent(ScriptedModel(TURNS), checkpointer=store).run("note", sandbox=sbx, run_id=run_id)
    await Agent(ScriptedModel(["ok"]), checkpointer=store).run("tiny", sandbox=sbx, run_id="third")
    runs = store.runs()
    assert [r.run_id for r in runs] == ["third", "second", "first"]
    assert runs[1].steps == 3 and runs[1].usage.requests == 3 and runs[1].usage.total_tokens > 0
    assert [r.run_id for r in store.runs(limit=1)] == ["third"]
    assert store.find("fi") == ["first"] and store.find("%") == [] and store.find("f_rst") == []
    assert store.find("FI") == [] and store.find("") == []  # in its case, on SQLite as on PostgreSQL


async def test_a_reader_reads_and_writes_nothing(store: RunStore, run_store_target: StoreTarget) -> None:  # noqa: F811
    """A reader (audit verify, runs list, the viewer) opened the store read-write: it made the
    tables a store lacked and marked the runs whose process died. Read-only, it shows them
    interrupted, leaves their rows, and neither its writes nor its own SQL can change a row."""
    url, ns = run_store_target.url, run_store_target.namespace
    await Agent(ScriptedModel(TURNS), checkpointer=store).run(
        "note", sandbox=Sandbox.create(backend=FakeBackend()), run_id="dead"
    )
    store.db.write(  # its process died mid-run: the row still says running, the lease expired
        [
            (f"UPDATE {ns}_runs SET status = 'running' WHERE run_id = ?", [("dead",)]),
            (f"UPDATE {ns}_leases SET expires_ns = 1 WHERE run_id = ?", [("dead",)]),
        ]
    )
    with open_run_store(url, namespace=ns, read_only=True) as reader:
        assert [(r.run_id, r.status) for r in reader.runs()] == [("dead", RunStatus.INTERRUPTED)]
        assert reader.runs(status=RunStatus.RUNNING) == []
        assert reader.load("dead") is not None and len(reader.tool_calls("dead")) == 3
        with pytest.raises(ConfigurationError, match="read-only"):
            reader.sweep()
        with pytest.raises(RunStoreError):  # a READ ONLY transaction, a file opened read-only
            reader.db.query(f"UPDATE {ns}_runs SET status = 'success'")
    assert store.db.query(f"SELECT status FROM {ns}_runs") == [("running",)]

    store.db.write([(f"DROP TABLE {ns}_erased", [()])])
    with pytest.raises(RunStoreCorrupt, match=f"lacks {ns}_erased"):
        open_run_store(url, namespace=ns, read_only=True)
    assert store.db.columns(f"{ns}_erased") == set()  # still missing: nothing was made


def test_a_subjects_runs_are_erased_and_nothing_else(store: RunStore) -> None:
    for run_id, subject in (("mine", "alice"), ("theirs", "bob")):
        agent = Agent(
            ScriptedModel(TURNS), checkpointer=store, observers=[RunRecorder(store, subject=subject)]
        )
        with Sandbox.create(backend=FakeBackend()) as sbx:
            agent.run_sync("write notes", sandbox=sbx, run_id=run_id)
    assert store.runs_of(subject="alice") == ["mine"]
    assert store.erase(store.runs_of(subject="alice")) == 1
    for table in ("runs", "checkpoints", "messages", "steps", "tool_calls", "workspace", "subjects"):
        assert count(store, table, "mine") == 0, table
        assert count(store, table, "theirs") > 0, table
    assert store.load("mine") is None and store.load("theirs") is not None
    assert store.runs_of(before_ns=2**62) == ["theirs"]


def test_processes_started_together_create_the_tables_once(
    run_store_target: StoreTarget,  # noqa: F811 - the fixture
) -> None:
    """Several servers and workers started at once on a fresh database: each makes the run
    store's and the service's tables if missing, and none fails on another's doing so."""
    import threading

    from stockade.runs._db import PostgresDatabase
    from stockade.server.state.schema import TABLES, open_database
    from stockade.server.state.store import ServiceStore

    service_ns = f"{run_store_target.namespace}_s"
    barrier = threading.Barrier(4)
    failures: list[BaseException] = []

    def start() -> None:
        barrier.wait()
        try:
            RunStore(open_database(run_store_target.url), namespace=run_store_target.namespace).close()
            ServiceStore(open_database(run_store_target.url), namespace=service_ns).close()
        except BaseException as error:  # reported below
            failures.append(error)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    db = open_database(run_store_target.url)
    try:
        if isinstance(db, PostgresDatabase):
            db.write([(f"DROP TABLE IF EXISTS {', '.join(f'{service_ns}_{t}' for t in TABLES)}", [()])])
    finally:
        db.close()
    assert failures == []
