"""Readers of the run store and the audit trail change nothing in what they read: ``audit
verify`` (its cross-check with the run store), ``runs list | show`` and the run viewer open
both read-only; a table they lack is said, never made; nothing is made beside the file."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from stockade.assembly import AgentConfig, build_agent
from stockade.cli.main import app
from stockade.exceptions import ConfigurationError, RunStoreCorrupt, RunStoreError
from stockade.models import ScriptedModel, tool_call
from stockade.policy import Policy
from stockade.policy.schema import TrustRules
from stockade.runs import RetryEntry, open_run_store
from stockade.server.viewer.data import LocalRuns
from stockade.server.viewer.values import Filters
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.types import Trust

runner = CliRunner()


def recorded(folder: Path) -> tuple[Path, str]:
    """A run and its audit trail in one database, as ``stockade agent`` keeps them; then its
    process "died": its row says running, its lease expired. The file is left without a
    ``-wal`` (its last writer closed it)."""
    db = folder / "audit.db"
    config = AgentConfig(
        model=ScriptedModel([tool_call("write_file", {"path": "a.txt", "content": "x\n"}), "done"]),
        policy=Policy(trust=TrustRules(level=Trust.TRUSTED)),
        backend=FakeBackend(MemoryWorkspace(), tier="process"),
        audit=f"sqlite:///{db}",
        approval_dir=folder / "approvals",
        kill_target=str(folder / "kill"),
    )
    with build_agent(config) as agent:
        run_id = agent.run_sync("write a").run_id
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE runs_runs SET status = 'running', error = NULL WHERE run_id = ?", (run_id,))
        conn.execute("UPDATE runs_leases SET expires_ns = 1 WHERE run_id = ?", (run_id,))
    conn.close()
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("audit.db")) == ["audit.db"]
    return db, run_id


def files(db: Path) -> dict[str, bytes]:
    """The database and whatever lies beside it, byte for byte."""
    return {p.name: p.read_bytes() for p in db.parent.iterdir() if p.name.startswith(db.name)}


def test_verify_leaves_a_run_store_that_lacks_a_table_as_it_is_and_says_so(tmp_path: Path) -> None:
    """verify opened the run store read-write: it made the dropped table again (and added the
    MAC column an earlier stockade had not made), writing into the evidence it checked."""
    db, _ = recorded(tmp_path)
    with sqlite3.connect(db) as conn:
        conn.execute("DROP TABLE runs_setups")
        conn.execute("ALTER TABLE runs_steps DROP COLUMN mac")
    conn.close()
    before = files(db)

    result = runner.invoke(app, ["audit", "verify", "--db", f"sqlite:///{db}", "--runs-db", str(db)])
    assert result.exit_code == 3, result.output  # nothing proven either way
    assert "lacks runs_steps.mac, runs_setups" in result.output and "nothing was added" in result.output
    assert files(db) == before


def test_verify_and_the_run_commands_read_a_dead_run_without_marking_it(tmp_path: Path) -> None:
    """runs list, runs show and verify swept the store first: reading marked the run
    interrupted. They show it so now, and the row stays as the dead process left it."""
    db, run_id = recorded(tmp_path)
    before = files(db)
    url = f"sqlite:///{db}"

    verified = runner.invoke(app, ["audit", "verify", "--db", url, "--json"])
    assert verified.exit_code == 0, verified.output
    assert json.loads(verified.output)["ledger"] is True
    listed = runner.invoke(app, ["runs", "list", "--db", url, "--json"])
    assert listed.exit_code == 0, listed.output
    assert [(r["run_id"], r["status"]) for r in json.loads(listed.output)] == [(run_id, "interrupted")]
    for status, shown in (("interrupted", [run_id]), ("running", [])):
        only = runner.invoke(app, ["runs", "list", "--db", url, "--status", status, "--json"])
        assert [r["run_id"] for r in json.loads(only.output)] == shown, status
    shown_run = runner.invoke(app, ["runs", "show", run_id, "--db", url, "--json"])
    assert shown_run.exit_code == 0, shown_run.output
    assert json.loads(shown_run.output)["status"] == "interrupted"

    assert files(db) == before
    with sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True) as conn:
        assert conn.execute("SELECT status FROM runs_runs").fetchall() == [("running",)]
    conn.close()


def test_the_viewer_renders_a_database_it_only_reads(tmp_path: Path) -> None:
    """The viewer opened the run store and the audit store read-write: listing the runs marked
    the dead one, and a -wal and -shm were made beside a file it only read."""
    db, run_id = recorded(tmp_path)
    before = files(db)
    source = LocalRuns(f"sqlite:///{db}", approvals=tmp_path / "approvals")
    try:
        assert [(r.run_id, r.status) for r in source.runs(Filters())] == [(run_id, "interrupted")]
        view = source.run(run_id)
        assert view is not None and view.row.status == "interrupted"
        assert view.verification is not None and view.verification.ok is True
        assert any(e.kind == "tool" for step in view.steps for e in step.entries)
        assert files(db) == before
    finally:
        source.close()
    assert files(db) == before


def test_a_reader_makes_no_store_refuses_writes_and_sees_a_writer_that_starts_later(tmp_path: Path) -> None:
    missing = tmp_path / "none.db"
    with pytest.raises(RunStoreError, match=r"none\.db"):
        open_run_store(str(missing), read_only=True)
    assert not missing.exists()

    db, run_id = recorded(tmp_path)
    with open_run_store(str(db), read_only=True) as reader:
        assert [s.run_id for s in reader.runs()] == [run_id]
        entry = RetryEntry(step=1, call_id=None, subject="s", attempt=1, delay_s=0, reason="r", recorded_ns=1)
        with pytest.raises(ConfigurationError, match="read-only"):
            reader.record_retry(run_id, entry)
        with open_run_store(str(db)) as writer:  # a run starts while the reader is open
            writer.record_retry(run_id, entry)
            assert len(reader.retries(run_id)) == 1
        assert len(reader.retries(run_id)) == 1

    with sqlite3.connect(db) as conn:
        conn.execute("DROP TABLE runs_erased")
    conn.close()
    with pytest.raises(RunStoreCorrupt, match="lacks runs_erased"):
        open_run_store(str(db), read_only=True)


@pytest.mark.parametrize("command", [["runs", "list"], ["runs", "show", "r1"], ["audit", "verify"]])
def test_a_fifo_given_as_the_database_is_refused_not_waited_on(tmp_path: Path, command: list[str]) -> None:
    """`runs list --db sqlite:///a-fifo` waited, for ever, for someone to write into it."""
    fifo = tmp_path / "runs.db"
    os.mkfifo(fifo)
    done: list[Result] = []
    reader = threading.Thread(
        target=lambda: done.append(runner.invoke(app, [*command, "--db", f"sqlite:///{fifo}"])), daemon=True
    )
    reader.start()
    reader.join(30)
    if reader.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # its open goes on: the test ends
        reader.join(30)
        pytest.fail(f"{command} waited on a FIFO")
    (result,) = done
    assert result.exit_code != 0 and "not a regular file" in result.output, result.output
