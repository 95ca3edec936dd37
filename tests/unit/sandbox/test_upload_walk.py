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


@pytest.mark.parametrize("size", [512, 1024, 1536, 4096])
def test_a_header_that_fills_a_chunk_is_sent_before_the_files_data(tmp_path: Path, size: int) -> None:
    # A header that left the buffer exactly one chunk long read 0 bytes of its file, taken as
    # the file having shrunk (an upload of 100,000 small files failed so, found from outside);
    # a long name's PAX header past the chunk read the whole file at once. Headers of one
    # block (512 bytes) and of several, with files of every alignment, at several chunk sizes.
    for i in range(12):
        (tmp_path / f"f{i:02}").write_bytes(bytes([i]) * (i * 97))
    long_name = tmp_path / ("n" * 200)
    long_name.mkdir()
    (long_name / ("m" * 200)).write_bytes(b"long" * 300)
    chunks = list(tar_chunks(tmp_path, size=size))
    assert all(len(chunk) == size for chunk in chunks[:-1])
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    assert files[f"{'n' * 200}/{'m' * 200}"] == b"long" * 300
    assert all(files[f"f{i:02}"] == bytes([i]) * (i * 97) for i in range(12))
