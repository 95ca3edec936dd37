"""download_dir unpacks an archive the sandbox made: hostile archives cannot touch the host.

The sandbox (and its supervisor) are untrusted, so these archives are built by hand, the way
a subverted supervisor could send them. Each attack is judged on the host: nothing outside
``dest`` changes, nothing of a failed download is left in ``dest``, bytes on disk stay bounded.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import stat
import tarfile
import threading
from pathlib import Path
from typing import Any

import pytest

from stockade import (
    AsyncSandbox,
    DownloadResult,
    FileTooLarge,
    FileTypeError,
    PathEscapeError,
    ProtocolError,
    Sandbox,
    SkippedEntry,
    StockadeError,
    WorkspaceError,
)
from stockade.sandbox._archive import Extraction, extract_archive
from stockade.sandbox._archive_links import LINK_WORK
from stockade.sandbox._archive_members import ENTRY_COST, FOLDER_COST
from stockade.sandbox._archive_stage import STAGE_PREFIX
from stockade.sandbox.base import OpResult
from stockade.sandbox.ops import DOWNLOAD_MAX_BYTES, DOWNLOAD_MAX_ENTRIES, GetArchive, Op
from stockade.testing import FakeBackend

MiB = 1024 * 1024


def archive(*members: tuple[tarfile.TarInfo, bytes], format: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=format) as tar:
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


def file(name: str, data: bytes = b"x", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    return member(name, mode=mode), data


def folder(name: str) -> tuple[tarfile.TarInfo, bytes]:
    return member(name, tarfile.DIRTYPE, mode=0o755), b""


def pax_sized(member: tuple[tarfile.TarInfo, bytes], size: str) -> tuple[tarfile.TarInfo, bytes]:
    """``member`` whose extended header gives ``size`` as its size ("²": a digit to
    ``str.isdigit``, none to ``int``: a ValueError once, not a ProtocolError)."""
    info, data = member
    info.pax_headers = {"size": size}
    return info, data


def symlink(name: str, target: str) -> tuple[tarfile.TarInfo, bytes]:
    return member(name, tarfile.SYMTYPE, link=target), b""


def hardlink(name: str, target: str) -> tuple[tarfile.TarInfo, bytes]:
    return member(name, tarfile.LNKTYPE, link=target), b""


def download(
    data: bytes, dest: Path, *, max_bytes: int = DOWNLOAD_MAX_BYTES, max_entries: int = DOWNLOAD_MAX_ENTRIES
) -> DownloadResult:
    """Through the public API, with a fake sandbox that answers with ``data``."""

    def handler(op: Op[Any]) -> OpResult:
        assert isinstance(op, GetArchive)
        return data

    with Sandbox.create(backend=FakeBackend(handler)) as sbx:
        return sbx.files.download_dir(dest, max_bytes=max_bytes, max_entries=max_entries)


def snapshot(root: Path) -> dict[str, tuple[str, str]]:
    """Every entry under ``root`` (links not followed): kind and content or target."""
    out: dict[str, tuple[str, str]] = {}
    if not os.path.lexists(root):
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", oct(stat.S_IMODE(st.st_mode)))
            else:
                out[rel] = ("file", path.read_bytes().decode(errors="replace"))
    return out


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A host folder with a download target beside a secret the sandbox wants."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "shadow").write_text("root:secret\n")
    (tmp_path / "outside").mkdir()
    return tmp_path


def assert_nothing_left(host: Path, before: dict[str, tuple[str, str]]) -> None:
    assert snapshot(host) == before
    assert not any(name.startswith(STAGE_PREFIX) for _, _, names in os.walk(host) for name in names)


# -- what comes out ------------------------------------------------------------------------


def test_files_folders_links_inside_and_hard_links_come_out(tmp_path: Path) -> None:
    data = archive(
        folder("dir"),
        file("dir/a.txt", b"alpha"),
        hardlink("dir/same.txt", "dir/a.txt"),
        symlink("dir/to-a", "a.txt"),
        symlink("up", "dir/../dir"),
        symlink("self", "."),
    )
    out = tmp_path / "out"
    result = download(data, out)
    assert (out / "dir/a.txt").read_text() == "alpha"
    assert (out / "dir/same.txt").read_text() == "alpha"
    assert os.stat(out / "dir/same.txt").st_ino == os.stat(out / "dir/a.txt").st_ino  # a link, not a copy
    assert (out / "dir/to-a").read_text() == "alpha"
    assert (out / "up/a.txt").read_text() == "alpha"
    assert result == DownloadResult(
        dest=str(out), bytes_written=5, files=2, directories=1, symlinks=3, hard_links=1
    )
    assert sorted(os.listdir(out)) == ["dir", "self", "up"]  # no hidden folder left


def test_the_downloaded_folder_merges_into_what_dest_holds(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "dir").mkdir(parents=True)
    (out / "dir" / "mine.txt").write_text("mine")
    (out / "old.txt").write_text("old")
    download(archive(folder("dir"), file("dir/new.txt", b"new"), file("old.txt", b"replaced")), out)
    assert (out / "dir" / "mine.txt").read_text() == "mine"
    assert (out / "dir" / "new.txt").read_text() == "new"
    assert (out / "old.txt").read_text() == "replaced"


def test_names_of_any_length_and_encoding_in_every_tar_format(tmp_path: Path) -> None:
    deep = "/".join(["d" * 60] * 5) + "/f.txt"  # over ustar's 100 + 155 bytes
    odd = "caf\udce9-\u00e9t\u00e9.txt"  # an undecodable byte and a non-ASCII name
    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        out = tmp_path / f"out-{fmt}"
        members = [file(deep, b"deep"), symlink("long-link", deep), file("plain.txt", b"p")]
        if fmt == tarfile.PAX_FORMAT:
            members.append(file(odd, b"odd"))
        download(archive(*members, format=fmt), out)
        assert (out / deep).read_bytes() == b"deep"
        assert (out / "long-link").read_bytes() == b"deep"
        if fmt == tarfile.PAX_FORMAT:
            assert (out / odd).read_bytes() == b"odd"
            assert os.fsencode(odd) in os.listdir(os.fsencode(out))


def test_setuid_sticky_and_group_or_world_write_bits_are_dropped(tmp_path: Path) -> None:
    download(
        archive(
            (member("shared", tarfile.DIRTYPE, mode=0o1777), b""),
            file("tool", b"#!/bin/sh\n", mode=0o6777),
            file("private", b"k", mode=0o000),
        ),
        tmp_path / "out",
    )
    out = tmp_path / "out"
    assert (out / "tool").stat().st_mode & 0o7777 == 0o755
    assert (out / "shared").stat().st_mode & 0o7777 == 0o755
    assert (out / "private").stat().st_mode & 0o7777 == 0o600


def test_fifos_sockets_and_devices_are_skipped_and_reported(tmp_path: Path) -> None:
    data = archive(
        file("before.txt", b"b"),
        (member("pipe", tarfile.FIFOTYPE), b""),
        (member("tty", tarfile.CHRTYPE), b""),
        (member("disk", tarfile.BLKTYPE), b""),
        (member("sock", b"s"), b""),
        (member("odd", b"Z"), b""),
        file("after.txt", b"a"),
    )
    result = download(data, tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["after.txt", "before.txt"]
    assert result.skipped == (
        SkippedEntry(path="pipe", kind="fifo"),
        SkippedEntry(path="tty", kind="char device"),
        SkippedEntry(path="disk", kind="block device"),
        SkippedEntry(path="sock", kind="socket"),
        SkippedEntry(path="odd", kind="other"),
    )
    assert result.skipped_count == 5 and result.files == 2


def test_a_name_that_changed_while_it_was_archived_is_skipped_and_reported(tmp_path: Path) -> None:
    result = download(archive(file("a.txt"), (member("t", b"c"), b""), file("b.txt")), tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["a.txt", "b.txt"]
    assert result.skipped == (SkippedEntry(path="t", kind="changed"),)


def test_runs_of_zeros_stay_holes_so_a_sparse_file_stays_sparse(tmp_path: Path) -> None:
    # A 100 MiB sparse file of the sandbox took 100 MiB of the host's disk: its holes come
    # as zeros, and were written. Aligned runs of 64 KiB of zeros are holes now.
    data = bytes(3 * MiB + 100) + b"end" + bytes(5 * MiB + 7)
    stream = archive(file("sparse.bin", data))
    with Extraction(tmp_path / "out") as unpack:
        for start in range(0, len(stream), 100_000):  # pieces that cut through the runs
            unpack.feed(stream[start : start + 100_000])
        result = unpack.finish()
    path = tmp_path / "out" / "sparse.bin"
    assert path.read_bytes() == data and result.bytes_written == len(data)
    assert path.stat().st_blocks * 512 <= 256 * 1024


# -- links out, by any route ---------------------------------------------------------------


def chain_attack() -> bytes:
    """``a/up -> ..`` is inside on its own; a chain of it walks out of the folder."""
    return archive(
        folder("a"),
        symlink("a/up", ".."),
        file("innocent.txt", b"first"),
        symlink("report.txt", "a/up/a/up/a/up/../../etc/shadow"),
    )


def links_left_out(out: Path) -> None:
    """Every link under ``out`` leads inside it."""
    for path in out.rglob("*"):
        if path.is_symlink():
            assert os.path.realpath(path).startswith(str(out)), path


@pytest.mark.parametrize(
    ("members", "left_out"),
    [
        pytest.param([symlink("lnk", "/etc")], ["lnk"], id="absolute"),
        pytest.param([symlink("lnk", "../outside")], ["lnk"], id="dotdot"),
        pytest.param([folder("a"), symlink("a/lnk", "../../outside")], ["a/lnk"], id="dotdot-from-a-folder"),
        pytest.param(
            [folder("a"), symlink("a/up", ".."), symlink("x", "a/up/..")], ["x"], id="through-a-link"
        ),
        pytest.param([symlink("x", "y/z/../.."), symlink("y", ".")], ["x"], id="through-a-later-link"),
        pytest.param([file("y"), symlink("y", ".."), symlink("x", "y/etc")], ["y", "x"], id="file-then-link"),
        pytest.param([symlink("a", "b"), symlink("b", "a")], ["a", "b"], id="loop"),
        pytest.param([symlink("a", "a/..")], ["a"], id="self-loop"),
        pytest.param([file("f"), symlink("l", "f/../..")], ["l"], id="through-a-file"),
        pytest.param([folder("d"), symlink("l", "d/../../out/d")], ["l"], id="out-and-back-in"),
        pytest.param([symlink("l", "missing/../../etc")], ["l"], id="through-a-missing-folder"),
    ],
)
def test_links_that_leave_by_any_route_are_left_out_and_reported(
    host: Path, members: list[tuple[tarfile.TarInfo, bytes]], left_out: list[str]
) -> None:
    # One link out, made by the code, made the whole download fail: nothing could be
    # retrieved from a workspace holding one. It is left out now, and said so.
    before = snapshot(host)
    result = download(archive(file("first.txt", b"first"), *members), host / "out")
    assert (host / "out" / "first.txt").read_text() == "first"
    assert sorted(s.path for s in result.skipped) == sorted(left_out)
    assert {s.kind for s in result.skipped} == {"link out"}
    assert not any(os.path.lexists(host / "out" / path) for path in left_out)
    links_left_out(host / "out")
    shutil.rmtree(host / "out")
    assert_nothing_left(host, before)


@pytest.mark.parametrize(
    "members",
    [
        pytest.param([symlink("x", "y/../etc"), folder("y"), symlink("y", "..")], id="dir-then-link"),
        pytest.param([symlink("l", "a\x00\u00e9")], id="nul-in-a-pax-record"),
    ],
)
def test_links_that_cannot_be_made_are_refused(
    host: Path, members: list[tuple[tarfile.TarInfo, bytes]]
) -> None:
    before = snapshot(host)
    with pytest.raises(StockadeError) as caught:
        download(archive(file("first.txt", b"first"), *members), host / "out")
    assert isinstance(caught.value, PathEscapeError | FileTypeError)
    assert_nothing_left(host, before)


def test_the_symlink_chain_attack_is_left_out_and_the_rest_comes(host: Path) -> None:
    result = download(chain_attack(), host / "out")
    assert [(s.path, s.kind) for s in result.skipped] == [("report.txt", "link out")]
    assert (host / "out" / "innocent.txt").read_text() == "first"
    assert not os.path.lexists(host / "out" / "report.txt")
    assert (host / "etc" / "shadow").read_text() == "root:secret\n"


def test_a_link_replaced_later_by_a_folder_is_not_created(tmp_path: Path) -> None:
    out = tmp_path / "out"
    download(archive(symlink("y", ".."), folder("y"), file("y/f", b"f")), out)
    assert (out / "y").is_dir() and not (out / "y").is_symlink()
    assert (out / "y/f").read_text() == "f"


@pytest.mark.parametrize(
    "members",
    [
        pytest.param([file("../escape.txt")], id="dotdot-name"),
        pytest.param([file("/abs.txt")], id="absolute-name"),
        pytest.param([file("a/../../escape.txt")], id="dotdot-inside-a-name"),
        pytest.param([symlink("sub", "."), file("sub/x")], id="write-through-an-archive-link"),
        pytest.param([symlink("sub", "../outside"), file("sub/x")], id="write-through-a-link-out"),
        pytest.param([file("f"), file("f/x")], id="write-under-a-file"),
        pytest.param([folder("d"), file("d")], id="a-folder-replaced-by-a-file"),
        pytest.param([hardlink("pw", "/etc/passwd")], id="hard-link-absolute"),
        pytest.param([hardlink("pw", "../etc/shadow")], id="hard-link-dotdot"),
        pytest.param([hardlink("pw", "not-in-the-archive")], id="hard-link-to-nothing"),
        pytest.param([symlink("s", "first.txt"), hardlink("h", "s")], id="hard-link-to-a-symlink"),
        pytest.param([folder("d"), hardlink("h", "d")], id="hard-link-to-a-folder"),
    ],
)
def test_hostile_members_are_refused_and_leave_nothing(
    host: Path, members: list[tuple[tarfile.TarInfo, bytes]]
) -> None:
    before = snapshot(host)
    with pytest.raises(StockadeError):
        download(archive(file("first.txt", b"first"), *members), host / "out")
    assert_nothing_left(host, before)


# -- what dest already holds ---------------------------------------------------------------


def test_a_symlink_already_in_dest_is_not_written_through(host: Path) -> None:
    out = host / "out"
    out.mkdir()
    (out / "d").symlink_to(host / "outside")
    before = snapshot(host)
    with pytest.raises(PathEscapeError):
        download(archive(file("ok.txt"), folder("d"), file("d/planted", b"x")), out)
    assert_nothing_left(host, before)


def test_a_new_link_through_a_link_already_in_dest_is_refused_and_undone(host: Path) -> None:
    # The archive alone looks harmless (``ext`` is not in it); only the real tree shows that
    # ``x`` would lead out, after the download is in place: it is all undone.
    out = host / "out"
    out.mkdir()
    (out / "ext").symlink_to(host / "etc")
    (out / "keep.txt").write_text("the user's own")
    before = snapshot(host)
    data = archive(
        folder("new"), file("new/a.txt", b"a"), file("keep.txt", b"overwritten"), symlink("x", "ext/shadow")
    )
    with pytest.raises(PathEscapeError, match="'x'"):
        download(data, out)
    assert_nothing_left(host, before)


def test_a_new_link_through_an_inside_link_of_dest_is_kept(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "real").mkdir(parents=True)
    (out / "real" / "f").write_text("f")
    (out / "alias").symlink_to("real")
    download(archive(symlink("x", "alias/f")), out)
    assert (out / "x").read_text() == "f"


def test_a_file_where_dest_has_a_folder_is_refused_before_anything_moves(host: Path) -> None:
    out = host / "out"
    (out / "taken").mkdir(parents=True)
    (out / "taken" / "mine").write_text("mine")
    before = snapshot(host)
    with pytest.raises(FileTypeError):
        download(archive(file("a.txt"), file("taken", b"theirs")), out)
    assert_nothing_left(host, before)


# -- bounded -------------------------------------------------------------------------------


def test_hard_links_stay_links_so_the_bytes_on_disk_stay_one_copy(tmp_path: Path) -> None:
    payload = os.urandom(4 * MiB)
    links = [hardlink(f"copy-{i:02}", "big.bin") for i in range(64)]
    result = download(archive(file("big.bin", payload), *links), tmp_path / "out", max_bytes=5 * MiB)
    out = tmp_path / "out"
    inodes = {os.lstat(p).st_ino: os.lstat(p).st_blocks * 512 for p in out.iterdir()}
    assert len(inodes) == 1 and sum(inodes.values()) < 5 * MiB
    assert os.stat(out / "copy-63").st_nlink == 65
    assert (out / "copy-17").read_bytes() == payload
    assert result.bytes_written == 4 * MiB and result.hard_links == 64 and result.files == 65


def test_the_byte_cap_stops_the_download_with_a_typed_error(host: Path) -> None:
    before = snapshot(host)
    data = archive(*(file(f"f{i}", b"\0" * MiB) for i in range(3)))
    with pytest.raises(FileTooLarge, match="max_bytes=2097152") as caught:
        download(data, host / "out", max_bytes=2 * MiB)
    assert "pass a larger max_bytes" in str(caught.value)
    assert_nothing_left(host, before)
    entries = 3 * (ENTRY_COST + len("f0"))  # each file's inode and name count too
    assert download(data, host / "out", max_bytes=3 * MiB + entries).bytes_written == 3 * MiB


def test_a_huge_declared_size_is_refused_before_any_data(host: Path) -> None:
    # A header claiming a 10 GB file (a sparse file's apparent size): refused at its header.
    info = member("sparse.bin")
    info.size = 10 * 1024**3
    head = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    before = snapshot(host)
    with pytest.raises(FileTooLarge):
        download(head + b"\0" * MiB, host / "out")
    assert_nothing_left(host, before)


def test_the_entry_cap_counts_folders_the_names_imply(host: Path) -> None:
    before = snapshot(host)
    with pytest.raises(FileTooLarge, match="max_entries=5"):
        download(archive(file("a/b/c/d/e/f.txt")), host / "out", max_entries=5)
    assert_nothing_left(host, before)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"\x01garbage" * 200, id="garbage"),
        pytest.param(archive(file("a.txt", b"a" * 5000))[:3000], id="cut-in-a-file"),
        pytest.param(archive(file("a.txt"))[:512], id="cut-after-a-header"),
        pytest.param(archive(file("a.txt")) + b"\1" * (2 * MiB), id="endless-after-the-end"),
        pytest.param(archive(file("x" * 70_000 + ".txt")), id="huge-extended-header"),
        pytest.param(archive(file("d/" + "x" * 300)), id="a-name-over-255-bytes"),
        pytest.param(archive(symlink("l", "x/" * 3000)), id="a-link-target-over-4096-bytes"),
        pytest.param(archive(file("/".join("d" * 200))), id="200-folders-deep"),
        pytest.param(archive(pax_sized(file("a.txt"), "²")), id="a-pax-size-of-a-superscript-digit"),
    ],
)
def test_malformed_archives_are_protocol_errors_and_leave_nothing(host: Path, data: bytes) -> None:
    before = snapshot(host)
    with pytest.raises(ProtocolError):
        download(data, host / "out")
    assert_nothing_left(host, before)


def test_streamed_in_small_pieces_it_comes_out_the_same(tmp_path: Path) -> None:
    data = archive(folder("d"), file("d/a.bin", os.urandom(3000)), symlink("l", "d/a.bin"), file("e", b""))
    whole = extract_archive(data, tmp_path / "whole")
    with Extraction(tmp_path / "pieces") as unpack:
        for start in range(0, len(data), 7):
            unpack.feed(data[start : start + 7])
        pieces = unpack.finish()
    assert snapshot(tmp_path / "whole") == snapshot(tmp_path / "pieces")
    assert (whole.files, whole.symlinks, whole.bytes_written) == (pieces.files, pieces.symlinks, 3000)


def test_an_abort_from_another_thread_undoes_and_stops_the_feeder(tmp_path: Path) -> None:
    unpack = Extraction(tmp_path / "out")
    unpack.feed(archive(file("a.txt", b"a"), file("b.txt", b"b"))[:2048])
    aborter = threading.Thread(target=unpack.abort)
    aborter.start()
    aborter.join()
    with pytest.raises(WorkspaceError):
        unpack.feed(b"\0" * 512)
    assert not (tmp_path / "out").exists()


def test_bad_caps_are_configuration_errors(tmp_path: Path) -> None:
    with pytest.raises(StockadeError, match="max_bytes"):
        download(archive(file("a")), tmp_path / "out", max_bytes=-1)
    assert not (tmp_path / "out").exists()


# -- the async twin ------------------------------------------------------------------------


def test_the_async_twin_gives_the_same_result_and_the_same_refusals(host: Path) -> None:
    async def main(data: bytes, dest: Path) -> DownloadResult:
        def handler(op: Op[Any]) -> OpResult:
            return data

        sbx = await AsyncSandbox.create(backend=FakeBackend(handler))
        try:
            return await sbx.files.download_dir(dest)
        finally:
            await sbx.close()

    left = asyncio.run(main(chain_attack(), host / "out"))
    assert [(s.path, s.kind) for s in left.skipped] == [("report.txt", "link out")]
    result = asyncio.run(main(archive(file("a.txt", b"a"), hardlink("b.txt", "a.txt")), host / "ok"))
    assert result.hard_links == 1 and (host / "ok" / "b.txt").read_text() == "a"


@pytest.mark.parametrize(
    "first",
    [
        pytest.param([symlink("L", "x/../secret.txt")], id="up-after-a-missing-name"),
        pytest.param(
            [symlink("x", "sub"), folder("sub"), symlink("L", "x/../secret.txt")], id="up-after-a-link"
        ),
    ],
)
def test_two_downloads_into_one_folder_never_compose_a_link_out(
    tmp_path: Path, first: list[tuple[tarfile.TarInfo, bytes]]
) -> None:
    # Alone, `x/../secret.txt` stays inside (x missing: taken as a folder; or a link to a
    # folder inside); a second download then made x a link to `.`, and L led to the
    # folder's parent: the host file beside the download folder was read and written
    # through it. A `..` may only undo a real folder's name: left out at the first download.
    (tmp_path / "secret.txt").write_text("the host's")
    out = tmp_path / "out"
    assert [s.path for s in download(archive(*first), out).skipped] == ["L"]
    download(archive(symlink("x", ".")), out)
    assert not (out / "L").exists() and os.path.realpath(out / "x") == str(out)


def test_a_link_up_through_real_folders_comes_out(tmp_path: Path) -> None:
    out = tmp_path / "out"
    download(archive(folder("a"), folder("a/b"), file("f", b"f"), symlink("a/b/up", "../b/../../f")), out)
    assert (out / "a/b/up").read_text() == "f"


def test_links_in_many_folders_are_each_judged_from_their_own(tmp_path: Path) -> None:
    # The check walks the folders in order and keeps the chain of the one it is in: each
    # link must still be resolved from its own folder, after siblings, cousins and deeper ones.
    out = tmp_path / "out"
    data = archive(
        file("x", b"x"),
        symlink("a/b/c/in", "../../../x"),
        symlink("a/b/c/out", "../../../../x"),
        symlink("a/b/in", "../../x"),
        symlink("a/z/out", "../../../x"),
        symlink("a/z/y/in", "../../../x"),
        symlink("q/in", "../x"),
        symlink("q/r/s/t/out", "../../../../../x"),
    )
    result = download(data, out)
    assert sorted(s.path for s in result.skipped) == ["a/b/c/out", "a/z/out", "q/r/s/t/out"]
    assert all((out / p).read_text() == "x" for p in ("a/b/c/in", "a/b/in", "a/z/y/in", "q/in"))


def deep_links(depth: int, count: int, target: str) -> bytes:
    base = "/".join(["d"] * (depth - 1))
    return archive(*(symlink(f"{base}/l{i}", target.format(i=i)) for i in range(count)))


def unpacked(data: bytes, dest: Path, max_link_steps: int = LINK_WORK) -> tuple[DownloadResult, Extraction]:
    with Extraction(dest, max_link_steps=max_link_steps) as unpack:
        unpack.feed(data)
        return unpack.finish(), unpack


def test_a_links_check_costs_the_same_at_any_depth(tmp_path: Path) -> None:
    # Each link's folder chain was looked up name by name, for every link: 20,000 links
    # 127 folders deep took 28 s of host CPU. The folders are looked up once per pass now.
    shallow = unpacked(deep_links(20, 300, "x{i}"), tmp_path / "shallow")[1].link_steps
    deep = unpacked(deep_links(128, 300, "x{i}"), tmp_path / "deep")[1].link_steps
    # two passes (the model, then the real tree), each: a folder looked up once, and per
    # link one name checked for ".." and one walked
    assert shallow == 2 * (19 + 300 * 2)
    assert deep - shallow == 2 * (127 - 19)


def test_a_links_check_costs_what_its_targets_say(tmp_path: Path) -> None:
    # The attack's shape: links 128 deep whose targets climb to the top. Each costs its
    # target's names, as its bytes in the archive did; none is charged for its depth twice.
    up = "../" * 127 + "x{i}"
    result, unpack = unpacked(deep_links(128, 200, up), tmp_path / "out")
    assert result.symlinks == 200
    assert unpack.link_steps == 2 * (127 + 200 * 2 * 128)


def test_the_link_check_has_a_bound_per_download(host: Path) -> None:
    # Links through links cost up to 512 steps each: 100,000 of them, minutes of CPU. Past
    # max_link_steps (LINK_WORK by default) the download stops, as at any other cap.
    chain = deep_links(20, 200, "../" * 19 + "d/" * 19 + "l{i}")  # l{i} through l{i}, again
    result, unpack = unpacked(chain, host / "out")
    assert result.skipped_count == 200  # all left out, in one pass: nothing is left to check
    assert 200 * 512 < unpack.link_steps < 200 * 3 * 512
    shutil.rmtree(host / "out")
    before = snapshot(host)
    with pytest.raises(FileTooLarge, match=f"takes more than {unpack.link_steps - 1} steps"):
        unpacked(chain, host / "out", max_link_steps=unpack.link_steps - 1)
    assert_nothing_left(host, before)


def test_a_member_reopens_no_folder_above_it(tmp_path: Path) -> None:
    # Each member, and each link at the end, reopened every folder of its path name by
    # name: 50,000 links 125 deep cost seconds of host CPU in openat alone. The folder the
    # last member went to stays open; more members in it open nothing more.
    def opens(count: int) -> int:
        base = "/".join(["d"] * 127)
        files = (file(f"{base}/f{i}") for i in range(count))
        links = (symlink(f"{base}/l{i}", "f0") for i in range(count))
        result, unpack = unpacked(archive(*files, *links), tmp_path / str(count))
        assert (result.files, result.symlinks) == (count, count)
        return unpack.folder_opens

    assert opens(600) == opens(300)


def test_every_entry_made_counts_toward_max_bytes(host: Path) -> None:
    # 60,000 empty folders with 255-byte names wrote 257 MB at max_bytes=0: an entry
    # costs its name, and an inode (a file, a link, with its target) or a block (a folder).
    before = snapshot(host)
    with pytest.raises(FileTooLarge, match="max_bytes=0"):
        download(archive(*(folder(f"{i:03}" + "x" * 252) for i in range(100))), host / "out", max_bytes=0)
    assert_nothing_left(host, before)
    data = archive(file("d/f", b"abc"), symlink("l", "d/f"), hardlink("h", "d/f"))
    cost = (FOLDER_COST + 1) + (ENTRY_COST + 1 + 3) + (ENTRY_COST + 1 + 3) + (ENTRY_COST + 1)
    with pytest.raises(FileTooLarge, match=f"max_bytes={cost - 1}"):
        download(data, host / "out", max_bytes=cost - 1)
    assert_nothing_left(host, before)
    assert download(data, host / "out", max_bytes=cost).bytes_written == 3
    assert download(archive(folder(".")), host / "empty", max_bytes=0).directories == 0
