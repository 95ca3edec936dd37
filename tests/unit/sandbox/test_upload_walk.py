"""The walk of a host folder that ``files.upload_dir``, the service's client and a run's seed
share (``upload_entries``): a stack, not recursion, so a deep tree is a typed ``TreeTooDeep``
(the depth no archive of a workspace takes) and a hidden one is walked to any depth; what
goes while it is read is left out, never a bare ``OSError``."""

from __future__ import annotations

import io
import tarfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stockade import exceptions as exc
from stockade.runs.seeds import pack_workspace
from stockade.sandbox._archive_members import MAX_DEPTH
from stockade.sandbox._requests import tar_chunks
from stockade.sandbox.facade import tar_directory

Nest = Callable[[Path, int], Path]


@pytest.fixture
def nest() -> Iterator[Nest]:
    """``nest(base, depth)``: ``base/a/.../a``, ``depth`` folders below ``base``, made a level
    at a time (``Path.mkdir(parents=True)`` recurses), and removed after the test from the
    bottom up (``shutil.rmtree``, which pytest's ``tmp_path`` uses, recurses as well)."""
    made: list[tuple[Path, Path]] = []

    def make(base: Path, depth: int) -> Path:
        folder = base
        for _ in range(depth):
            folder = folder / "a"
            folder.mkdir()
        made.append((base, folder))
        return folder

    yield make
    for base, deepest in made:
        folder = deepest
        while folder != base:
            for entry in folder.iterdir():
                if not entry.is_dir():
                    entry.unlink()
            folder.rmdir()
            folder = folder.parent


def names(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return tar.getnames()


def test_a_tree_deeper_than_an_archive_takes_is_too_deep_on_every_route(tmp_path: Path, nest: Nest) -> None:
    (nest(tmp_path, 1_100) / "f").write_text("x")  # 1,101 names: a RecursionError before
    with pytest.raises(exc.TreeTooDeep) as deep:
        tar_directory(tmp_path)  # files.upload_dir's, and the service client's
    assert deep.value.path.count("/") == MAX_DEPTH and not deep.value.retryable
    with pytest.raises(exc.TreeTooDeep):
        pack_workspace(tmp_path)  # a run's seed


def test_a_tree_as_deep_as_an_archive_takes_is_sent_whole(tmp_path: Path, nest: Nest) -> None:
    (nest(tmp_path, MAX_DEPTH - 1) / "f").write_text("x")
    sent = names(tar_directory(tmp_path))
    assert len(sent) == MAX_DEPTH and max(n.count("/") for n in sent) == MAX_DEPTH - 1


def test_a_hidden_tree_is_walked_to_any_depth_and_left_out(tmp_path: Path, nest: Nest) -> None:
    (tmp_path / "kept.txt").write_text("kept")
    (tmp_path / "build").mkdir()
    (nest(tmp_path / "build", 1_100) / "f").write_text("hidden")
    assert names(tar_directory(tmp_path, hide=("build",))) == ["kept.txt"]


def test_what_goes_while_the_walk_reads_its_folder_is_left_out(tmp_path: Path) -> None:
    # /proc/self/fd lists the descriptor its own listing holds, closed before it is looked at
    sent = names(tar_directory(Path("/proc/self/fd")))
    assert "0" in sent
    assert names(tar_directory(Path("/proc/self")))  # entries that come and go, without an OSError


def test_a_folder_that_changes_during_the_upload_gives_a_whole_archive(tmp_path: Path) -> None:
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            for i in range(50):
                (tmp_path / f"f{i}").write_bytes(b"x" * 1000)
                sub = tmp_path / f"d{i}"
                sub.mkdir(exist_ok=True)
                (sub / "g").write_bytes(b"y")
            for i in range(50):
                (tmp_path / f"f{i}").unlink()
                (tmp_path / f"d{i}" / "g").unlink()
                (tmp_path / f"d{i}").rmdir()

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for _ in range(40):
            try:
                data = tar_directory(tmp_path)
            except exc.ConfigurationError as error:  # a file that shrank under the read
                assert "shrank" in str(error)
                continue
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                for info in tar:  # a file caught between its truncation and its write is empty
                    assert info.name.startswith(("f", "d"))
                    assert not info.isreg() or info.size in (0, 1, 1000)
    finally:
        stop.set()
        worker.join()


def test_a_socket_in_a_folder_is_left_out_of_every_archive(tmp_path: Path) -> None:
    """A socket is nothing an archive holds (tar leaves one out): a bare AttributeError from
    ``stockade exec -w`` and ``stockade agent -w`` before."""
    import socket

    from stockade.server.downloads import pack_folder

    folder = tmp_path / "ws"
    folder.mkdir()
    (folder / "kept.txt").write_text("kept")
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(folder / "sock"))
        assert names(tar_directory(folder)) == ["kept.txt"]  # files.upload_dir's
        with tarfile.open(fileobj=io.BytesIO(pack_workspace(folder).data), mode="r:gz") as seed:
            assert seed.getnames() == ["kept.txt"]  # a run's seed
        packed, _ = pack_folder(folder, tmp_path, cap=1 << 20, what="the folder")  # a download
        with packed, tarfile.open(fileobj=packed) as download:
            assert download.getnames() == ["kept.txt"]


def test_a_file_whose_header_fills_a_chunk_is_sent(tmp_path: Path) -> None:
    """A header that ended exactly at a chunk's end left 0 bytes to read of the file's chunk:
    the read's b"" was taken for a file that shrank, and the upload failed (a folder of 6,000
    small files, found from outside)."""
    (tmp_path / "f.txt").write_text("x\n")
    with tarfile.open(fileobj=io.BytesIO(tar_directory(tmp_path))) as tar:
        header = tar.getmember("f.txt").offset_data  # its header's size, a pax one's included
    chunks = list(tar_chunks(tmp_path, size=header))
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
        member = tar.extractfile("f.txt")
        assert member is not None and member.read() == b"x\n"
