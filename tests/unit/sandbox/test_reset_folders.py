"""What a reset empties (``supervisor/fileops.empty_dir``): everything under a writable place,
whatever modes code left, except the folders a policy's write rules made, which the Landlock
ruleset holds by inode: those are emptied and kept, with the folders on the way to them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.unit.sandbox.supervisor_modules import supervisor_module


def fileops() -> Any:
    return supervisor_module("fileops")


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_reset_empties_everything_but_the_kept_folders_and_keeps_their_inodes(tmp_path: Path) -> None:
    kept = tmp_path / "src" / "deep"
    kept.mkdir(parents=True)
    inodes = {p: p.stat().st_ino for p in (kept, kept.parent)}
    (kept / "f").write_text("x")
    (kept / "sub").mkdir()
    (kept / "sub" / "g").write_text("y")
    (kept.parent / "h").write_text("z")
    (tmp_path / "other" / "more").mkdir(parents=True)
    (tmp_path / "top").write_text("t")
    os.chmod(kept / "sub", 0o000)  # what code may leave: a folder nobody can list
    os.symlink(kept, tmp_path / "link")

    fileops().empty_dir(str(tmp_path), keep=[str(kept)])

    assert tree(tmp_path) == ["src", "src/deep"]
    assert {p: p.stat().st_ino for p in (kept, kept.parent)} == inodes


def test_without_kept_folders_a_reset_empties_it_all(tmp_path: Path) -> None:
    (tmp_path / "src" / "deep").mkdir(parents=True)
    (tmp_path / "src" / "deep" / "f").write_text("x")
    fileops().empty_dir(str(tmp_path), keep=[str(tmp_path.parent / "elsewhere")])
    assert tree(tmp_path) == []
