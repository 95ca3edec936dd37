"""How the supervisor unpacks a snapshot's object streamed in chunks (``supervisor/unpack.py``):
staged, and moved into place only at the commit; a stream that fails or is aborted midway
leaves nothing of it; a file that does not fit is refused at its header, before its data."""

from __future__ import annotations

import importlib
import io
import os
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from stockade.sandbox.supervisor import reaper

CHUNK = 64 << 10


def supervisor_module(name: str) -> Any:
    """The supervisor's module, which imports its neighbours by bare name."""
    folder = str(Path(reaper.__file__).parent)
    saved = list(sys.path)
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved


unpack = supervisor_module("unpack")
fileops = supervisor_module("fileops")


def archive(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def stream(root: Path, data: bytes, *, end: str = "commit") -> None:
    """Send ``data`` as the host does: open, a chunk at a time, then ``end``."""
    area = fileops.Workspace(str(root))
    tx = unpack.handle(area, {"stage": "open", "path": ""}, b"")["tx"]
    for start in range(0, len(data), CHUNK):
        unpack.handle(area, {"stage": "append", "tx": tx}, data[start : start + CHUNK])
    unpack.handle(area, {"stage": end, "tx": tx}, b"")


def tree(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


def test_a_committed_stream_is_in_place_merged_with_what_was_there(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "old").write_bytes(b"kept")
    (tmp_path / "notes").write_bytes(b"replaced")
    big = os.urandom(3 * CHUNK + 5)
    stream(tmp_path, archive({"pkg/new": b"n", "notes": b"restored", "big": big}))
    assert tree(tmp_path) == {
        "big": big,
        "notes": b"restored",
        "pkg": None,
        "pkg/new": b"n",
        "pkg/old": b"kept",
    }


def test_a_stream_aborted_midway_leaves_nothing(tmp_path: Path) -> None:
    """The host aborts when the object did not hash to its name: what came is dropped."""
    (tmp_path / "there").write_bytes(b"before")
    data = archive({"a": os.urandom(5 * CHUNK), "b": b"b"})
    area = fileops.Workspace(str(tmp_path))
    tx = unpack.handle(area, {"stage": "open", "path": ""}, b"")["tx"]
    for start in range(0, len(data), CHUNK):
        unpack.handle(area, {"stage": "append", "tx": tx}, data[start : start + CHUNK])
    unpack.handle(area, {"stage": "abort", "tx": tx}, b"")
    assert tree(tmp_path) == {"there": b"before"}


def test_a_malformed_archive_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    # The first header's checksum fails. (A later header that does ends tarfile's archive
    # there, quietly: only the host's hash of the whole object tells that one.)
    data = bytearray(archive({"a": os.urandom(2 * CHUNK), "b": b"b"}))
    data[100] ^= 0xFF
    with pytest.raises(tarfile.TarError):
        stream(tmp_path, bytes(data))
    assert tree(tmp_path) == {}


def test_a_file_larger_than_the_room_is_refused_at_its_header(tmp_path: Path) -> None:
    """The room is the destination's free space: a member past it is refused before its data
    comes, with the first chunk, not after the whole of it was sent."""
    room = os.statvfs(tmp_path)
    free = room.f_bavail * room.f_frsize
    header = tarfile.TarInfo("huge")
    header.size = free + (1 << 40)  # past the room however much other tests free meanwhile
    first = header.tobuf(tarfile.PAX_FORMAT) + bytes(CHUNK)  # its header and a little data
    area = fileops.Workspace(str(tmp_path))
    tx = unpack.handle(area, {"stage": "open", "path": ""}, b"")["tx"]
    with pytest.raises(fileops.PathRefused, match=r"'huge' is .* bytes free") as refused:
        unpack.handle(area, {"stage": "append", "tx": tx}, first)
        unpack.handle(area, {"stage": "commit", "tx": tx}, b"")
    assert refused.value.kind == "full"
    assert tree(tmp_path) == {}
