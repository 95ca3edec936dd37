"""A run a run store recorded is in the trail as such: deleting every row of it from the
store, which left nothing for the ledger's checks to find, is reported by ``audit verify``;
an erasure through stockade (``runs erase``, sealed or not) is recorded and verifies."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from stockade.assembly import AgentConfig, build_agent
from stockade.audit import SQLiteStore, verify
from stockade.audit.verify_report import ProblemKind
from stockade.cli.main import app
from stockade.models import ScriptedModel, tool_call
from stockade.runs import open_run_store
from stockade.testing import FakeBackend, MemoryWorkspace

KEY = b"k" * 32
TABLES = (
    "runs",
    "checkpoints",
    "messages",
    "steps",
    "calls",
    "calls_started",
    "leases",
    "setups",
    "workspace",
)


def recorded(tmp_path: Path, *run_ids: str) -> str:
    db = f"sqlite:///{tmp_path / 'audit.db'}"
    for run_id in run_ids:
        model = ScriptedModel([tool_call("write_file", {"path": "notes.txt", "content": "hi\n"}), "done"])
        config = AgentConfig(
            model=model, backend=FakeBackend(MemoryWorkspace(), tier="microvm"), audit=db, audit_key=KEY,
            approval_dir=tmp_path / "approvals", kill_target=str(tmp_path / "kill"),
        )  # fmt: skip
        with build_agent(config) as agent:
            agent.run_sync("note", run_id=run_id)
    return db


def problems(db: str) -> list[tuple[ProblemKind, str]]:
    with SQLiteStore(db.removeprefix("sqlite:///")) as store, open_run_store(db, key=KEY) as runs:
        return [(p.kind, p.run_id) for p in verify(store, key=KEY, ledger=runs).problems]


def test_a_run_deleted_from_the_store_behind_its_back_is_reported(tmp_path: Path) -> None:
    db = recorded(tmp_path, "kept", "gone")
    assert problems(db) == []
    with open_run_store(db, key=KEY) as runs:
        for table in TABLES:  # every row of the run, in every table that has one
            if runs.db.query(f"SELECT name FROM sqlite_master WHERE name = '{runs.ns}_{table}'"):
                runs.db.write([(f"DELETE FROM {runs.ns}_{table} WHERE run_id = ?", [("gone",)])])
        assert runs.summary("gone") is None and runs.summary("kept") is not None
    assert problems(db) == [(ProblemKind.NOT_IN_STORE, "gone")]
    shown = CliRunner().invoke(app, ["audit", "verify", "--db", db], env={"STOCKADE_AUDIT_KEY": KEY.decode()})
    assert shown.exit_code != 0 and "no row of run gone" in shown.output, shown.output


def test_runs_erase_records_the_erasure_and_verifies(tmp_path: Path) -> None:
    db = recorded(tmp_path, "kept", "erased")
    env = {"STOCKADE_AUDIT_KEY": KEY.decode()}
    erased = CliRunner().invoke(app, ["runs", "erase", "erased", "--db", db], env=env)
    assert erased.exit_code == 0 and "erased 1 run(s)" in erased.output, erased.output
    assert problems(db) == []
