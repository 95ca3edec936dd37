"""A sandbox's host folder is claimed by its creator (every tier's: the process tier's run
folder with its owner file, the others' with ``.claim``): it appears with its file written
and flocked, and gc takes a held lock for a live creator at every instant of the start."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from stockade.sandbox import _host
from tests.conftest import require


def test_a_folder_appears_with_its_file_written_and_held_until_released(tmp_path: Path) -> None:
    folder = tmp_path / "sbx-1"
    _host.claim_folder(folder, file="owner", text="123 456")
    try:
        assert os.listdir(tmp_path) == ["sbx-1"]  # no staging folder left beside it
        assert os.listdir(folder) == ["owner"]
        assert (folder / "owner").read_text() == "123 456"
        assert folder.stat().st_mode & 0o777 == 0o700
        assert _host.claimed(folder, "owner")
        assert not _host.claimed(folder)  # asked under another name: not this claim
    finally:
        _host.release_folder(folder)
    assert not _host.claimed(folder, "owner")


def test_the_default_claim_is_an_empty_dot_claim_file(tmp_path: Path) -> None:
    folder = tmp_path / "ctr-1"
    _host.claim_folder(folder)
    try:
        assert os.listdir(folder) == [_host.CLAIM_FILE]
        assert (folder / _host.CLAIM_FILE).read_bytes() == b""
        assert _host.claimed(folder)
    finally:
        _host.release_folder(folder)


def test_a_folder_that_exists_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "sbx-1").mkdir()
    with pytest.raises(FileExistsError):
        _host.claim_folder(tmp_path / "sbx-1", file="owner", text="1 2")
    assert os.listdir(tmp_path) == ["sbx-1"]


def _staging(state: Path, name: str, file: str) -> tuple[Path, int]:
    staging = state / f"{_host.STAGING}{name}"
    staging.mkdir()
    fd = os.open(staging / file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    return staging, fd


def test_gc_takes_a_dead_creators_staging_folder_whatever_its_files_name(tmp_path: Path) -> None:
    held, held_fd = _staging(tmp_path, "held", "owner")
    fcntl.flock(held_fd, fcntl.LOCK_EX)  # a creator between its lock and its rename
    for name, file in (("dead", "owner"), ("dead-claim", _host.CLAIM_FILE)):
        os.close(_staging(tmp_path, name, file)[1])  # locked once, its creator gone
    # A creator between its mkdtemp and its lock: it has only the pending file, unheld.
    young, young_fd = _staging(tmp_path, "young", _host.PENDING)
    empty = tmp_path / f"{_host.STAGING}empty"
    empty.mkdir()
    try:
        assert _host.collect_staging(tmp_path) == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([held.name, young.name, empty.name])
        old = time.time() - 7200  # a crash there, an hour ago
        for folder in (young, empty):
            os.utime(folder, (old, old))
        assert _host.collect_staging(tmp_path) == 2
        assert [p.name for p in tmp_path.iterdir()] == [held.name]
    finally:
        os.close(held_fd)
        os.close(young_fd)
    assert _host.collect_staging(tmp_path) == 1
    assert list(tmp_path.iterdir()) == []


def _collect_within(state: Path, seconds: float) -> int:
    """``collect_staging`` in a thread, waited for ``seconds``: a hung one is freed (a writer
    opens each FIFO it could be waiting on) and fails the test."""
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(_host.collect_staging(state)), daemon=True)
    worker.start()
    worker.join(seconds)
    hung = worker.is_alive()
    while worker.is_alive():
        for fifo in state.rglob("*"):
            if fifo.is_fifo():
                with contextlib.suppress(OSError):
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(0.1)
    assert not hung, "gc waited on a FIFO"
    return result[0]


def test_gc_opens_no_fifo_and_no_link_in_a_staging_folder(tmp_path: Path) -> None:
    """Anyone may make a staging-like folder in a shared temporary folder: a FIFO in it hung
    gc (and every server starting), a link made gc open what it points to."""
    fifo_in = tmp_path / f"{_host.STAGING}fifo"
    fifo_in.mkdir()
    os.mkfifo(fifo_in / "claim")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.mkfifo(outside / "fifo")
    (outside / "kept").write_text("not gc's")
    linked_in = tmp_path / f"{_host.STAGING}link"
    linked_in.mkdir()
    os.symlink(outside / "fifo", linked_in / _host.CLAIM_FILE)
    os.symlink(outside, tmp_path / f"{_host.STAGING}to-a-folder")  # a link is no staging folder

    assert _collect_within(tmp_path, 5) == 2  # this user's, held by nobody
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{_host.STAGING}to-a-folder", "outside"]
    assert sorted(p.name for p in outside.iterdir()) == ["fifo", "kept"]
    assert not _host.claimed(tmp_path / f"{_host.STAGING}to-a-folder", "fifo")


def test_gc_leaves_another_users_staging_folder_unopened(tmp_path: Path) -> None:
    require("root", os.geteuid() == 0, "only root makes a folder another user owns")
    theirs = tmp_path / f"{_host.STAGING}theirs"
    theirs.mkdir()
    os.mkfifo(theirs / "claim")
    (theirs / "owner").touch()
    os.chown(theirs, 65534, 65534)
    old = time.time() - 7200
    os.utime(theirs, (old, old))

    assert _collect_within(tmp_path, 5) == 0
    assert sorted(os.listdir(theirs)) == ["claim", "owner"]
