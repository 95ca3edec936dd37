"""``stockade.testing.MemoryWorkspace``, the fake's workspace that tests of tools build on: a
file is read without a look at every other file (each read scanned them all to see whether
the path was a folder: a diff of 2,500 files took 10 s), and folders implied by the files
given are still folders."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stockade import Sandbox
from stockade import exceptions as exc
from stockade.testing import FakeBackend, MemoryWorkspace


class CountedFiles(dict[str, bytes]):
    """A workspace's files that count the times they are gone through."""

    walks = 0

    def __iter__(self) -> Iterator[str]:
        CountedFiles.walks += 1
        return super().__iter__()


def test_a_file_is_read_without_going_through_the_others() -> None:
    files = CountedFiles({f"f{i}.txt": b"x\n" for i in range(100)})
    sbx = Sandbox.create(backend=FakeBackend(MemoryWorkspace(files=files)))
    CountedFiles.walks = 0
    assert sbx.files.read("f7.txt", format="bytes") == b"x\n"
    assert CountedFiles.walks == 0


def test_a_folder_implied_by_the_files_given_is_a_folder() -> None:
    sbx = Sandbox.create(backend=FakeBackend(MemoryWorkspace(files={"src/app.py": b"x = 1\n"})))
    assert sbx.files.read("src/app.py", format="bytes") == b"x = 1\n"
    with pytest.raises(exc.FileTypeError):
        sbx.files.read("src", format="bytes")
    with pytest.raises(exc.FileTypeError):
        sbx.files.write("src", "over a folder")
