"""Uploaded archives (``stockade.server.uploads``): every hostile member refused with a typed
error naming it, nothing written anywhere when one is, and bombs stopped early."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import tarfile
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from stockade import exceptions as exc
from stockade.sandbox._archive_members import MAX_DEPTH
from stockade.server.uploads import HEADER_ROOM, check_archive, unpack_archive

MiB = 1024 * 1024
CAP = 8 * MiB


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", data: bytes = b"") -> tuple[
    tarfile.TarInfo, bytes
]:  # fmt: skip
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info, data


def tar_of(*members: tuple[tarfile.TarInfo, bytes], format: int = tarfile.GNU_FORMAT) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=format, encoding="utf-8",
                      errors="surrogateescape") as tar:  # fmt: skip
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buffer.getvalue()


def header(name: str, kind: bytes, size: int) -> bytes:
    """One raw ustar header block, for members tarfile would not write (or not cheaply)."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = size
    return info.tobuf(format=tarfile.GNU_FORMAT)


def gzip_stream(pieces: Iterable[bytes]) -> bytes:
    """A gzip of the pieces, compressed as they come: gigabytes of zeros cost megabytes."""
    squeeze = zlib.compressobj(1, zlib.DEFLATED, 31)
    out = [squeeze.compress(piece) for piece in pieces]
    out.append(squeeze.flush())
    return b"".join(out)


def zeros(total: int, chunk: int = MiB) -> Iterable[bytes]:
    block = bytes(chunk)
    for _ in range(total // chunk):
        yield block
    yield bytes(total % chunk)


@pytest.fixture
def place(tmp_path: Path) -> Path:
    """The folder an upload may write in; the test checks nothing appears anywhere else."""
    (tmp_path / "place").mkdir()
    return tmp_path / "place"


def refused(data: bytes, place: Path, error: type[exc.StockadeError], **caps: int) -> exc.StockadeError:
    before = sorted(os.listdir(place.parent))
    with pytest.raises(error) as raised:
        unpack_archive(data, place / "in", max_bytes=caps.get("max_bytes", CAP),
                       max_entries=caps.get("max_entries", 100_000))  # fmt: skip
    assert not (place / "in").exists()  # nothing of it was written
    assert os.listdir(place) == [] and sorted(os.listdir(place.parent)) == before
    assert str(raised.value)
    return raised.value


# -- what is taken ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "squeeze",
    [lambda b: b, gzip.compress, bz2.compress, lzma.compress],
    ids=["tar", "gzip", "bzip2", "xz"],
)
def test_a_plain_folder_unpacks(place: Path, squeeze: Callable[[bytes], bytes]) -> None:
    data = tar_of(
        member("src", tarfile.DIRTYPE), member("src/app.py", data=b"print(1)\n"),
        member("src/link.py", tarfile.SYMTYPE, "app.py"), member("top", tarfile.SYMTYPE, "src/../src"),
        member("./notes/été.txt", data="déjà".encode()),
    )  # fmt: skip
    assert check_archive(squeeze(data), max_bytes=CAP) == 5
    assert unpack_archive(squeeze(data), place / "in", max_bytes=CAP) == 2
    assert (place / "in/src/app.py").read_text() == "print(1)\n"
    assert os.readlink(place / "in/src/link.py") == "app.py"
    assert (place / "in/notes/été.txt").read_text() == "déjà"


def test_setuid_bits_and_group_write_are_dropped(place: Path) -> None:
    info, data = member("tool", data=b"#!/bin/sh\n")
    info.mode = 0o6777
    unpack_archive(tar_of((info, data)), place / "in", max_bytes=CAP)
    assert (place / "in/tool").stat().st_mode & 0o7777 == 0o755


# -- names ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../evil.txt", "a/../../evil.txt", "/etc/evil", "src/../../../evil", ".."])
def test_names_leaving_the_root_are_path_escapes(place: Path, name: str) -> None:
    error = refused(
        tar_of(member("ok.txt", data=b"x"), member(name, data=b"evil")), place, exc.PathEscapeError
    )
    assert isinstance(error, exc.PathEscapeError) and error.path == name


def test_a_member_deeper_than_an_archive_takes_is_refused_before_anything_is_written(place: Path) -> None:
    # 1,100 nested folders made a RecursionError in the walks after the unpack (a 500)
    deep = "/".join(["a"] * 1_100) + "/f"
    error = refused(tar_of(member("ok.txt", data=b"x"), member(deep, data=b"x")), place, exc.TreeTooDeep)
    assert isinstance(error, exc.TreeTooDeep) and error.path == deep
    at_the_limit = "/".join(["a"] * (MAX_DEPTH - 1)) + "/f"
    assert check_archive(tar_of(member(at_the_limit, data=b"x")), max_bytes=CAP) == 1


def test_a_pax_path_leaving_the_root_is_refused_like_a_plain_one(place: Path) -> None:
    info, data = member("innocent.txt", data=b"x")
    info.pax_headers = {"path": "../../escaped.txt"}
    refused(tar_of((info, data), format=tarfile.PAX_FORMAT), place, exc.PathEscapeError)


def test_a_name_that_is_not_utf8_is_invalid_and_named(place: Path) -> None:
    error = refused(tar_of(member("bad-\udcff.txt", data=b"x")), place, exc.InvalidArgument)
    assert isinstance(error, exc.InvalidArgument) and error.argument == "body"
    assert "\\xff" in str(error) and error.fix


# -- links and special files ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("links", "bad"),
    [
        ([("abs", "/etc/passwd")], "abs"),
        ([("up", "../outside")], "up"),
        ([("d/deep", "../../outside")], "d/deep"),
        ([("loop", "loop")], "loop"),
        ([("a", "b"), ("b", "a")], "a"),
        # each looks inside on its own; through the other, the kernel leaves the root
        ([("here", "."), ("away", "here/../x")], "away"),
        ([("sub/up", ".."), ("sub/far", "up/../x")], "sub/far"),
        ([("d", "sub"), ("sub", ".."), ("x", "d/y")], "sub"),
        # a link below a linked folder resolves from where it really is, not where its name says
        ([("top", "."), ("top/b/l", "../../x")], "top/b/l"),
    ],
)
def test_symlinks_that_resolve_outside_are_refused(
    place: Path, links: list[tuple[str, str]], bad: str
) -> None:
    members = [member(name, tarfile.SYMTYPE, target) for name, target in links]
    error = refused(tar_of(member("a/b/c", tarfile.DIRTYPE), *members), place, exc.PathEscapeError)
    assert isinstance(error, exc.PathEscapeError)
    assert error.path in {name for name, _ in links}


def test_a_name_given_as_a_symlink_and_as_something_else_is_refused(place: Path) -> None:
    data = tar_of(member("x", tarfile.SYMTYPE, "inside"), member("x", tarfile.SYMTYPE, ".."))
    refused(data, place, exc.PathEscapeError)
    data = tar_of(member("y", tarfile.DIRTYPE), member("y", tarfile.SYMTYPE, "."))
    refused(data, place, exc.PathEscapeError)


@pytest.mark.parametrize(
    ("kind", "link"),
    [(tarfile.LNKTYPE, "a.txt"), (tarfile.CHRTYPE, ""), (tarfile.BLKTYPE, ""), (tarfile.FIFOTYPE, "")],
    ids=["hardlink", "chardev", "blockdev", "fifo"],
)
def test_hard_links_devices_and_fifos_are_file_type_errors(place: Path, kind: bytes, link: str) -> None:
    error = refused(
        tar_of(member("a.txt", data=b"x"), member("special", kind, link)), place, exc.FileTypeError
    )
    assert isinstance(error, exc.FileTypeError) and error.path == "special"


def test_a_sparse_member_is_refused(place: Path) -> None:
    data = header("holes.bin", tarfile.GNUTYPE_SPARSE, 0) + bytes(1024)
    refused(data, place, exc.FileTypeError)


# -- sizes, counts, bombs ----------------------------------------------------------------------------


def test_files_adding_up_past_the_cap_are_too_large(place: Path) -> None:
    data = tar_of(member("a", data=b"x" * 600), member("b", data=b"y" * 600))
    error = refused(data, place, exc.FileTooLarge, max_bytes=1000)
    assert isinstance(error, exc.FileTooLarge) and error.path == "b"
    assert unpack_archive(data, place / "in", max_bytes=1200) == 2  # at the cap: taken


def test_too_many_entries_stop_at_the_cap(place: Path) -> None:
    data = gzip.compress(tar_of(*(member(f"d{i}", tarfile.DIRTYPE) for i in range(2001))))
    error = refused(data, place, exc.FileTooLarge, max_entries=2000)
    assert "2,000 entries" in str(error)
    assert check_archive(data, max_bytes=CAP, max_entries=2001) == 2001


def test_a_huge_file_is_refused_from_its_header_before_its_data_is_decompressed(place: Path) -> None:
    # 1 TiB declared, 64 MiB of it present: a gzip bomb of a few hundred KB
    bomb = gzip_stream([header("zeros.bin", tarfile.REGTYPE, 1 << 40), *zeros(64 * MiB)])
    assert len(bomb) < MiB
    started = time.monotonic()
    error = refused(bomb, place, exc.FileTooLarge)
    assert "more than" in str(error) and time.monotonic() - started < 2.0


def test_a_header_bomb_is_stopped_after_a_megabyte_not_read_into_memory(place: Path) -> None:
    # a GNU long name of 256 MiB: tarfile would read it whole into memory
    bomb = gzip_stream([header("././@LongLink", tarfile.GNUTYPE_LONGNAME, 256 * MiB), *zeros(256 * MiB)])
    tracemalloc.start()
    try:
        error = refused(bomb, place, exc.FileTooLarge)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "expands past" in str(error)
    assert peak < 4 * HEADER_ROOM, peak


@pytest.mark.parametrize(
    "data",
    [b"not a tar at all" * 40, gzip.compress(b"gzipped, but no tar" * 100), b"\x1f\x8b\x08garbage",
     b"BZh9 not bzip2 really", tar_of(member("a", data=b"x" * 2000))[:1100]],
    ids=["text", "gzip-of-text", "broken-gzip", "broken-bzip2", "truncated"],
)  # fmt: skip
def test_what_is_not_a_tar_is_invalid_naming_the_body(place: Path, data: bytes) -> None:
    error = refused(data, place, exc.InvalidArgument)
    assert isinstance(error, exc.InvalidArgument) and error.argument == "body" and error.fix


def test_a_gzip_of_zeros_is_an_empty_archive_and_costs_nothing(place: Path) -> None:
    assert unpack_archive(gzip_stream(zeros(256 * MiB)), place / "in", max_bytes=CAP) == 0
    assert os.listdir(place / "in") == []


@pytest.mark.parametrize("hard_link", [True, False], ids=["through-a-hard-link", "through-the-symlink"])
def test_a_link_chain_longer_than_path_max_writes_nothing_outside(place: Path, hard_link: bool) -> None:
    """The archive that gets past tarfile's ``data`` filter before Python 3.11.13 / 3.12.11
    (CVE-2025-4517: ``realpath`` stops resolving past PATH_MAX), and past the check too
    without its hard link (the check resolves links by the names members give, and a link
    named through other links is elsewhere): the extraction refuses a member below a link."""
    from tests.hostile_archives import escaping_tar

    (place / "outside").mkdir()
    (place / "outside" / "flag").write_text("original\n")
    data = escaping_tar(place / "in")
    if not hard_link:  # the same chain, the write going through the symlink itself
        chain = [(info, b"") for info in _members_of(data) if not info.islnk()]
        data = tar_of(*chain, member("escape/outside/newfile", data=b"written by the upload\n"))
    with pytest.raises((exc.PathEscapeError, exc.FileTypeError)):
        unpack_archive(data, place / "in", max_bytes=CAP)
    assert (place / "outside" / "flag").read_text() == "original\n"
    assert sorted(os.listdir(place)) == ["outside"] and os.listdir(place / "outside") == ["flag"]


def _members_of(data: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [m for m in tar.getmembers() if not m.isreg()]


def with_global_header(settings: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT, pax_headers=settings) as tar:
        info, data = member("src/app.py", data=b"print('hi')\n")
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_a_git_archive_with_its_commit_in_a_global_header_unpacks(place: Path) -> None:
    data = with_global_header({"comment": "4b825dc642cb6eb9a060e54bf8d69288fbee4904"})
    assert unpack_archive(data, place / "in", max_bytes=CAP) == 1
    assert (place / "in" / "src" / "app.py").read_text() == "print('hi')\n"


def test_a_global_header_that_changes_members_is_refused(place: Path) -> None:
    error = refused(with_global_header({"comment": "x", "uname": "root"}), place, exc.InvalidArgument)
    assert "a global pax header that sets uname" in str(error)
    assert "sandbox" not in str(error)  # the client sent it
