"""``stockade runs erase``, black-box: it erases the runs named by their whole ids and no other
(never one a prefix or another case names, never every run for an empty id); it leaves nothing
of a paused run behind (the state `stockade agent` kept to resume it, its approvals folder);
and the trail records an erasure before the rows go, so an erasure cut in between is finished
by erasing the run again."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from typer.testing import CliRunner

from stockade.agent.state import RunState
from stockade.audit import SQLiteStore, verify
from stockade.audit.verify_report import ProblemKind
from stockade.cli.main import app
from stockade.policy import ApprovalRequest, ApprovalStore
from stockade.runs import open_run_store
from tests.unit.audit.test_verify_deleted_runs import KEY, recorded  # a store with runs, keyed

ENV = {"STOCKADE_AUDIT_KEY": KEY.decode()}


def stored(db: str) -> list[str]:
    with open_run_store(db) as runs:
        return sorted(s.run_id for s in runs.runs())


def erase(db: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(
        app,
        ["runs", "erase", *args, "--db", db, "--snapshot-dir", str(Path(db[10:]).parent / "snaps")],
        env=ENV,
    )
    return result.exit_code, result.output


def problems(db: str) -> list[tuple[ProblemKind, str]]:
    with SQLiteStore(db.removeprefix("sqlite:///")) as store, open_run_store(db, key=KEY) as runs:
        return [(p.kind, p.run_id) for p in verify(store, key=KEY, ledger=runs).problems]


def test_erasing_a_run_again_leaves_the_run_whose_id_extends_it(tmp_path: Path) -> None:
    db = recorded(tmp_path, "job-1", "job-10")
    assert erase(db, "job-1")[0] == 0
    code, shown = erase(db, "job-1")  # a cleanup job retried
    assert code == 1 and "erased already" in shown, shown
    assert stored(db) == ["job-10"]
    assert problems(db) == []


def test_a_prefix_another_case_or_an_empty_id_erases_nothing(tmp_path: Path) -> None:
    db = recorded(tmp_path, "prod-Main")
    for named in ("PROD", "prod", "prod-main", ""):
        code, shown = erase(db, named)
        assert code == 2 and ("no run" in shown or "empty run id" in shown), (named, shown)
    assert stored(db) == ["prod-Main"]


def test_a_prefix_the_read_commands_accept_is_matched_in_its_case_and_literally(tmp_path: Path) -> None:
    db = recorded(tmp_path, "prod-Main", "a_b")
    with open_run_store(db) as runs:
        assert runs.find("prod") == ["prod-Main"]
        assert runs.find("PROD") == []  # SQLite's LIKE ignored case, PostgreSQL's did not
        assert runs.find("") == []  # it was every run
        assert runs.find("a_") == ["a_b"] and runs.find("a%") == [] and runs.find("_") == []
    shown = CliRunner().invoke(app, ["runs", "show", "PROD", "--db", db])
    assert shown.exit_code == 2 and "no run" in shown.output, shown.output


def test_erasing_a_paused_run_removes_the_state_kept_to_resume_it_and_its_approvals_folder(
    tmp_path: Path,
) -> None:
    db = recorded(tmp_path, "sec-1", "other")
    state = tmp_path / "paused"
    for run_id in ("sec-1", "other"):  # as `stockade agent` keeps it: its options, its workspace copy
        (state / run_id / "workspace" / ".stockade").mkdir(parents=True)
        (state / run_id / "run.json").write_text("{}")
        (state / run_id / "workspace" / "notes.txt").write_text("model-written\n")
        (state / run_id / "workspace" / ".stockade" / "baseline.json").write_text('{"a.txt": "original"}')
    (state / "not-a-run").mkdir()  # no run.json: not `agent`'s, whatever its name
    approvals = ApprovalStore(tmp_path / "approvals")
    approvals.submit(ApprovalRequest(run_id="sec-1", action="run `git push`", rule="push", reason="r"))
    code, shown = erase(
        db, "sec-1", "not-a-run", "--state-dir", str(state), "--approval-dir", str(tmp_path / "approvals")
    )
    assert code == 2 and "no run 'not-a-run'" in shown, shown  # nothing erased for a name no run has
    code, shown = erase(db, "sec-1", "--state-dir", str(state), "--approval-dir", str(tmp_path / "approvals"))
    assert code == 0 and "the paused state of 1" in shown, shown
    assert not (state / "sec-1").exists() and not (tmp_path / "approvals" / "sec-1").exists()
    assert (state / "other" / "workspace" / "notes.txt").exists() and (state / "not-a-run").is_dir()


def test_an_erasure_whose_trail_note_fails_erases_nothing_and_is_finished_by_erasing_again(
    tmp_path: Path,
) -> None:
    db = recorded(tmp_path, "er-1")
    with sqlite3.connect(tmp_path / "audit.db") as conn:  # the append of its note fails (a full disk)
        conn.execute(
            "CREATE TRIGGER full BEFORE INSERT ON audit_events WHEN NEW.kind = 'note' "
            "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"
        )
    code, shown = erase(db, "er-1")
    assert code != 0, shown
    assert stored(db) == ["er-1"] and problems(db) == []  # the rows stay while the trail says nothing
    with sqlite3.connect(tmp_path / "audit.db") as conn:
        conn.execute("DROP TRIGGER full")
    code, shown = erase(db, "er-1")
    assert code == 0 and "erased 1 run(s)" in shown, shown
    assert stored(db) == [] and problems(db) == []


def test_a_run_the_trail_knows_and_the_store_lost_has_its_erasure_recorded(tmp_path: Path) -> None:
    db = recorded(tmp_path, "kept", "lost")
    with open_run_store(db, key=KEY) as runs:  # an erasure cut after the rows went (an older stockade)
        runs.erase(["lost"])
    assert problems(db) == [(ProblemKind.NOT_IN_STORE, "lost")]
    code, shown = erase(db, "lost")
    assert code == 0 and "recorded the erasure of 1 run(s) the store no longer had" in shown, shown
    assert problems(db) == [] and stored(db) == ["kept"]
    assert erase(db, "lost")[0] == 1  # recorded once: nothing is left to do


def test_a_running_run_is_refused_before_its_erasure_is_recorded(tmp_path: Path) -> None:
    db = recorded(tmp_path, "done")
    with open_run_store(db, key=KEY) as runs:
        lease = runs.claim("live", new=True)  # held by this process: live
        try:
            runs.save(RunState(run_id="live", task="t", system="s", model_name="m"))
            code, shown = erase(db, "done", "live")
            assert code == 2 and "is running" in shown, shown
        finally:
            lease.release()
    assert stored(db) == ["done", "live"]
    with SQLiteStore(tmp_path / "audit.db") as audit:  # the trail says nothing was erased
        assert not [row for row in audit.rows() if row.kind == "note"]
