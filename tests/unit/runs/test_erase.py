"""Erasing runs: every row of the run goes, what other runs share stays, the audit chain is untouched."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest

from stockade import Sandbox
from stockade.agent import Agent
from stockade.agent.events import Observer as AgentObserver
from stockade.audit import AuditLog, MemoryStore, verify
from stockade.audit.agent import AuditObserver
from stockade.exceptions import InvalidArgument, RunConflict
from stockade.runs import RunRecorder, RunStore
from stockade.sandbox.base import OpResult
from stockade.sandbox.ops import Op, ReadFile
from stockade.testing import FakeBackend, MemoryWorkspace, ScriptedModel, tool_call
from stockade.tools import default_toolset

SAME = tool_call("write_file", {"path": "shared.txt", "content": "the same in both runs\n"})


def run(store: RunStore, log: AuditLog, run_id: str, subject: str, own: str) -> None:
    model = ScriptedModel([SAME, tool_call("write_file", {"path": "own.txt", "content": own}), "done"])
    observers: list[AgentObserver] = [AuditObserver(log), RunRecorder(store, subject=subject)]
    agent = Agent(model, tools=default_toolset(), checkpointer=store, observers=observers)
    with Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sbx:
        agent.run_sync("write", sandbox=sbx, run_id=run_id)


def test_erasing_a_subjects_runs_keeps_what_others_share_and_the_chain(
    store: RunStore, tmp_path: Path
) -> None:
    log = AuditLog(MemoryStore(), flush_interval_s=None)
    run(store, log, "alice-1", "alice", "alice's notes\n")
    run(store, log, "bob-1", "bob", "bob's notes\n")
    assert store.runs_of(subject="alice") == ["alice-1"]
    assert store.erase(store.runs_of(subject="alice")) == 1
    assert store.summary("alice-1") is None and store.load("alice-1") is None
    assert store.tool_calls("alice-1") == [] and store.runs_of(subject="alice") == []
    for table in ("checkpoints", "messages", "steps", "workspace", "calls_started", "leases", "subjects"):
        assert not store.db.query(f"SELECT 1 FROM {store.ns}_{table} WHERE run_id = ?", ("alice-1",)), table
    store.export_workspace("bob-1", tmp_path / "bob")  # bob's copy of the shared content is intact
    assert (tmp_path / "bob" / "shared.txt").read_text() == "the same in both runs\n"
    assert (tmp_path / "bob" / "own.txt").read_text() == "bob's notes\n"
    rows = store.db.query(f"SELECT data FROM {store.ns}_blobs")
    contents = {zlib.decompress(r[0]) for r in rows if isinstance(r[0], bytes)}
    assert b"alice's notes\n" not in contents  # her own file is gone; what bob shares stays
    assert {b"bob's notes\n", b"the same in both runs\n"} <= contents
    log.flush()
    report = verify(log.store, ledger=store)
    assert report.ok and report.found


def test_a_running_run_is_not_erased(store: RunStore) -> None:
    lease = store.claim("live", new=True)
    try:
        from stockade.agent.state import RunState

        store.save(RunState(run_id="live", task="t", system="s", model_name="m"))
        with pytest.raises(RunConflict, match="running"):
            store.erase(["live"])
    finally:
        lease.release()


def test_a_content_another_run_takes_while_an_erasure_runs_is_not_lost(
    store: RunStore, tmp_path: Path
) -> None:
    """Bob's record finds alice's content stored (so it does not bring it again); alice's
    erasure, between that finding and bob's record being written, found no run using it and
    deleted it: bob's workspace referred to a content no longer stored (found by reading the
    code). The take is counted in bob's transaction and a content found gone is stored again."""
    log = AuditLog(MemoryStore(), flush_interval_s=None)
    run(store, log, "alice-1", "alice", "alice's notes\n")
    files = {"copy.txt": b"alice's notes\n", "zz-read-last.txt": b"bob's own\n"}
    workspace = MemoryWorkspace(files=dict(files))
    erased: list[int] = []
    reads: list[str] = []

    def handler(op: Op[Any]) -> OpResult:
        if isinstance(op, ReadFile):
            reads.append(op.path)
        # the second read: the run store's record (the first is the diff's baseline), copy.txt
        # read before it and found stored
        if reads.count("zz-read-last.txt") == 2 and not erased:
            erased.append(store.erase(["alice-1"]))
        return workspace(op)

    model = ScriptedModel(["nothing to do"])
    agent = Agent(model, tools=default_toolset(), checkpointer=store, observers=[RunRecorder(store)])
    with Sandbox.create(backend=FakeBackend(handler)) as sbx:
        agent.run_sync("look", sandbox=sbx, run_id="bob-1")
    assert erased == [1]
    store.export_workspace("bob-1", tmp_path / "bob")
    assert {name: (tmp_path / "bob" / name).read_bytes() for name in files} == files


def test_a_run_id_given_alone_is_refused_not_read_a_character_at_a_time(store: RunStore) -> None:
    """``erase("run-1")`` erased nothing and recorded the erasure of runs "r", "u", "n", ..."""
    with pytest.raises(InvalidArgument):
        store.erase("run-1")  # a str is a Sequence[str] to the type checker, not to erase
