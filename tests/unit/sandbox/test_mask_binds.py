"""Masks bound by folder: one bind of a masked copy hides several programs, as their own binds did."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from stockade.sandbox import _rules


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    bin_ = tmp_path / "usr" / "bin"
    bin_.mkdir(parents=True)
    for name in ("curl", "wget", "ls"):
        (bin_ / name).write_bytes(b"\x7fELF " + name.encode())
        os.chmod(bin_ / name, 0o755)
    (bin_ / "privileged").write_bytes(b"\x7fELF privileged")
    os.chmod(bin_ / "privileged", 0o4755)
    os.symlink("curl", bin_ / "curl-alias")
    return bin_


def test_several_masks_in_a_folder_are_one_bind_of_a_masked_copy(folder: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    binds = _rules.mask_binds(tmp_path, ["/usr/bin/curl", "/usr/bin/wget"], cache)
    assert len(binds) == 1
    source, inside = binds[0]
    assert inside == "/usr/bin"
    copy = Path(source)
    for name in ("curl", "wget"):  # empty, and nobody but root may read or run it
        st = os.stat(copy / name)
        assert st.st_size == 0 and stat.S_IMODE(st.st_mode) == 0
    assert os.stat(copy / "ls").st_ino == os.stat(folder / "ls").st_ino  # a link: no data copied
    assert os.readlink(copy / "curl-alias") == "curl"  # leads to the masked file
    privileged = os.stat(copy / "privileged")
    assert privileged.st_ino != os.stat(folder / "privileged").st_ino
    assert stat.S_IMODE(privileged.st_mode) == 0o755  # runnable, without its setuid bit
    assert _rules.mask_binds(tmp_path, ["/usr/bin/curl", "/usr/bin/wget"], cache) == binds  # made once


def test_a_changed_folder_gets_a_new_copy(folder: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _rules.mask_binds(tmp_path, ["/usr/bin/curl", "/usr/bin/wget"], cache)
    (folder / "new-program").write_bytes(b"new")
    os.utime(folder, ns=(1, 1))  # what an added program does to its folder's time, made certain
    second = _rules.mask_binds(tmp_path, ["/usr/bin/curl", "/usr/bin/wget"], cache)
    assert first != second
    assert (Path(second[0][0]) / "new-program").exists()


def test_without_a_copy_each_program_is_covered_by_dev_null(folder: Path, tmp_path: Path) -> None:
    masks = ["/usr/bin/curl", "/usr/bin/wget"]
    expected = [("/dev/null", "/usr/bin/curl"), ("/dev/null", "/usr/bin/wget")]
    assert _rules.mask_binds(tmp_path, masks, None) == expected  # no cache (not root)
    os.mkfifo(folder / "fifo")  # a special file cannot be linked: no copy
    assert _rules.mask_binds(tmp_path, masks, tmp_path / "cache") == expected
    alone = _rules.mask_binds(tmp_path, ["/usr/bin/curl"], tmp_path / "cache")
    assert alone == [("/dev/null", "/usr/bin/curl")]  # one mask: its own bind costs the same


def test_copies_unused_for_a_week_go_unless_a_live_sandbox_binds_them(folder: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    old, listed, recent = (
        Path(_rules.masked_folder(folder, frozenset(names), cache) or pytest.fail("no copy"))
        for names in ({"curl", "wget"}, {"curl", "ls"}, {"wget", "ls"})
    )
    partial = cache / ".masked-crashed"
    partial.mkdir()
    week_ago = time.time() - _rules.MASKED_UNUSED_S - 60
    for copy in (old, listed, partial):
        os.utime(copy, (week_ago, week_ago))
    removed = _rules.collect_masked(cache, {str(listed)})
    assert sorted(removed) == sorted(f"masked copy {p.name}" for p in (old, partial))
    assert not old.exists() and not partial.exists()
    assert listed.is_dir() and recent.is_dir()  # a live sandbox binds one; the other was used lately
    again = _rules.masked_folder(folder, frozenset({"curl", "ls"}), cache)
    assert again == listed and time.time() - listed.stat().st_mtime < 60  # each use touches it


def test_a_folders_tree_is_one_copy_that_masks_what_is_beneath_it_too(folder: Path, tmp_path: Path) -> None:
    # an allowlist masks hundreds of programs, in folders with folders (/usr/lib/systemd,
    # /usr/lib/apt and its methods): a bind each cost a start ~0.3 ms
    methods = folder / "methods"
    methods.mkdir()
    (methods / "http").write_bytes(b"\x7fELF http")
    os.chmod(methods / "http", 0o755)
    (methods / "README").write_text("no program")
    masks = ["/usr/bin/curl", "/usr/bin/methods/http"]
    binds = _rules.mask_binds(tmp_path, masks, tmp_path / "cache")
    assert [inside for _, inside in binds] == ["/usr/bin"]
    copy = Path(binds[0][0])
    assert os.stat(copy / "methods" / "http").st_size == 0
    assert os.stat(copy / "methods" / "README").st_ino == os.stat(methods / "README").st_ino
    (methods / "new").write_bytes(b"new")
    os.utime(methods, ns=(1, 1))  # a folder beneath changed: a new copy
    again = _rules.mask_binds(tmp_path, masks, tmp_path / "cache")
    assert again != binds and (Path(again[0][0]) / "methods" / "new").exists()
