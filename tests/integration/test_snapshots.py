"""Snapshots on every tier: pause, exit, resume in another process; fork from one snapshot;
a modified snapshot refused; collection of what nothing keeps.

Files (workspace, /tmp, the environment) survive on every tier; the memory tiers (the
microVM, gVisor without Docker) keep the interpreter's variables and its threads too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stockade import (
    LimitNotEnforceable,
    Limits,
    Sandbox,
    SnapshotCorrupt,
    SnapshotKind,
    SnapshotNotFound,
    SnapshotStore,
)
from tests.conftest import require_tier
from tests.integration.conftest import TIERS

ROOT = Path(__file__).parents[2]
LIMITS = Limits(memory_mb=256, timeout_s=20, pids=64)


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(tmp_path / "snapshots")


def _child(code: str, store: SnapshotStore) -> dict[str, object]:
    """Run ``code`` in a new Python process (it prints one JSON line) and return what it said."""
    program = "import json, sys\nfrom pathlib import Path\nfrom stockade import *\n"
    program += f"store = SnapshotStore(Path({str(store.root)!r}))\n" + textwrap.dedent(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("tier", TIERS)
def test_a_paused_sandbox_resumes_in_another_process_with_its_files(tier: str, store: SnapshotStore) -> None:
    require_tier(tier)
    paused = _child(
        f"""
        sbx = Sandbox.create({tier!r}, envs={{"GREETING": "hi"}}, limits=Limits(memory_mb=256, pids=64))
        sbx.files.write("notes/a.txt", "kept\\n")
        sbx.commands.run("echo scratch > /tmp/t && mkdir -p /tmp/.local/lib && echo pkg > /tmp/.local/lib/p")
        snap = sbx.pause(store=store)
        print(json.dumps({{"id": sbx.id, "alive": sbx.alive, "kind": snap.kind}}))
        """,
        store,
    )
    assert paused["alive"] is False
    with Sandbox.resume(str(paused["id"]), store=store) as sbx:
        assert sbx.id == paused["id"]
        out = sbx.commands.run("cat notes/a.txt /tmp/t /tmp/.local/lib/p; echo $GREETING").stdout
        assert out.split() == ["kept", "scratch", "pkg", "hi"]
    with pytest.raises(SnapshotNotFound):
        Sandbox.resume(str(paused["id"]), store=store)


def test_files_snapshots_fork_and_are_checked(store: SnapshotStore) -> None:
    require_tier("process")
    with Sandbox.create("process", limits=LIMITS) as sbx:
        sbx.files.write("data.txt", "x" * 1000)
        with pytest.raises(LimitNotEnforceable):
            sbx.snapshot(store=store, memory=True)
        snap = sbx.snapshot(store=store)
        assert sbx.alive
    assert snap.kind is SnapshotKind.FILES and snap.tier == "process"
    forks = [Sandbox.create(snapshot=snap.id, store=store) for _ in range(10)]
    try:
        assert len({f.id for f in forks}) == 10
        assert {f.files.read("data.txt") for f in forks} == {"x" * 1000}
        forks[0].files.write("data.txt", "changed")
        assert forks[1].files.read("data.txt") == "x" * 1000
    finally:
        for f in forks:
            f.close()
    # a byte changed in a stored object: refused, nothing started
    manifest = store.load(snap)
    victim = store.object_path(manifest.blobs["workspace"])
    os.chmod(victim, 0o600)
    data = bytearray(victim.read_bytes())
    data[600] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt):
        Sandbox.create(snapshot=snap, store=store)


def test_collection_removes_what_nothing_keeps(store: SnapshotStore) -> None:
    require_tier("process")
    with Sandbox.create("process", limits=LIMITS) as sbx:
        sbx.files.write("a", "1")
        kept = sbx.snapshot(store=store)
        sbx.files.write("a", "2")
        dropped = sbx.snapshot(store=store)
    objects = set(os.listdir(store.root / "objects"))
    store.delete(dropped)
    removed = store.collect(grace_s=0)
    assert any("snapshot object" in r for r in removed)
    left = set(os.listdir(store.root / "objects"))
    assert left < objects and set(store.load(kept).blobs.values()) <= left
    assert [s.id for s in store.snapshots()] == [kept.id]
    with pytest.raises(SnapshotNotFound):
        store.load(dropped)
