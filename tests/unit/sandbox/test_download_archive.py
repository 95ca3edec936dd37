"""download_dir unpacks an archive the sandbox made: hostile archives cannot touch the host.

The sandbox (and its supervisor) are untrusted, so these archives are built by hand, the way
a subverted supervisor could send them.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from stockade import Sandbox, StockadeError
from stockade.sandbox.ops import GetArchive, Op
from stockade.testing import FakeBackend


def archive(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, *, link: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.mode = mode
    return info


def download(data: bytes, dest: Path) -> None:
    def handler(op: Op) -> object:
        assert isinstance(op, GetArchive)
        return data

    with Sandbox.create(backend=FakeBackend(handler)) as sbx:
        sbx.files.download_dir(dest)


def test_files_links_inside_and_hard_links_come_out(tmp_path: Path) -> None:
    data = archive(
        (member("dir", tarfile.DIRTYPE, mode=0o755), b""),
        (member("dir/a.txt"), b"alpha"),
        (member("dir/same.txt", tarfile.LNKTYPE, link="dir/a.txt"), b""),
        (member("dir/to-a", tarfile.SYMTYPE, link="a.txt"), b""),
        (member("up", tarfile.SYMTYPE, link="dir/../dir"), b""),
    )
    download(data, tmp_path / "out")
    out = tmp_path / "out"
    assert (out / "dir/a.txt").read_text() == "alpha"
    assert (out / "dir/same.txt").read_text() == "alpha"
    assert (out / "dir/same.txt").stat().st_nlink == 1  # a copy, not a link
    assert (out / "dir/to-a").read_text() == "alpha"


@pytest.mark.parametrize(
    "members",
    [
        [(member("../escape.txt"), b"x")],
        [(member("/abs.txt"), b"x")],
        [(member("lnk", tarfile.SYMTYPE, link="/etc"), b"")],
        [(member("lnk", tarfile.SYMTYPE, link="../outside"), b"")],
        [(member("a/lnk", tarfile.SYMTYPE, link="../../outside"), b"")],
        [(member("pw", tarfile.LNKTYPE, link="/etc/passwd"), b"")],
        [(member("pw", tarfile.LNKTYPE, link="../outside/x"), b"")],
        [(member("dev", tarfile.CHRTYPE), b"")],
        [(member("fifo", tarfile.FIFOTYPE), b"")],
        # A link inside, then a file written "through" it: never followed.
        [(member("sub", tarfile.SYMTYPE, link="."), b""), (member("sub/x"), b"x")],
    ],
)
def test_hostile_members_are_refused_before_anything_is_written(
    tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes]]
) -> None:
    victim = tmp_path / "outside"
    victim.mkdir()
    with pytest.raises(StockadeError):
        download(archive((member("first.txt"), b"first"), *members), tmp_path / "out")
    assert list(victim.iterdir()) == []
    assert not (tmp_path / "escape.txt").exists()


def test_a_symlink_already_in_the_destination_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "d").symlink_to(outside)
    with pytest.raises(StockadeError):
        download(archive((member("d/planted"), b"x")), out)
    assert list(outside.iterdir()) == []


def test_setuid_and_world_writable_bits_are_dropped(tmp_path: Path) -> None:
    download(archive((member("tool", mode=0o6777), b"#!/bin/sh\n")), tmp_path / "out")
    assert (tmp_path / "out/tool").stat().st_mode & 0o7777 == 0o755


def test_a_malformed_archive_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(StockadeError):
        download(b"\x00garbage" * 200, tmp_path / "out")
