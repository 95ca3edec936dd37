"""The service's scratch folders (a run's seed, uploads, downloads) hold a tenant's files: one
whose process was killed (SIGKILL, the OOM killer) is removed by gc, one in use is kept."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import stockade.server
from stockade.server.scratch import OLD_AGE_S, collect, scratch

HOLDER = """
import sys, time
from pathlib import Path
from stockade.server.scratch import scratch
with scratch("run", Path(sys.argv[1])) as folder:
    (folder / "workspace").mkdir()
    (folder / "workspace" / "secret.txt").write_text("a tenant's file")
    print(folder, flush=True)
    time.sleep(120)
"""


def test_a_killed_workers_seed_is_removed_by_gc_and_a_live_ones_is_kept(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        folder = Path(holder.stdout.readline().strip())
        assert (folder / "workspace" / "secret.txt").exists()

        assert collect(tmp_path) == []
        assert folder.exists()
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()

    assert collect(tmp_path) == [f"service scratch folder {folder.name}"]
    assert not folder.exists()


def test_a_scratch_folder_goes_when_its_block_ends(tmp_path: Path) -> None:
    with scratch("upload", tmp_path) as folder:
        (folder / "in").mkdir()
        assert folder.parent == tmp_path
        assert collect(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_gc_leaves_alone_what_is_not_an_abandoned_scratch_folder(tmp_path: Path) -> None:
    look_alike = tmp_path / "stockade-run-0123456789abcdef"  # no claim: not made by scratch()
    look_alike.mkdir()
    other = tmp_path / "stockade-run-mine"
    other.mkdir()
    (other / "claim").touch()
    link = tmp_path / "stockade-download-fedcba9876543210"
    os.symlink(other, link)

    assert collect(tmp_path) == []
    assert look_alike.exists() and other.exists() and link.is_symlink()


def test_every_scratch_folder_of_the_service_is_one_gc_can_collect() -> None:
    """A bare TemporaryDirectory/mkdtemp outlives a killed worker with a tenant's files in it."""
    package = Path(stockade.server.__file__).parent
    unclaimed = []
    for module in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in {"TemporaryDirectory", "mkdtemp"}:
                unclaimed.append(f"{module.name}:{node.lineno}")
    assert unclaimed == []


def test_a_previous_versions_unclaimed_folder_goes_once_unchanged_for_a_day(tmp_path: Path) -> None:
    """Before the claims, scratch folders were bare TemporaryDirectory ones: nothing says whether
    their process lives, so they go once nothing changed in them for a day."""
    stale = tmp_path / "stockade-run-k3j_9x0a"  # tempfile's name: 8 of [a-z0-9_]
    (stale / "workspace").mkdir(parents=True)
    (stale / "workspace" / "secret.txt").write_text("a tenant's file")
    stale_upload = tmp_path / "stockade-upload-a1b2c3d4"
    stale_upload.mkdir()
    recent = tmp_path / "stockade-download-zz99_aa1"  # maybe a previous version's, still at work
    recent.mkdir()
    link = tmp_path / "stockade-run-linkedto"
    os.symlink(stale, link)
    day_ago = time.time() - OLD_AGE_S - 60
    for old in (stale, stale_upload):
        os.utime(old, (day_ago, day_ago))
    os.utime(link, (day_ago, day_ago), follow_symlinks=False)

    removed = collect(tmp_path)

    assert sorted(removed) == sorted(
        f"service scratch folder {f.name} (a previous version's, unchanged for a day)"
        for f in (stale, stale_upload)
    )
    assert not stale.exists() and not stale_upload.exists()
    assert recent.exists() and link.is_symlink()


def test_a_scratch_folder_with_a_deep_tree_and_locked_folders_goes_whole(tmp_path: Path) -> None:
    """``shutil.rmtree`` recursed: a tar of 1,100 nested folders made a RecursionError that
    left the folder, and its claim held, so gc skipped it while the server ran."""
    with scratch("upload", tmp_path) as folder:
        inner = folder / "in"
        inner.mkdir()
        for _ in range(1_100):
            inner = inner / "a"
            inner.mkdir()
        (inner / "big").write_bytes(b"x" * 4096)
        (folder / "in" / "a").chmod(0o500)  # a mode an archive may carry: no writes in it
        (folder / "in" / "link").symlink_to(tmp_path.parent)  # removed, not followed
    assert list(tmp_path.iterdir()) == []
    assert collect(tmp_path) == []
