"""How the supervisor walks a folder into a tar stream (``supervisor/archive.py``): the code
beside it may change the tree at any moment, and only what cannot be archived is refused."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.sandbox.supervisor_modules import supervisor_module

archive = supervisor_module("archive")
fileops = supervisor_module("fileops")


def walked(root: Path) -> list[tarfile.TarInfo]:
    """The members of ``root``'s tar stream, as the host would pull it."""
    stream = archive.TarStream(os.open(root, archive.DIR_FLAGS), 1 << 30, 100_000)
    data = bytearray()
    try:
        while not stream.finished:
            data += stream.read(1 << 20)
    finally:
        stream.close()
    with tarfile.open(fileobj=io.BytesIO(bytes(data)), mode="r:") as tar:
        return tar.getmembers()


def test_a_path_longer_than_an_archive_takes_is_refused_as_such(tmp_path: Path) -> None:
    # It was refused as "too_large", which a snapshot read as a store without room.
    fd = os.open(tmp_path, os.O_RDONLY)  # made folder by folder: the path is too long to name
    for _ in range(16):
        os.mkdir("d" * 250, dir_fd=fd)
        fd, above = os.open("d" * 250, os.O_RDONLY, dir_fd=fd), fd
        os.close(above)
    os.close(os.open("f" * 200, os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    os.close(fd)
    with pytest.raises(fileops.PathRefused, match="longer than the 4096 bytes") as caught:
        walked(tmp_path)
    assert caught.value.kind == "long_path"


@pytest.fixture
def flipping(tmp_path: Path) -> Iterator[Path]:
    """A folder whose ``t`` another process makes a file, a link, a FIFO, again and again."""
    flipper = (
        "import os, sys\nos.chdir(sys.argv[1])\n"
        "while True:\n"
        "    open('n', 'w').close(); os.replace('n', 't')\n"
        "    os.symlink('x', 'n'); os.replace('n', 't')\n"
        "    os.mkfifo('n'); os.replace('n', 't')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", flipper, str(tmp_path)])
    try:
        while not os.path.lexists(tmp_path / "t"):
            time.sleep(0.01)
        yield tmp_path
    finally:
        proc.kill()
        proc.wait()


def test_a_name_that_changes_kind_while_it_is_archived_is_reported_not_fatal(flipping: Path) -> None:
    # A link become a file gave EINVAL from readlink, a file become a link ELOOP from its
    # open: the whole download failed ("Invalid argument: t").
    kinds: set[bytes] = set()
    deadline = time.monotonic() + 10
    while archive.CHANGEDTYPE not in kinds and time.monotonic() < deadline:
        kinds |= {m.type for m in walked(flipping)}
    assert archive.CHANGEDTYPE in kinds  # raced, at least once in the time given
