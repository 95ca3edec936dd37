"""`stockade snapshots list` over a real snapshot store: what keeps each snapshot, runs included."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stockade.cli.main import app
from stockade.runs.snapshots import ref_name
from stockade.sandbox.snapshots import SnapshotStore
from stockade.types import SnapshotKind

runner = CliRunner()


def _save(store: SnapshotStore, content: bytes, ref: tuple[str, str], tier: str = "process") -> str:
    blobs = {"workspace": store.add_bytes(content)}
    return store.save(
        kind=SnapshotKind.FILES, tier=tier, source="sbx-0123456789ab", spec={}, blobs=blobs, ref=ref
    ).id


def test_the_list_shows_paused_kept_and_runs_snapshots_with_what_holds_them(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "s")
    paused = _save(store, b"paused", ("paused", "sbx-0123456789ab"))
    kept = _save(store, b"kept", ("kept", ""))
    odd = "tenant:run/7"  # no file name: its ref is named by its hash, the run's id is in the ref
    run = _save(store, b"run", ("run", ref_name(odd)), tier="microvm")
    store.set_ref("run", ref_name(odd), run, run=odd)  # as RunSnapshots.keep writes it
    boot = _save(store, b"boot", ("boot", "microvm-shape"), tier="microvm")

    listed = runner.invoke(app, ["snapshots", "list", "--snapshot-dir", str(store.root)])
    assert listed.exit_code == 0, listed.output
    rows = {line.split()[0]: line.strip() for line in listed.output.splitlines()[1:] if line.strip()}
    assert set(rows) == {paused, kept, run}
    assert rows[paused].split()[-4:] == ["paused", "sandbox", "sbx-0123456789ab", "-"]  # "-": no role
    assert rows[kept].split()[-2:] == ["kept", "-"]
    assert rows[run].endswith(f"run {odd}") and " microvm " in rows[run]

    as_json = runner.invoke(app, ["snapshots", "list", "--snapshot-dir", str(store.root), "--boot", "--json"])
    assert as_json.exit_code == 0, as_json.output
    held = {h["id"]: h["held_by"] for h in json.loads(as_json.output)}
    assert held[run] == {"kind": "run", "name": ref_name(odd), "run": odd}
    assert held[boot] == {"kind": "boot", "name": "microvm-shape"}
    assert len(held) == 4


def test_an_empty_store_lists_nothing(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()  # a missing one is refused: see below
    listed = runner.invoke(app, ["snapshots", "list", "--snapshot-dir", str(tmp_path / "empty"), "--json"])
    assert listed.exit_code == 0 and json.loads(listed.output) == []


def test_delete_removes_a_callers_snapshots_and_leaves_a_runs(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "s")
    kept = _save(store, b"kept", ("kept", ""))
    store.set_ref("kept", kept, kept, role="admin")  # as a service's tenant store names its role
    paused = _save(store, b"paused", ("paused", "sbx-0123456789ab"))
    run = _save(store, b"run", ("run", ref_name("r1")))

    listed = runner.invoke(app, ["snapshots", "list", "--snapshot-dir", str(store.root), "--json"])
    roles = {h["id"]: h["held_by"].get("role") for h in json.loads(listed.output)}
    assert roles == {kept: "admin", paused: None, run: None}

    refused = runner.invoke(app, ["snapshots", "delete", "--snapshot-dir", str(store.root), run])
    assert refused.exit_code == 1 and "stockade runs erase" in refused.output
    nothing = runner.invoke(app, ["snapshots", "delete", "--snapshot-dir", str(store.root)])
    assert nothing.exit_code == 2

    where = ["--snapshot-dir", str(store.root)]
    deleted = runner.invoke(app, ["snapshots", "delete", *where, kept, "--no-role"])
    assert deleted.exit_code == 0, deleted.output
    assert {h.snapshot.id for h in store.held()} == {run}


@pytest.mark.parametrize("kind", ["missing", "file", "fifo"])
def test_a_snapshot_dir_that_is_no_store_is_refused_not_listed_empty(tmp_path: Path, kind: str) -> None:
    """A mistyped --snapshot-dir listed an empty table, and `delete --no-role` deleted nothing,
    each exit 0: as if the store held nothing."""
    given = tmp_path / "store"
    if kind == "file":
        given.write_text("")
    elif kind == "fifo":
        os.mkfifo(given)
    said = "does not exist" if kind == "missing" else "is not a folder"
    for argv in (["list"], ["delete", "--no-role"]):
        result = runner.invoke(app, ["snapshots", *argv, "--snapshot-dir", str(given)])
        assert result.exit_code == 2 and said in result.output, result.output
    assert kind != "missing" or not given.exists()
