"""What a run keeps of its sandbox, in a real snapshot store (no sandbox needed: the
snapshots are written as a tier writes them)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from stockade.runs.snapshots import RunSnapshots, erase_run_snapshots, ref_name, release_run_snapshots
from stockade.sandbox.snapshots import SnapshotStore
from stockade.types import Limits, NetworkPolicy, Snapshot, SnapshotKind


def kept(
    store: SnapshotStore, run_id: str, kind: SnapshotKind, content: bytes, *, name: str | None = None
) -> Snapshot:
    """A snapshot kept as ``RunSnapshots.keep`` keeps it: under ``name`` (the run's ref name
    unless told), the ref naming the run."""
    snap = store.save(
        kind=kind, tier="microvm", source="sbx-1", spec={}, blobs={"memory": store.add_bytes(content)}
    )
    store.set_ref("run", name or ref_name(run_id), snap.id, run=run_id)
    return snap


def test_a_memory_snapshot_is_restored_only_into_the_sandbox_the_run_gets_now(tmp_path: Path) -> None:
    runs = RunSnapshots(SnapshotStore(tmp_path / "s"))
    snap = kept(runs.store, "run-1", SnapshotKind.MEMORY, b"ram")

    def restorable(
        tier: str = "microvm", limits: Limits | None = None, network: NetworkPolicy | None = None
    ) -> Snapshot | None:
        return runs.restorable(
            "run-1", tier=tier, limits=limits or Limits(), network=network or NetworkPolicy()
        )

    assert restorable() == snap
    assert restorable(tier="gvisor") is None
    assert restorable(limits=Limits(memory_mb=1024)) is None
    assert restorable(network=NetworkPolicy(allow_hosts=("pypi.org",))) is None
    assert runs.restorable("run-2", tier="microvm", limits=Limits(), network=NetworkPolicy()) is None

    runs.release("run-1")
    assert runs.kept("run-1") is None and list((runs.store.root / "objects").iterdir()) == []


def test_erasing_runs_removes_their_snapshots_and_nothing_else(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "s")
    assert erase_run_snapshots(store, ["run-1"]) == 0 and not store.root.exists()  # not created
    odd = "tenant:run/7"  # no file name: its ref is named by its hash
    assert ref_name(odd) != odd
    gone, stays = (
        kept(store, odd, SnapshotKind.FILES, b"one"),
        kept(store, "run-2", SnapshotKind.FILES, b"two"),
    )
    assert erase_run_snapshots(store, [odd, odd, "run-3"]) == 1
    assert store.ref("run", ref_name(odd)) is None
    assert store.ref("run", "run-2") == {"snapshot": stays.id, "run": "run-2"}
    assert [p.name for p in (store.root / "objects").iterdir()] == list(store.load(stays).blobs.values())
    assert gone.id not in {s.id for s in store.snapshots()}


def test_releasing_ended_runs_sandboxes_never_fails_the_caller(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What the runner and the service call once runs ended: a store that cannot be changed
    leaves the snapshots to the next sweep, said in the log, and the run's end goes on."""
    store = SnapshotStore(tmp_path / "s")
    kept(store, "run-1", SnapshotKind.FILES, b"files")
    (store.root / "reserved").write_text("not the store's folder")  # its lock cannot be taken
    with caplog.at_level(logging.WARNING):
        assert release_run_snapshots(store, ["run-1"]) == 0
    assert "left for the next sweep" in caplog.text
    assert release_run_snapshots(SnapshotStore(tmp_path / "none"), ["run-1"]) == 0


def test_no_run_id_names_another_runs_ref() -> None:
    # an id that matches another id's hashed name is hashed too
    odd = "job:2"
    lookalike = ref_name(odd)
    assert lookalike.startswith("h-") and ref_name(lookalike) not in (lookalike, ref_name(odd))
    assert ref_name("run-1") == "run-1"  # the common ids keep their readable names


def test_a_ref_another_run_wrote_is_never_restored_replaced_or_dropped_for_this_one(tmp_path: Path) -> None:
    runs = RunSnapshots(SnapshotStore(tmp_path / "s"))
    # the ref job:2's name holds is another run's: an earlier version's mapping named the run
    # h-<hash of job:2> (a name as it was) by job:2's hashed name
    other = ref_name("job:2")
    theirs = kept(runs.store, other, SnapshotKind.FILES, b"theirs", name=ref_name("job:2"))
    assert runs.kept("job:2") is None
    runs.release("job:2")
    assert erase_run_snapshots(runs.store, ["job:2"]) == 0
    assert runs.store.ref("run", ref_name("job:2")) == {"snapshot": theirs.id, "run": other}

    # that run still finds it under the name it was kept as, and lets it go
    assert runs.kept(other) == theirs
    runs.release(other)
    assert runs.store.refs("run") == [] and list((runs.store.root / "objects").iterdir()) == []
