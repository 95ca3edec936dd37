"""``files.upload_dir`` and ``Sandbox.create(workspace=...)`` on every tier: a folder goes in
as a tar stream made and unpacked a chunk at a time, all or nothing."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from stockade import Limits, Sandbox, StockadeError, WorkspaceFull
from tests.conftest import require

MiB = 1024 * 1024
# 128 MiB of memory, of which the workspace may take 80 (its files are memory too; so are
# their inodes, up to 3 KiB each: few of them, and a small /tmp, keep within three quarters).
SMALL = Limits(memory_mb=128, disk_mb=80, tmp_mb=4, inodes=1024, timeout_s=60, pids=64)


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


def test_read_only_folders_upload_with_their_modes(tier: str, tmp_path: Path) -> None:
    # A folder the archive makes read-only (0555) is moved into place with the rest: moving
    # a folder to another parent writes its `..`, which its mode forbade (EACCES, and the
    # folders before it stayed in place while those after it never came).
    folder = tmp_path / "up"
    for name in ("a/f1", "m/sub/x", "z/y"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(name)
    (folder / "m" / "sub").chmod(0o555)
    (folder / "m").chmod(0o555)
    try:
        with Sandbox.create(tier, limits=SMALL) as sbx:
            sbx.files.upload_dir(folder, "r")
            shown = sbx.commands.run("stat -c '%n %a' r/m r/m/sub; cat r/a/f1 r/m/sub/x r/z/y").stdout
            assert shown.split("\n") == ["r/m 555", "r/m/sub 555", "a/f1m/sub/xz/y"], shown
    finally:
        (folder / "m").chmod(0o755)
        (folder / "m" / "sub").chmod(0o755)


def test_an_upload_that_fails_as_it_moves_into_place_changes_nothing(tier: str, tmp_path: Path) -> None:
    # The workspace holds r/a/f1 and a folder r/m the code made read-only; the upload brings
    # a/f1 (new), a/f2, m/x and z/y. Its staged entries move in one by one: a/, then z/, then
    # m/x, refused by r/m's mode (not to root, as a microVM's guest is: there it all lands).
    # A failure takes back every move before it: nothing of the upload stays, nothing it
    # replaced is lost.
    folder = tmp_path / "up"
    for name, text in (("a/f1", "new"), ("a/f2", "new2"), ("m/x", "x"), ("z/y", "y")):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    with Sandbox.create(tier, limits=SMALL) as sbx:
        assert sbx.commands.run("mkdir -p r/a r/m && echo -n old > r/a/f1 && chmod 555 r/m").exit_code == 0
        before = sbx.commands.run("find r | sort; cat r/a/f1").stdout
        if sbx.commands.run("id -u").stdout.strip() == "0":  # root writes in any folder: it lands
            sbx.files.upload_dir(folder, "r")
            assert sbx.files.read("r/a/f1") == "new" and sbx.files.read("r/m/x") == "x"
            return
        with pytest.raises(StockadeError, match="Permission denied"):
            sbx.files.upload_dir(folder, "r")
        assert sbx.commands.run("find r | sort; cat r/a/f1").stdout == before  # as it was
        assert sbx.commands.run("ls -A r").stdout.split() == ["a", "m"]  # no staging left either


def test_fifos_and_device_nodes_in_an_upload_are_left_out(tier: str, tmp_path: Path) -> None:
    # A device node in the folder (a copied /dev, a container's rootfs) made every unpacking
    # fail with "put_archive '': Operation not permitted", a FIFO with a refusal of Python's
    # tar filter: the whole upload, and an MCP session seeded from such a workspace. They are
    # no workspace content (a run's seed leaves them out): left out, as sockets are.
    require("root, to make a device node", os.geteuid() == 0)
    folder = tmp_path / "up"
    (folder / "dev").mkdir(parents=True)
    os.mknod(folder / "dev" / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mkfifo(folder / "dev" / "pipe")
    (folder / "dev" / "kept.txt").write_text("kept")
    with Sandbox.create(tier, limits=SMALL, workspace=folder) as sbx:
        assert sbx.commands.run("ls -A dev").stdout.split() == ["kept.txt"]
        sbx.files.upload_dir(folder, "again")
        assert sbx.commands.run("ls -A again/dev").stdout.split() == ["kept.txt"]
