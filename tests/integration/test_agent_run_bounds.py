"""A run's wall time and its diff on the real process tier, against a hostile model: the model
picks a command's timeout and code can rewrite anything in the workspace, the diff's baseline
included."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from stockade import Sandbox
from stockade.agent import Agent, Observer, RunLimits, RunStatus
from stockade.audit import AuditLog, MemoryStore, verify
from stockade.audit.agent import AuditObserver
from stockade.runs import RunRecorder, RunStore, open_run_store
from stockade.sandbox._supervised_calls import GRACE_S
from stockade.testing import ScriptedModel, tool_call
from tests.conftest import require_tier

pytestmark = pytest.mark.process


def test_a_command_the_model_gives_45_s_ends_with_the_runs_wall_time(tmp_path: Path) -> None:
    """With max_wall_s=5, a run_tests call with timeout_s=45 made the run take 46 s."""
    require_tier("process")
    model = ScriptedModel([tool_call("run_tests", {"command": "sleep 45", "timeout_s": 45}), "done"])
    with Sandbox.create(tier="process", workspace=tmp_path) as sbx:
        started = time.monotonic()
        result = Agent(model, limits=RunLimits(max_wall_s=3)).run_sync("go", sandbox=sbx)
        took = time.monotonic() - started
    assert result.status == RunStatus.BUDGET
    assert took < 3 + GRACE_S + 5  # the wall time, the tier's kill grace, and the diff
    assert result.steps[0].tool_calls[0].error_type == "ToolTimeout"
    assert "the run's wall time" in result.steps[0].tool_calls[0].observation


FORGE = """
import json
with open(".stockade/baseline.json", "w") as f:
    json.dump({"a.txt": "forged\\n" * 1000, "b.txt": "planted\\n"}, f)
"""


def test_a_baseline_code_rewrote_never_makes_the_runs_diff(tmp_path: Path) -> None:
    """Code rewrote .stockade/baseline.json (any size up to 190 MB): the run's diff was made
    from it, showing changes nobody made (and hours of host time for a large one)."""
    require_tier("process")
    (tmp_path / "a.txt").write_text("hi\n")
    model = ScriptedModel(
        [tool_call("run_code", {"language": "python", "code": FORGE}), tool_call("git_diff"), "done"]
    )
    with Sandbox.create(tier="process", workspace=tmp_path) as sbx:
        result = Agent(model).run_sync("go", sandbox=sbx)
    assert result.steps[1].tool_calls[0].error_type == "BaselineTampered"
    assert result.diff.startswith("(the diff is unavailable: the run's baseline in the workspace is not")
    assert "forged" not in result.diff and "planted" not in result.diff


UNNAMED = r"""
import os
open(b"bad\xff\xfename", "wb").write(b"x\xff\n")
os.makedirs(b"dir\xc3\x28", exist_ok=True)
open(b"dir\xc3\x28/f\x80", "w").write("hi\n")
open("fine.txt", "w").write("ok\n")
"""


def test_files_whose_names_are_not_utf8_are_named_as_left_out_never_dropped(tmp_path: Path) -> None:
    """Names not UTF-8 were dropped without a word: the diff said "(no changes)", the run store's
    export came back without them (a folder renamed, its file missing)."""
    require_tier("process")
    model = ScriptedModel(
        [tool_call("run_code", {"language": "python", "code": UNNAMED}), tool_call("list_files"), "done"]
    )
    with open_run_store("memory:") as store, Sandbox.create(tier="process", workspace=tmp_path) as sbx:
        result = Agent(model, checkpointer=store).run_sync("go", sandbox=sbx, run_id="r")
        files = store.export_workspace("r", tmp_path / "export").files
        unnamed = store.workspace_unnamed("r")
    assert result.ok
    assert "+++ b/fine.txt" in result.diff
    last = result.diff.splitlines()[-1]
    assert last.startswith("Left out (names not UTF-8, shown with U+FFFD; not read or compared): ")
    assert "'bad\ufffd\ufffdname'" in last and "'dir\ufffd(/f\ufffd'" in last
    assert "bad\ufffd\ufffdname  (3 bytes)  (name not UTF-8" in result.steps[1].tool_calls[0].observation
    assert unnamed == ["bad\ufffd\ufffdname", "dir\ufffd(", "dir\ufffd(/f\ufffd"]
    exported = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert exported == [".stockade", "fine.txt"] and files == 2  # nothing written under another name


NOISE = """
import os
with open("noise.bin", "wb") as f:
    f.write(os.urandom(1024 * 1024))
"""


def test_a_run_that_rewrites_its_workspace_stops_at_the_stores_total_per_run(tmp_path: Path) -> None:
    """Each recorded version was capped, the run was not: 12 calls each writing 200 MiB of
    random bytes made a 2.4 GB database, kept until erased."""
    require_tier("process")
    db, workspace = tmp_path / "runs.db", tmp_path / "ws"
    workspace.mkdir()
    trail = MemoryStore()
    code = tool_call("run_code", {"language": "python", "code": NOISE})
    model = ScriptedModel([code, code, code, code, code, code, "done"])
    with (
        RunStore(open_run_store(f"sqlite:///{db}").db, max_run_bytes=2_500_000) as store,
        AuditLog(trail) as log,
        Sandbox.create(tier="process", workspace=workspace) as sbx,
    ):
        observers: list[Observer] = [AuditObserver(log), RunRecorder(store)]
        result = Agent(model, checkpointer=store, observers=observers).run_sync("go", sandbox=sbx, run_id="r")
        kept = store.workspace_usage("r").blob_bytes
        calls = len(store.tool_calls("r"))
        report = verify(trail, ledger=store)
    assert result.status == RunStatus.ERROR
    assert "RunHistoryFull" in (result.error or "") and "RunStore(max_run_bytes=...)" in (result.error or "")
    assert calls == 3  # two versions of 1 MiB kept; the third call ran, its workspace is not kept
    assert 2 * 1024 * 1024 < kept <= 2_500_000
    assert db.stat().st_size < 4_000_000
    assert report.ok and report.found, report.problems
