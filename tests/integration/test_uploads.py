"""``files.upload_dir`` and ``Sandbox.create(workspace=...)`` on every tier: a folder goes in
as a tar stream made and unpacked a chunk at a time, all or nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from stockade import Limits, Sandbox, WorkspaceFull

MiB = 1024 * 1024
# 128 MiB of memory, of which the workspace may take 80 (its files are memory too).
SMALL = Limits(memory_mb=128, disk_mb=80, tmp_mb=8, timeout_s=60, pids=64)


def sparse(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_a_folder_of_most_of_the_memory_seeds_the_workspace(tier: str, tmp_path: Path) -> None:
    # A 76 MiB file (60% of the memory) into a 128 MiB sandbox, as files.write sends one.
    # Sent as one archive frame, the supervisor held it (and more) beside the workspace's
    # copy, and the sandbox died (SandboxCrashed, out of memory) on every tier.
    seed = tmp_path / "seed"
    sparse(seed / "data" / "big.bin", 76 * MiB)
    (seed / "README").write_text("seeded")
    with Sandbox.create(tier, limits=SMALL, workspace=seed) as sbx:
        listed = sbx.commands.run("stat -c %s data/big.bin; cat README").stdout.split()
        assert listed == [str(76 * MiB), "seeded"]
        sbx.files.upload_dir(seed, "into/a/new/folder", hide=["data/**"])  # made on the way
        assert sbx.files.read("into/a/new/folder/README") == "seeded"
        assert not sbx.files.exists("into/a/new/folder/data/big.bin")


def test_an_upload_that_does_not_fit_leaves_nothing(tier: str, tmp_path: Path) -> None:
    # The first file fits, the second not: neither is there afterwards, nor the folder made
    # for them, and the sandbox goes on.
    folder = tmp_path / "up"
    (folder / "a-first.txt").parent.mkdir(parents=True)
    (folder / "a-first.txt").write_text("first")
    sparse(folder / "b-second.bin", 100 * MiB)
    with Sandbox.create(tier, limits=SMALL) as sbx:
        with pytest.raises(WorkspaceFull):
            sbx.files.upload_dir(folder, "new/place")
        assert sbx.commands.run("ls -A").stdout == ""
        sbx.files.write("after.txt", "after")
        assert sbx.files.read("after.txt") == "after"
