"""Masks bound by folder: one bind of a masked copy hides several programs, as their own binds did."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from stockade import exceptions as exc
from stockade.sandbox import _rules_binds, _rules_copies


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


def cache_in(
    folder: Path, *in_use: Path, copies: int = _rules_copies.MASKED_COPIES_MAX
) -> _rules_copies.MaskCache:
    """A cache in ``folder`` whose live sandboxes bind ``in_use``."""
    return _rules_copies.MaskCache(folder, lambda: {str(p) for p in in_use}, copies=copies)


def test_several_masks_in_a_folder_are_one_bind_of_a_masked_copy(folder: Path, tmp_path: Path) -> None:
    cache = cache_in(tmp_path / "cache")
    binds = _rules_binds.mask_binds(tmp_path, ["/usr/bin/curl", "/usr/bin/wget"], cache)
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
    assert _rules_binds.mask_binds(tmp_path, ["/usr/bin/curl", "/usr/bin/wget"], cache) == binds  # made once


def test_a_changed_folder_gets_a_new_copy(folder: Path, tmp_path: Path) -> None:
    cache = cache_in(tmp_path / "cache")
    first = _rules_binds.mask_binds(tmp_path, ["/usr/bin/curl", "/usr/bin/wget"], cache)
    (folder / "new-program").write_bytes(b"new")
    os.utime(folder, ns=(1, 1))  # what an added program does to its folder's time, made certain
    second = _rules_binds.mask_binds(tmp_path, ["/usr/bin/curl", "/usr/bin/wget"], cache)
    assert first != second
    assert (Path(second[0][0]) / "new-program").exists()


def test_without_a_copy_each_program_is_covered_by_dev_null(folder: Path, tmp_path: Path) -> None:
    masks = ["/usr/bin/curl", "/usr/bin/wget"]
    expected = [("/dev/null", "/usr/bin/curl"), ("/dev/null", "/usr/bin/wget")]
    assert _rules_binds.mask_binds(tmp_path, masks, None) == expected  # no cache (not root)
    os.mkfifo(folder / "fifo")  # a special file cannot be linked: no copy
    assert _rules_binds.mask_binds(tmp_path, masks, cache_in(tmp_path / "cache")) == expected
    alone = _rules_binds.mask_binds(tmp_path, ["/usr/bin/curl"], cache_in(tmp_path / "cache"))
    assert alone == [("/dev/null", "/usr/bin/curl")]  # one mask: its own bind costs the same


def test_copies_unused_for_a_week_go_unless_a_live_sandbox_binds_them(folder: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    old, listed, recent = (
        Path(_rules_copies.masked_folder(folder, frozenset(names), cache_in(cache)) or pytest.fail("no copy"))
        for names in ({"curl", "wget"}, {"curl", "ls"}, {"wget", "ls"})
    )
    partial = cache / ".masked-crashed"
    partial.mkdir()
    week_ago = time.time() - _rules_copies.MASKED_UNUSED_S - 60
    for copy in (old, listed, partial):
        os.utime(copy, (week_ago, week_ago))
    removed = _rules_copies.collect_masked(cache, {str(listed)})
    assert sorted(removed) == sorted(f"masked copy {p.name}" for p in (old, partial))
    assert not old.exists() and not partial.exists()
    assert listed.is_dir() and recent.is_dir()  # a live sandbox binds one; the other was used lately
    again = _rules_copies.masked_folder(folder, frozenset({"curl", "ls"}), cache_in(cache))
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
    binds = _rules_binds.mask_binds(tmp_path, masks, cache_in(tmp_path / "cache"))
    assert [inside for _, inside in binds] == ["/usr/bin"]
    copy = Path(binds[0][0])
    assert os.stat(copy / "methods" / "http").st_size == 0
    assert os.stat(copy / "methods" / "README").st_ino == os.stat(methods / "README").st_ino
    (methods / "new").write_bytes(b"new")
    os.utime(methods, ns=(1, 1))  # a folder beneath changed: a new copy
    again = _rules_binds.mask_binds(tmp_path, masks, cache_in(tmp_path / "cache"))
    assert again != binds and (Path(again[0][0]) / "methods" / "new").exists()


def copy_of(folder: Path, names: set[str], cache: _rules_copies.MaskCache) -> Path:
    return _rules_copies.masked_folder(folder, frozenset(names), cache) or pytest.fail("no copy")


def unused_for(seconds: float, *copies: Path) -> None:
    then = time.time() - seconds
    for copy in copies:
        os.utime(copy, (then, then))


def test_past_its_budget_the_cache_removes_the_copy_least_lately_used(folder: Path, tmp_path: Path) -> None:
    # each distinct set of masks is a copy: many policies grew the cache without end
    cache = cache_in(tmp_path / "cache", copies=2)
    older, newer = copy_of(folder, {"curl", "wget"}, cache), copy_of(folder, {"curl", "ls"}, cache)
    unused_for(_rules_copies.EVICTABLE_IDLE_S + 120, older)
    unused_for(_rules_copies.EVICTABLE_IDLE_S + 60, newer)
    third = copy_of(folder, {"wget", "ls"}, cache)
    assert not older.exists() and newer.is_dir() and third.is_dir()
    assert sorted(p.name for p in cache.folder.glob("masked-*")) == sorted([newer.name, third.name])
    assert copy_of(folder, {"curl", "wget"}, cache) not in (newer, third)  # built again, another gone


def test_the_budget_never_removes_a_copy_a_live_sandbox_binds(folder: Path, tmp_path: Path) -> None:
    first = copy_of(folder, {"curl", "wget"}, cache_in(tmp_path / "cache"))
    second = copy_of(folder, {"curl", "ls"}, cache_in(tmp_path / "cache"))
    unused_for(_rules_copies.EVICTABLE_IDLE_S + 120, first)
    unused_for(_rules_copies.EVICTABLE_IDLE_S + 60, second)
    cache = cache_in(tmp_path / "cache", first, copies=2)  # the older one is bound: the other goes
    third = copy_of(folder, {"wget", "ls"}, cache)
    assert first.is_dir() and not second.exists() and third.is_dir()


def test_a_full_cache_of_copies_in_use_or_used_lately_binds_each_program(
    folder: Path, tmp_path: Path
) -> None:
    bound = copy_of(folder, {"curl", "wget"}, cache_in(tmp_path / "cache"))
    lately = copy_of(folder, {"curl", "ls"}, cache_in(tmp_path / "cache"))
    unused_for(_rules_copies.EVICTABLE_IDLE_S + 60, bound)
    unused_for(_rules_copies.TOUCH_EVERY_S - 60, lately)  # a use within the hour may not have touched it
    cache = cache_in(tmp_path / "cache", bound, copies=2)
    binds = _rules_binds.mask_binds(tmp_path, ["/usr/bin/ls", "/usr/bin/wget"], cache)
    assert binds == [("/dev/null", "/usr/bin/ls"), ("/dev/null", "/usr/bin/wget")]  # no copy, no growth
    assert sorted(cache.folder.glob("masked-*")) == sorted([bound, lately])


def test_the_budget_counts_entries_too(folder: Path, tmp_path: Path) -> None:
    # 5 entries a copy (curl, wget, ls, privileged, curl-alias): room for one
    cache = _rules_copies.MaskCache(tmp_path / "cache", set, entries=9)
    first = copy_of(folder, {"curl", "wget"}, cache)
    assert _rules_copies.masked_folder(folder, frozenset({"curl", "ls"}), cache) is None
    unused_for(_rules_copies.EVICTABLE_IDLE_S + 60, first)
    assert copy_of(folder, {"curl", "ls"}, cache) != first and not first.exists()


def test_privileged_programs_are_one_stripped_copy_every_masked_copy_links(
    folder: Path, tmp_path: Path
) -> None:
    # a copy of each in every masked copy cost a host's /usr/bin ~1 MB a copy
    cache = cache_in(tmp_path / "cache")
    first, second = copy_of(folder, {"curl", "wget"}, cache), copy_of(folder, {"curl", "ls"}, cache)
    privileged = os.stat(first / "privileged")
    assert privileged.st_ino == os.stat(second / "privileged").st_ino != os.stat(folder / "privileged").st_ino
    assert stat.S_IMODE(privileged.st_mode) == 0o755  # runnable, without its setuid bit
    assert (first / "privileged").read_bytes() == b"\x7fELF privileged"
    unused_for(_rules_copies.MASKED_UNUSED_S + 60, first, second, *cache.folder.glob("stripped-*"))
    _rules_copies.collect_masked(cache.folder, set())
    assert list(cache.folder.iterdir()) == []  # the stripped program goes with the last copy linking it


def test_the_processs_memory_of_copies_is_bounded_as_the_cache_is(folder: Path, tmp_path: Path) -> None:
    cache = cache_in(tmp_path / "cache", copies=_rules_copies.MASKED_COPIES_MAX + 10)
    for i in range(_rules_copies.MASKED_COPIES_MAX + 5):
        copy_of(folder, {"curl", f"absent-{i}"}, cache)
    assert len(_rules_copies._masked) == _rules_copies.MASKED_COPIES_MAX


# -- gVisor: its kernel ignores masked paths, and runsc starts with few binds ----------------

COVER = "/state/unreadable"  # what gVisor binds over one program: an empty file only root reads


def many_programs(folder: Path, count: int) -> list[str]:
    for i in range(count):
        (folder / f"p{i}").write_bytes(b"\x7fELF")
    return [f"/usr/bin/p{i}" for i in range(count)]


def test_on_gvisor_a_few_masks_are_each_one_bind(folder: Path, tmp_path: Path) -> None:
    # as before: a memory snapshot restores these binds
    binds = _rules_binds.own_kernel_binds(
        tmp_path, ["/usr/bin/curl", "/usr/bin/wget"], COVER, cache_in(tmp_path / "c")
    )
    assert binds == [(COVER, "/usr/bin/curl"), (COVER, "/usr/bin/wget")]


def test_on_gvisor_many_masks_are_their_folders_masked_copies(folder: Path, tmp_path: Path) -> None:
    # an allowlist masks ~300 programs: one bind each failed runsc's start
    masks = many_programs(folder, _rules_binds.OWN_KERNEL_FILE_BINDS + 1)
    binds = _rules_binds.own_kernel_binds(tmp_path, masks, COVER, cache_in(tmp_path / "cache"))
    assert [inside for _, inside in binds] == ["/usr/bin"]
    assert os.stat(Path(binds[0][0]) / "p0").st_size == 0 and (Path(binds[0][0]) / "ls").exists()


def test_on_gvisor_many_masks_no_copy_can_hold_are_refused_with_a_fix(folder: Path, tmp_path: Path) -> None:
    masks = many_programs(folder, _rules_binds.OWN_KERNEL_FILE_BINDS + 1)
    for root in (tmp_path, None):  # no cache (not root), or no image's files on this host
        with pytest.raises(exc.LimitNotEnforceable) as refused:
            _rules_binds.own_kernel_binds(root, masks, COVER, None)
        assert "gVisor" in str(refused.value) and "root" in refused.value.fix


def test_the_copies_any_tiers_live_sandbox_lists_are_in_use(tmp_path: Path) -> None:
    for rundir, copy in (("sbx-a", "masked-1"), ("ctr-sbx-b", "masked-2"), ("gv-sbx-c", "masked-3")):
        (tmp_path / rundir).mkdir()
        (tmp_path / rundir / _rules_copies.MASKS_FILE).write_text(f"/cache/{copy}\n")
    assert _rules_copies.masks_in_use(tmp_path) == {"/cache/masked-1", "/cache/masked-2", "/cache/masked-3"}
