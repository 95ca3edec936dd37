"""What stockade keeps on the host (audit trails and their sealing keys, the run and service
databases, approvals, kill switches, exports) is made this user's alone, whatever the umask:
with 022 every local user could read them, and copy a run's key before erasure destroyed it."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stockade._private import replace_private
from stockade._state import sqlite_files
from stockade.audit import AuditLog, EventKind, SQLiteStore
from stockade.cli.main import app
from stockade.policy.approval import ApprovalRequest, ApprovalStore
from stockade.runs._db import SQLiteDatabase
from stockade.runtime.killswitch import FileKillSource


@pytest.fixture(autouse=True)
def common_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in sorted(root.rglob("*"))}


def test_the_audit_store_and_the_files_sqlite_adds_are_0600_in_a_0700_folder(tmp_path: Path) -> None:
    db = tmp_path / "work" / ".stockade" / "audit.db"
    store = SQLiteStore(db)
    with AuditLog(store) as log:
        log.record(EventKind.COMMAND, run_id="run-a", step=0, attributes={"argv": ["ls"]})
        assert [p.name for p in sqlite_files(db) if p.exists()] == [
            "audit.db",
            "audit.db-wal",
            "audit.db-shm",
        ]
        assert _modes(tmp_path) == {
            "work": 0o700,
            "work/.stockade": 0o700,
            "work/.stockade/audit.db": 0o600,
            "work/.stockade/audit.db-shm": 0o600,
            "work/.stockade/audit.db-wal": 0o600,
        }
    store.close()


def test_the_run_and_service_database_is_0600_in_a_0700_folder(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "svc" / "service.db")
    try:
        db.create(["CREATE TABLE keys (k BLOB)"], name="keys")
        db.write([("INSERT INTO keys VALUES (?)", [(b"secret",)])])
        assert set(_modes(tmp_path).values()) == {0o600, 0o700}
        assert _modes(tmp_path)["svc"] == 0o700
    finally:
        db.close()


def test_approvals_kill_switches_and_live_marks_are_0600_in_0700_folders(tmp_path: Path) -> None:
    ApprovalStore(tmp_path / "approvals").submit(
        ApprovalRequest(run_id="run-1", action="run `git push origin main`", rule="r", reason="why")
    )
    kills = FileKillSource(tmp_path / "kill")
    kills.mark_live("run-1", "{}")
    kills.kill("run-2", "enough")

    modes = _modes(tmp_path)
    assert {name for name, mode in modes.items() if mode != 0o600} == {
        "approvals",
        "approvals/run-1",
        "kill",
        "kill/.live",
    }
    assert {modes[name] for name in ("approvals", "approvals/run-1", "kill", "kill/.live")} == {0o700}


def test_an_audit_export_to_a_file_is_0600(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "a.db")
    with AuditLog(store) as log:
        log.record(EventKind.COMMAND, run_id="run-a", step=0, attributes={"argv": ["ls"]})
    store.close()
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(
        app, ["audit", "export", "--db", f"sqlite:///{tmp_path / 'a.db'}", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_a_replaced_file_is_left_as_it_was_when_its_writer_fails(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("the last whole export\n")
    with pytest.raises(RuntimeError), replace_private(out) as stream:
        stream.write("half of")
        raise RuntimeError("the writer stopped")
    assert out.read_text() == "the last whole export\n"
    assert os.listdir(tmp_path) == ["out.jsonl"]


def test_an_existing_store_others_can_read_is_warned_about_and_left_as_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "audit.db"
    SQLiteStore(db).close()
    db.chmod(0o644)  # a previous version's
    with caplog.at_level(logging.WARNING, logger="stockade"):
        SQLiteStore(db).close()
    assert stat.S_IMODE(db.stat().st_mode) == 0o644
    assert "open to other users (mode 644)" in caplog.text
