"""``files.download_dir`` against code in the sandbox that builds the attack, on every tier.

The code crafts what the host downloads (link chains, hard-link bombs, sparse giants, FIFOs);
the host judges: nothing outside ``dest`` touched, bytes on disk bounded, a typed error,
nothing of a failed download left in ``dest``, and the sandbox still works afterwards.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import (
    AsyncSandbox,
    FileTooLarge,
    FileTypeError,
    Limits,
    PathEscapeError,
    PathTooLong,
    Sandbox,
    SandboxFileNotFound,
    SkippedEntry,
    SnapshotStore,
)
from tests.conftest import require_tier

MiB = 1024 * 1024
# From dest (``host/out``), ``a/up`` is dest itself, so ``..`` after it is ``host``.
CHAIN = "mkdir a && ln -s .. a/up && echo hi > innocent.txt && ln -s a/up/a/up/../etc/shadow report.txt"


def snapshot(root: Path) -> dict[str, tuple[str, str]]:
    """Every entry under ``root`` (links not followed): kind and content or target."""
    out: dict[str, tuple[str, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[str(path.relative_to(root))] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[str(path.relative_to(root))] = ("dir", "")
            else:
                out[str(path.relative_to(root))] = ("file", path.read_text(errors="replace"))
    return out


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A host folder: the download goes to ``out``, beside a secret and a bystander folder."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "shadow").write_text("root:secret\n")
    (tmp_path / "outside").mkdir()
    return tmp_path


@pytest.fixture
def process_sbx() -> Iterator[Sandbox]:
    require_tier("process")
    with Sandbox.create("process", limits=Limits(memory_mb=256, timeout_s=30, pids=64)) as sbx:
        yield sbx


def still_works(sbx: Sandbox) -> None:
    assert sbx.commands.run("echo ok").stdout == "ok\n"
    sbx.files.write("after.txt", "after")
    assert sbx.files.read("after.txt") == "after"


def test_a_chain_of_inside_links_that_walks_out_is_left_out(sbx: Sandbox, host: Path) -> None:
    # One such link, made by the code, failed the whole download: nothing could be retrieved.
    assert sbx.commands.run(CHAIN).exit_code == 0
    result = sbx.files.download_dir(host / "out")
    assert [(s.path, s.kind) for s in result.skipped] == [("report.txt", "link out")]
    assert not os.path.lexists(host / "out" / "report.txt")
    assert os.readlink(host / "out" / "a" / "up") == ".."  # inside on its own: kept
    assert (host / "out" / "innocent.txt").read_text() == "hi\n"
    assert (host / "etc" / "shadow").read_text() == "root:secret\n"
    still_works(sbx)


def test_links_out_made_by_the_code_do_not_block_the_rest(sbx: Sandbox, host: Path) -> None:
    made = "ln -s /etc/shadow sh; ln -s ../../../../root r; mkdir d; ln -s .. d/up; echo hi > f"
    made += "; ln -s b/../etc a; ln -s . b"  # `a` leads through `b`, which comes after it
    assert sbx.commands.run(made).exit_code == 0
    result = sbx.files.download_dir(host / "out")
    assert sorted(s.path for s in result.skipped) == ["a", "r", "sh"]
    assert (host / "out" / "f").read_text() == "hi\n" and os.readlink(host / "out" / "d" / "up") == ".."
    assert os.readlink(host / "out" / "b") == "."  # a link after another, inside: kept
    assert (host / "etc" / "shadow").read_text() == "root:secret\n"


def test_a_link_in_dest_is_never_written_through(sbx: Sandbox, host: Path) -> None:
    out = host / "out"
    out.mkdir()
    (out / "mine.txt").write_text("mine")
    (out / "d").symlink_to(host / "outside")
    sbx.commands.run("mkdir d && echo planted > d/planted && echo new > new.txt")
    before = snapshot(host)
    with pytest.raises(PathEscapeError):
        sbx.files.download_dir(out)
    assert snapshot(host) == before
    still_works(sbx)


def test_hard_links_stay_links_and_cost_one_copy_on_the_host(sbx: Sandbox, host: Path) -> None:
    r = sbx.commands.run(
        "head -c 4194304 /dev/urandom > big && for i in $(seq 1 64); do ln big link-$i; done"
    )
    assert r.exit_code == 0, r.stderr
    result = sbx.files.download_dir(host / "out", max_bytes=5 * MiB)
    out = host / "out"
    on_disk = {os.lstat(p).st_ino: os.lstat(p).st_blocks * 512 for p in out.iterdir()}
    assert len(on_disk) == 1 and sum(on_disk.values()) <= 4 * MiB + 64 * 1024
    assert os.stat(out / "link-64").st_nlink == 65
    assert (out / "link-7").read_bytes() == (out / "big").read_bytes()
    assert (result.files, result.hard_links, result.bytes_written) == (65, 64, 4 * MiB)


def test_a_sparse_giant_is_refused_up_front_and_leaves_nothing(sbx: Sandbox, host: Path) -> None:
    assert sbx.commands.run("echo small > a.txt && truncate -s 10G sparse.bin").exit_code == 0
    (host / "out").mkdir()
    (host / "out" / "mine.txt").write_text("mine")
    before = snapshot(host)
    started = time.monotonic()
    with pytest.raises(FileTooLarge, match="max_bytes") as caught:
        sbx.files.download_dir(host / "out")
    assert time.monotonic() - started < 10  # refused from its size, not after reading 1 GiB
    assert "sparse.bin" in str(caught.value)
    assert snapshot(host) == before
    still_works(sbx)


def test_a_large_sparse_file_streams_with_bounded_memory_on_both_sides(tier: str, host: Path) -> None:
    # 100 MB through a sandbox of 128 MB: held whole (and copied), the archive would kill its
    # supervisor; the host would hold it whole too.
    with Sandbox.create(tier, limits=Limits(memory_mb=128, timeout_s=60, pids=64)) as sbx:
        assert sbx.commands.run("truncate -s 100M sparse.bin").exit_code == 0
        tracemalloc.start()
        try:
            result = sbx.files.download_dir(host / "out", max_bytes=512 * MiB)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert result.bytes_written == 100 * MiB
        assert os.path.getsize(host / "out" / "sparse.bin") == 100 * MiB
        assert os.stat(host / "out" / "sparse.bin").st_blocks * 512 < MiB  # its holes stay holes
        assert peak < 40 * MiB, f"the host held {peak / MiB:.0f} MiB at once"
        still_works(sbx)


def test_the_caps_are_typed_errors_and_leave_dest_as_it_was(sbx: Sandbox, host: Path) -> None:
    sbx.commands.run("for i in 1 2 3; do head -c 1048576 /dev/zero > f$i; done; mkdir d; touch d/e")
    out = host / "out"
    out.mkdir()
    (out / "f1").write_text("the user's own f1")
    before = snapshot(host)
    with pytest.raises(FileTooLarge, match="max_bytes"):
        sbx.files.download_dir(out, max_bytes=2 * MiB)
    with pytest.raises(FileTooLarge, match="max_entries"):
        sbx.files.download_dir(out, max_entries=3)
    assert snapshot(host) == before
    result = sbx.files.download_dir(out, max_bytes=3 * MiB + 8 * 1024, max_entries=5)  # with the entries
    assert (out / "f1").stat().st_size == MiB and result.files == 4


def test_fifos_and_sockets_are_skipped_and_reported(sbx: Sandbox, host: Path) -> None:
    ran = sbx.run_code(
        "import os, socket\nos.mkfifo('pipe')\n"
        "s = socket.socket(socket.AF_UNIX)\ns.bind('sock')\n"
        "open('data.txt', 'w').write('data')\n'made'"
    )
    assert ran.text == "'made'", ran.error
    result = sbx.files.download_dir(host / "out")
    assert sorted(os.listdir(host / "out")) == ["data.txt"]
    assert result.skipped == (
        SkippedEntry(path="pipe", kind="fifo"),
        SkippedEntry(path="sock", kind="socket"),
    )
    still_works(sbx)


def test_names_of_any_bytes_and_length_come_out_as_they_are(sbx: Sandbox, host: Path) -> None:
    names = [b"caf\xe9.txt", b"new\nline", b"d" * 200, "\u00e9t\u00e9 \u2014 = \\ ; '\".txt".encode()]
    code = (
        f"import os\nfor n in {names!r}:\n    open(n, 'wb').write(n)\n"
        f"os.symlink({names[2]!r}, b'to-long')\n'ok'"
    )
    assert sbx.run_code(code).text == "'ok'"
    result = sbx.files.download_dir(host / "out")
    out = os.fsencode(host / "out")
    assert sorted(os.listdir(out)) == sorted([*names, b"to-long"])
    for name in names:
        with open(os.path.join(out, name), "rb") as fh:
            assert fh.read() == name
    assert os.readlink(os.path.join(out, b"to-long")) == names[2] and result.symlinks == 1


def test_a_source_that_is_no_folder_is_a_typed_error_and_makes_nothing(sbx: Sandbox, host: Path) -> None:
    sbx.files.write("f.txt", "x")
    with pytest.raises(FileTypeError):
        sbx.files.download_dir(host / "out" / "deep", "f.txt")
    with pytest.raises(SandboxFileNotFound):
        sbx.files.download_dir(host / "out" / "deep", "missing")
    assert not (host / "out").exists()


def test_the_async_twin_has_the_same_guarantees(tier: str, host: Path) -> None:
    async def main() -> None:
        sbx = await AsyncSandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=20, pids=64))
        try:
            await sbx.commands.run(CHAIN)
            left = await sbx.files.download_dir(host / "out")
            assert [s.path for s in left.skipped] == ["report.txt"]
            await sbx.commands.run("rm report.txt && ln innocent.txt again.txt")
            result = await sbx.files.download_dir(host / "again")
            assert result.hard_links == 1 and (host / "again" / "again.txt").read_text() == "hi\n"
        finally:
            await sbx.close()

    asyncio.run(main())


def test_entries_the_code_made_unreadable_are_downloaded_and_snapshotted(
    process_sbx: Sandbox, host: Path, tmp_path: Path
) -> None:
    # `chmod 0` on a folder or file made every download, snapshot and pause fail ("Permission
    # denied"): at the code's will. The supervisor, their owner, opens them up for the read
    # and puts their modes back.
    made = "mkdir locked blind && echo in > locked/f && echo b > blind/f && echo s > sealed"
    assert process_sbx.commands.run(f"{made} && chmod 0 locked sealed && chmod 400 blind").exit_code == 0
    process_sbx.files.download_dir(host / "out")
    got = {name: (host / "out" / name).read_text() for name in ("locked/f", "blind/f", "sealed")}
    assert got == {"locked/f": "in\n", "blind/f": "b\n", "sealed": "s\n"}
    modes = "stat -c '%n %a' locked blind sealed"
    assert process_sbx.commands.run(modes).stdout == "locked 0\nblind 400\nsealed 0\n"
    snapshot = process_sbx.snapshot(memory=False, store=SnapshotStore(tmp_path / "store"))
    assert process_sbx.commands.run(modes).stdout == "locked 0\nblind 400\nsealed 0\n"
    with Sandbox.create("process", snapshot=snapshot) as copy:
        assert copy.commands.run("chmod 700 locked blind && cat locked/f blind/f").stdout == "in\nb\n"


def test_a_path_longer_than_an_archive_takes_is_named_not_blamed_on_the_store(
    process_sbx: Sandbox, host: Path, tmp_path: Path
) -> None:
    # A snapshot refused it as a store without room (``SnapshotStoreFull``: "room for 384
    # MiB", the workspace's own size), and the service told the tenant to delete snapshots.
    folders = "/".join(["d" * 250] * 16)  # 4,016 bytes; its file's path is over 4,096
    assert process_sbx.commands.run(f"mkdir -p {folders} && cd {folders} && touch {'f' * 200}").exit_code == 0
    with pytest.raises(PathTooLong, match="is a path longer than the 4096 bytes an archive takes"):
        process_sbx.files.download_dir(host / "out")
    with pytest.raises(
        PathTooLong, match=r"cannot snapshot the sandbox's workspace: 'd{200}'\.\.\. is a path longer"
    ):
        process_sbx.snapshot(memory=False, store=SnapshotStore(tmp_path / "store"))
    assert not (host / "out").exists()
