"""Agent runs that resume with their sandbox: a run that pauses for an approval keeps a
snapshot of it, another process resumes the run from it (the microVM: the interpreter's
variables; every tier: the workspace and /tmp, which the run store alone does not keep), and
the snapshot goes when the run ends or is erased. An interrupted run (its sandbox killed)
resumes from the snapshot taken after its last call, when the run keeps one per call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stockade.audit import SQLiteStore, verify
from stockade.audit.events import EventKind
from stockade.cli.main import app
from stockade.policy import ApprovalStore, Choice
from stockade.runs.snapshots import RunSnapshots, ref_name
from stockade.sandbox.facade import Sandbox
from stockade.sandbox.snapshots import SnapshotStore
from stockade.types import SnapshotKind
from tests.conftest import require_tier
from tests.integration.conftest import TIERS

ROOT = Path(__file__).parents[2]
CHILD = Path(__file__).with_name("kept_child.py")
RUN_ID = "kept-run"  # the child's
# The process tier keeps files; the microVM keeps memory too (gVisor's memory: branch of its own).
KEPT_TIERS = [t for t in ("process", "microvm") if t in TIERS]


def child(mode: str, scenario: str, tier: str, work: Path, *extra: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    argv = [sys.executable, str(CHILD), mode, scenario, tier, str(work), *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def approve(work: Path) -> None:
    approvals = ApprovalStore(work / "approvals")
    (request,) = approvals.pending(RUN_ID)
    approvals.decide(RUN_ID, request["id"], Choice.APPROVED, by="alice")


def observations(report: dict[str, object]) -> list[str]:
    value = report["observations"]
    assert isinstance(value, list)
    return [str(v) for v in value]


@pytest.mark.parametrize("tier", KEPT_TIERS)
def test_a_run_paused_for_approval_resumes_in_another_process_with_its_sandbox(
    tier: str, tmp_path: Path
) -> None:
    require_tier(tier)
    store = SnapshotStore(tmp_path / "snapshots")
    paused = child("start", "approval", tier, tmp_path)
    assert paused["status"] == "paused", paused
    kept = store.get(str(paused["snapshot"]))
    assert kept.kind is (SnapshotKind.MEMORY if tier == "microvm" else SnapshotKind.FILES)
    assert store.ref("run", RUN_ID) == {"snapshot": kept.id, "run": RUN_ID}
    objects = set(store.load(kept).blobs.values())

    approve(tmp_path)
    done = child("resume", "approval", tier, tmp_path)
    assert done["status"] == "success" and done["snapshot"] is None, done
    seen = observations(done)
    # the variable the first call defined: the microVM goes on in its interpreter; the process
    # tier keeps files only, so its new interpreter never had it
    assert ("42" in seen[2]) is (tier == "microvm"), seen[2]
    assert "NameError" in seen[2] or tier == "microvm"
    assert "tmp kept" in seen[3] and "notes kept" in seen[3], seen[3]  # /tmp: from the snapshot

    # the run ended: what it kept is gone, objects included
    assert store.ref("run", RUN_ID) is None
    assert not any(store.object_path(d).exists() for d in objects)
    audit = SQLiteStore(tmp_path / "audit.db")
    try:
        events = list(audit.events(run_id=RUN_ID))
        taken = [e for e in events if e.kind == EventKind.SNAPSHOT_TAKE]
        restored = [e for e in events if e.kind == EventKind.SNAPSHOT_RESTORE]
        assert [e.attributes["snapshot_id"] for e in restored] == [kept.id]
        assert kept.id in {e.attributes.get("snapshot_id") for e in taken}
        assert verify(audit).ok
    finally:
        audit.close()


@pytest.mark.parametrize("tier", KEPT_TIERS)
def test_an_interrupted_run_resumes_from_its_last_calls_sandbox(tier: str, tmp_path: Path) -> None:
    """Its sandbox died with the interruption: what it resumes from was kept after the call
    before (``keep_sandbox_each_call``): the variable on the microVM, /tmp on every tier."""
    require_tier(tier)
    store = SnapshotStore(tmp_path / "snapshots")
    stopped = child("start", "interrupt", tier, tmp_path, "each-call")
    assert stopped["status"] == "interrupted", stopped
    kept = store.get(str(stopped["snapshot"]))
    assert store.ref("run", RUN_ID) == {"snapshot": kept.id, "run": RUN_ID}
    assert len(store.refs("run")) == 1 and not store.refs("kept")  # one per run, replaced per call

    done = child("resume", "interrupt", tier, tmp_path, "each-call")
    assert done["status"] == "success", done
    seen = observations(done)
    assert "OutcomeUnknown" in seen[1]  # the sleep was cut short, and is not run again
    assert ("42" in seen[2]) is (tier == "microvm"), seen[2]
    assert "tmp kept" in seen[3] and "notes kept" in seen[3], seen[3]
    assert store.refs("run") == [] and os.listdir(store.root / "objects") == []


def test_erasing_a_paused_run_removes_the_sandbox_it_kept(tmp_path: Path) -> None:
    require_tier("process")
    store = SnapshotStore(tmp_path / "snapshots")
    paused = child("start", "approval", "process", tmp_path)
    kept = store.get(str(paused["snapshot"]))
    objects = set(store.load(kept).blobs.values())
    db = str(tmp_path / "audit.db")
    erased = CliRunner().invoke(app, ["runs", "erase", RUN_ID, "--db", db, "--snapshot-dir", str(store.root)])
    assert erased.exit_code == 0 and "with the 1 sandbox snapshot(s) they kept" in erased.output, (
        erased.output
    )
    assert store.ref("run", RUN_ID) is None and store.snapshots() == []
    assert not any(store.object_path(d).exists() for d in objects)


def test_a_run_named_like_another_runs_hashed_ref_keeps_only_its_own_sandbox(tmp_path: Path) -> None:
    """Run ``job:2`` cannot name a file: its ref is its id's hash. A run whose id is that hashed
    name keeps its sandbox apart: each gets its own back, and one ending leaves the other's."""
    require_tier("process")
    runs = RunSnapshots(SnapshotStore(tmp_path / "snapshots"))
    first, second = "job:2", ref_name("job:2")
    for run_id in (first, second):
        with Sandbox.create(tier="process") as sbx:
            sbx.files.write("whose", run_id)
            assert runs.keep(run_id, sbx) is not None
    for run_id in (first, second):
        kept = runs.kept(run_id)
        assert kept is not None
        with Sandbox.create(tier="process", snapshot=kept, store=runs.store) as sbx:
            assert sbx.files.read("whose") == run_id

    runs.release(first)
    assert runs.kept(first) is None and runs.kept(second) is not None
