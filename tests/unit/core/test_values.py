"""Value objects validate themselves; paths are checked before reaching any sandbox."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stockade import ConfigurationError, FileTooLarge, InvalidArgument, Limits, PathEscapeError
from stockade.sandbox._requests import file_text, text_sink
from stockade.sandbox.facade import check_path
from stockade.types import FILE_COST_BYTES, MiB


@pytest.mark.parametrize(
    "bad", [{"memory_mb": 0}, {"cpus": -1}, {"pids": 2}, {"timeout_s": 0}, {"output_bytes": 0}]
)
def test_limits_refuse_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError):
        Limits(**bad)  # type: ignore[arg-type]


def test_the_workspace_and_tmp_are_sized_below_the_memory_they_are_made_of() -> None:
    default = Limits()
    assert (default.workspace_mb, default.tmp_size_mb) == (192, 32)
    assert (default.workspace_inodes, default.scratch_inodes) == (32_768, 4_096)  # a node_modules
    small = Limits(memory_mb=64)
    assert (small.workspace_mb, small.tmp_size_mb, small.workspace_inodes, small.scratch_inodes) == (
        24, 4, 4_096, 512,
    )  # fmt: skip
    assert Limits(memory_mb=1024, disk_mb=400).workspace_mb == 400


@given(st.integers(32, 1 << 20))
def test_the_default_files_leave_a_quarter_of_memory_to_the_processes(memory_mb: int) -> None:
    # Bytes and files both: an empty file with a long name costs the kernel up to 3 KiB.
    limits = Limits(memory_mb=memory_mb)
    sizes = limits.workspace_mb + 2 * limits.tmp_size_mb
    files = limits.workspace_inodes + 2 * limits.scratch_inodes
    assert 4 * (sizes * MiB + files * FILE_COST_BYTES) <= 3 * memory_mb * MiB


def test_files_that_could_take_the_processes_memory_are_refused_with_the_fix() -> None:
    with pytest.raises(ConfigurationError, match="raise memory_mb to at least 1021") as caught:
        Limits(memory_mb=512, disk_mb=400)
    assert caught.value.argument == "Limits.disk_mb"  # type: ignore[attr-defined]


def test_empty_files_count_against_the_memory_too() -> None:
    # 65,536 files (the old default) and a quarter each in /tmp and /dev/shm took 128 MiB of
    # kernel memory at 1.5-2.1 KiB each: a sandbox of 128 MiB was killed for memory, not ENOSPC.
    with pytest.raises(InvalidArgument, match=r"65,536 files.*raise memory_mb to at least 954") as caught:
        Limits(memory_mb=128, inodes=65_536)
    assert caught.value.argument == "Limits.inodes"
    assert "lower inodes" in str(caught.value.fix)
    assert Limits(memory_mb=1024, inodes=65_536).workspace_inodes == 65_536


def test_the_derived_file_count_stays_in_the_range_a_given_one_must_be_in() -> None:
    # 64 a MiB from 2**25 MiB would be 2**31, past what a tmpfs's nr_inodes takes
    for memory_mb in (2**25, 2**32):
        assert Limits(memory_mb=memory_mb).workspace_inodes == 2**31 - 1
    Limits(inodes=Limits(memory_mb=2**32).workspace_inodes, memory_mb=2**32)  # a value Limits takes


@pytest.mark.parametrize(("open_files", "pids", "each"), [(16384, 128, 128), (2048, 32, 64), (100, 64, 32)])
def test_open_files_are_shared_by_the_processes(open_files: int, pids: int, each: int) -> None:
    limits = Limits(open_files=open_files, pids=pids)
    assert limits.files_per_process == each and limits.total_open_files == each * pids


def test_limits_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Limits().memory_mb = 1  # type: ignore[misc]


segment = st.sampled_from(["a", "b", "..", ".", "", "src", "x.py"])


@given(st.lists(segment, max_size=8), st.booleans())
def test_no_accepted_path_climbs_out_of_the_workspace(parts: list[str], absolute: bool) -> None:
    path = ("/workspace/" if absolute else "") + "/".join(parts)
    depth = 0
    escapes = path.startswith("/") and not path.startswith("/workspace")
    for part in path.removeprefix("/workspace").split("/"):
        if part == "..":
            depth -= 1
            escapes = escapes or depth < 0
        elif part not in ("", "."):
            depth += 1
    if escapes:
        with pytest.raises(PathEscapeError):
            check_path(path)
    else:
        assert check_path(path) == path


@pytest.mark.parametrize("path", ["/etc/passwd", "/workspacex/a", "a\x00b", "../a"])
def test_obviously_bad_paths_are_refused(path: str) -> None:
    with pytest.raises(PathEscapeError):
        check_path(path)


def test_a_path_longer_than_the_kernel_takes_is_refused_before_the_sandbox() -> None:
    # a million characters went to the sandbox (and whole into the audit trail, twice) and
    # came back as WorkspaceFull; the error shows its head, never the path whole
    assert check_path("a" * 4096) == "a" * 4096
    for path in ("a/" * 500_000, "é" * 2049):  # characters or bytes of UTF-8
        with pytest.raises(InvalidArgument, match="PATH_MAX") as caught:
            check_path(path)
        assert len(str(caught.value)) < 300


def test_streamed_text_survives_a_character_split_across_chunks() -> None:
    seen: list[str] = []
    sink = text_sink(seen.append, None)
    assert sink is not None
    data = "héllo €".encode()
    for i in range(len(data)):
        sink(1, data[i : i + 1])
    assert "".join(seen) == "héllo €"


def test_a_file_whose_text_would_take_more_than_the_cap_is_refused_as_text() -> None:
    # one character past U+FFFF makes every character of the string four bytes: 100 MB of
    # ASCII and an emoji would be 400 MB of text, over the 256 MiB a read may bring
    ascii_file = b"a" * (100 << 20)
    assert len(file_text(ascii_file, "log")) == 100 << 20
    with pytest.raises(FileTooLarge, match="format='bytes'") as caught:
        file_text(ascii_file + "😀".encode(), "log")
    assert caught.value.path == "log"
    assert file_text("é😀".encode(), "small") == "é😀"  # small: whatever its width
