"""What a run keeps of its sandbox, in a real snapshot store (no sandbox needed: the
snapshots are written as a tier writes them)."""

from __future__ import annotations

from pathlib import Path

from stockade.runs.snapshots import RunSnapshots, erase_run_snapshots, ref_name
from stockade.sandbox.snapshots import SnapshotStore
from stockade.types import Limits, NetworkPolicy, Snapshot, SnapshotKind


def kept(store: SnapshotStore, run_id: str, kind: SnapshotKind, content: bytes) -> Snapshot:
    digest = store.add_bytes(content)
    return store.save(
        kind=kind,
        tier="microvm",
        source="sbx-1",
        spec={},
        blobs={"memory": digest},
        ref=("run", ref_name(run_id)),
    )


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
    assert store.ref("run", ref_name(odd)) is None and store.ref("run", "run-2") == {"snapshot": stays.id}
    assert [p.name for p in (store.root / "objects").iterdir()] == list(store.load(stays).blobs.values())
    assert gone.id not in {s.id for s in store.snapshots()}
