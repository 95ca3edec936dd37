"""What `stockade gc` does with the builds named after a digest of their content in the state
folder (supervisor folders, the process tier's shared folder, the microVM's initramfs): one
set per version of stockade, on tmpfs for root, they stayed until a reboot. A build unused
for a week goes; one used lately, one this process uses, and one a live sandbox may bind
stay, as several versions share the folder."""

from __future__ import annotations

import os
import time
from pathlib import Path

from stockade.sandbox import _builds, _guest

WEEK_AGO = time.time() - _builds.UNUSED_S - 3600


def _build(state: Path, name: str, *, used: float = WEEK_AGO) -> Path:
    path = state / name
    if name.endswith(".cpio"):
        path.write_bytes(b"070701")
    else:
        path.mkdir()
        (path / "supervisor.py").write_text("")
    os.utime(path, (used, used))
    return path


def test_builds_unused_for_a_week_go_and_those_used_lately_stay(tmp_path: Path) -> None:
    old = [
        _build(tmp_path, "supervisor-0123456789abcdef"),
        _build(tmp_path, "shared-0123456789abcdef"),
        _build(tmp_path, "microvm-initrd-0123456789abcdef.cpio"),
    ]
    recent = _build(tmp_path, "shared-fedcba9876543210", used=time.time() - 86400)
    not_ours = _build(tmp_path, "shared-notadigest")
    removed = _builds.collect(tmp_path)
    assert sorted(removed) == sorted(f"build {path.name}" for path in old)
    assert not any(path.exists() for path in old)
    assert recent.is_dir() and not_ours.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared-fedcba9876543210", "shared-notadigest"]


def test_a_use_marks_a_build_at_most_once_an_hour(tmp_path: Path) -> None:
    build = _build(tmp_path, "shared-0123456789abcdef")
    assert _builds.touch(build) and time.time() - build.stat().st_mtime < 60
    half_hour_ago = time.time() - 1800
    os.utime(build, (half_hour_ago, half_hour_ago))
    assert _builds.touch(build) and build.stat().st_mtime == half_hour_ago  # no write at each start
    assert not _builds.touch(tmp_path / "shared-fedcba9876543210")  # not there: to be built


def test_what_this_process_uses_is_never_its_own_collections(tmp_path: Path) -> None:
    folder = _guest.supervisor_dir(tmp_path, "sha256:image-a")
    os.utime(folder, (WEEK_AGO, WEEK_AGO))
    assert _builds.collect(tmp_path) == [] and folder.is_dir()


def test_a_build_older_than_a_live_sandbox_stays(tmp_path: Path) -> None:
    # A sandbox binds its build as long as it runs (a process sandbox's /etc is in one) and
    # marks it only as it starts: one running for weeks must not lose its files.
    build = _build(tmp_path, "shared-0123456789abcdef", used=WEEK_AGO - 86400)
    sandbox = tmp_path / "sbx-0123456789ab"
    sandbox.mkdir()
    (sandbox / "owner").write_text("1 1")
    started = WEEK_AGO - 86400 + 1800  # within the hour after its start marked the build
    for path in (sandbox / "owner", sandbox):
        os.utime(path, (started, started))
    assert _builds.collect(tmp_path) == [] and build.is_dir()
    (sandbox / "owner").unlink()
    sandbox.rmdir()  # it ended
    assert _builds.collect(tmp_path) == ["build shared-0123456789abcdef"]


def test_removal_is_a_rename_first_and_a_half_removed_build_is_harmless(tmp_path: Path) -> None:
    # A start sees the whole build or none (then builds it again); a gc stopped between its
    # rename and its removal leaves a hidden name, removed by the next.
    half = _build(tmp_path, ".removing-shared-0123456789abcdef-0a1b2c3d", used=time.time())
    crashed = _build(tmp_path, ".supervisor-abc123", used=time.time() - 7200)
    building = _build(tmp_path, ".initrd-abc123", used=time.time())
    assert _builds.collect(tmp_path) == []
    assert not half.exists() and not crashed.exists() and building.exists()
