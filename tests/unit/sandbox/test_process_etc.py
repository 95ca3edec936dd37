"""What the process tier copies of the host's /etc: a stamp per file says when a copy is stale."""

from __future__ import annotations

import os
from pathlib import Path

from stockade.sandbox._process_bwrap import find_host_etc


def test_files_have_a_stamp_folders_do_not_and_missing_entries_are_left_out(tmp_path: Path) -> None:
    (tmp_path / "etc" / "ssl").mkdir(parents=True)
    (tmp_path / "etc" / "mime.types").write_text("text/plain txt\n")
    found = {name: (is_dir, stamp) for name, is_dir, stamp in find_host_etc(tmp_path)}
    assert set(found) == {"ssl", "mime.types"}
    assert found["ssl"] == (True, None)
    assert found["mime.types"][0] is False and found["mime.types"][1] is not None


def test_a_file_replaced_or_rewritten_gets_another_stamp(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "ld.so.cache").write_bytes(b"one")
    first = find_host_etc(tmp_path)
    assert find_host_etc(tmp_path) == first
    # as ldconfig does: a new file renamed over the old one (same size, same time)
    (etc / "ld.so.cache~").write_bytes(b"two")
    st = (etc / "ld.so.cache").stat()
    os.utime(etc / "ld.so.cache~", ns=(st.st_atime_ns, st.st_mtime_ns))
    os.rename(etc / "ld.so.cache~", etc / "ld.so.cache")
    replaced = find_host_etc(tmp_path)
    assert replaced != first
    (etc / "ld.so.cache").write_bytes(b"three, longer")
    assert find_host_etc(tmp_path) != replaced
