"""What `stockade gc --snapshot-dir` and a store's collection may remove: a store is known by
its mark, never by its folders' names, and in it only the names the store writes go. Given a
parent folder, gc once deleted a project's tmp/ and objects/ files, and followed a link out."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from stockade import SnapshotKind, SnapshotStore
from stockade.sandbox._gc import snapshot_stores
from stockade.sandbox._snapshot_files import MARKER

DAYS_AGO = time.time() - 2 * 86400


def _files(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if not path.is_dir())


def _old(*paths: Path) -> None:
    for path in paths:
        os.utime(path, (DAYS_AGO, DAYS_AGO), follow_symlinks=False)


def _keep(store: SnapshotStore, data: bytes) -> str:
    """An object a kept snapshot uses: what a collection leaves."""
    digest = store.add_bytes(data)
    store.save(
        kind=SnapshotKind.FILES,
        tier="process",
        source="sbx-1",
        spec={},
        blobs={"w": digest},
        ref=("kept", ""),
    )
    return digest


def _orphan(store: SnapshotStore) -> Path:
    """An object no snapshot uses, written days ago: what a collection removes."""
    path = store.object_path(store.add_bytes(os.urandom(64)))
    _old(path)
    return path


def _project(root: Path) -> Path:
    """A folder that holds a tmp/ and an objects/ of its own, written days ago."""
    (root / "tmp" / "build").mkdir(parents=True)
    (root / "objects").mkdir()
    (root / "src").mkdir()
    (root / "tmp" / "notes.txt").write_text("data")
    (root / "tmp" / "build" / "out.o").write_text("data")
    (root / "objects" / "abc123").write_text("data")
    (root / "src" / "main.c").write_text("src")
    _old(root / "tmp" / "notes.txt", root / "tmp" / "build", root / "objects" / "abc123")
    return root


def test_a_folder_holding_a_tmp_and_objects_is_no_store_and_keeps_every_file(tmp_path: Path) -> None:
    project = _project(tmp_path / "projA")
    before = _files(tmp_path)
    assert snapshot_stores(tmp_path) == [] and snapshot_stores(project) == []
    assert SnapshotStore(project).collect(grace_s=0) == []  # asked directly: no mark, no proof
    assert _files(tmp_path) == before and not (project / MARKER).exists()


def test_a_store_reached_through_a_link_is_not_one_of_the_folders(tmp_path: Path) -> None:
    service = tmp_path / "svc"
    acme = SnapshotStore(service / "acme")
    _orphan(acme)
    elsewhere = SnapshotStore(tmp_path / "elsewhere")
    theirs = _orphan(elsewhere)
    (service / "tenantX").symlink_to(elsewhere.root)
    assert [store.root for store in snapshot_stores(service)] == [acme.root]
    assert theirs.exists()


def test_a_store_removes_what_nothing_keeps_and_only_names_it_writes(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    orphan = _orphan(store)
    kept = _keep(store, b"kept")
    unfinished = store.temp_path("workspace")
    unfinished.write_bytes(b"half")
    foreign = [
        tmp_path / sub / name for sub, name in (("tmp", "notes.txt"), ("objects", "abc"), ("snapshots", "x"))
    ]
    for path in foreign:
        path.write_text("data")
    (tmp_path / "tmp" / "build").mkdir()
    (tmp_path / "objects" / ("e" * 64)).mkdir()  # a folder where an object goes: skipped, no failure
    _old(unfinished, *foreign, tmp_path / "tmp" / "build", tmp_path / "objects" / ("e" * 64))
    removed = store.collect()
    assert f"snapshot object {orphan.name[:16]}" in removed
    assert f"unfinished snapshot write {unfinished.name}" in removed
    assert not orphan.exists() and not unfinished.exists()
    assert all(path.exists() for path in foreign)
    assert (tmp_path / "tmp" / "build").is_dir() and (tmp_path / "objects" / ("e" * 64)).is_dir()
    assert store.object_path(kept).exists()
    assert [store.root for store in snapshot_stores(tmp_path)] == [tmp_path]


def test_a_store_marks_itself_at_its_first_write(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    store.add_bytes(b"x")
    assert (tmp_path / "store" / MARKER).is_file() and store.recognised()


def test_a_store_an_older_version_made_without_a_mark_is_collected_and_marked(tmp_path: Path) -> None:
    service = tmp_path / "svc"
    old = SnapshotStore(service / "acme")
    orphan = _orphan(old)
    _keep(old, b"kept")
    (old.root / MARKER).unlink()  # as versions before the mark left it
    assert [store.root for store in snapshot_stores(service)] == [old.root]
    assert SnapshotStore(old.root).collect() == [f"snapshot object {orphan.name[:16]}"]  # as gc opens it
    assert (old.root / MARKER).is_file()


def test_an_unmarked_folder_is_no_older_store_unless_its_layout_is_one(tmp_path: Path) -> None:
    """A store of an older version holds only the store's folders, objects named by their
    SHA-256 and manifests that hash to their names: a look-alike is none."""
    made = SnapshotStore(tmp_path / "made")
    made.add_bytes(b"x")
    (made.root / MARKER).unlink()
    (made.root / "notes.txt").write_text("mine")  # something no store writes
    assert not SnapshotStore(made.root).recognised()
    lookalike = tmp_path / "lookalike"
    (lookalike / "snapshots").mkdir(parents=True)
    (lookalike / "snapshots" / ("0" * 64 + ".json")).write_text('{"format": 1, "blobs": {}}')  # not its hash
    assert not SnapshotStore(lookalike).recognised()


def test_a_store_reads_its_mark_once_and_knows_itself_from_then_on(tmp_path: Path) -> None:
    """The mark was looked for at every write and read again at every collection: a store
    that knows its folder is a store keeps knowing (another, opened later, reads it anew)."""
    store = SnapshotStore(tmp_path / "store")
    orphan = _orphan(store)
    assert store.recognised()
    (store.root / MARKER).unlink()
    (store.root / "notes.txt").write_text("mine")  # and no older store's layout either
    assert store.recognised() and not SnapshotStore(store.root).recognised()
    assert store.collect() == [f"snapshot object {orphan.name[:16]}"]


@pytest.mark.parametrize("place", [MARKER, "snapshots/" + "0" * 64 + ".json"])
def test_a_fifo_where_a_store_looks_is_no_store_and_is_not_waited_on(tmp_path: Path, place: str) -> None:
    """The mark and an unmarked store's manifests are opened as regular files only: a FIFO
    there (no writer) would hang gc."""
    (tmp_path / "objects").mkdir()
    (tmp_path / "snapshots").mkdir()
    os.mkfifo(tmp_path / place)
    assert not SnapshotStore(tmp_path).recognised()
