"""The files of a gVisor memory snapshot: packed on the host from a sandbox's tmpfs, unpacked
into a new one's, owned by the sandbox's user; nothing leads out of the new folder."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from stockade import FileTooLarge, SnapshotIncompatible, StockadeError
from stockade.sandbox._guest import SANDBOX_UID
from stockade.sandbox._gvisor_areas import pack_area, unpack_area
from stockade.sandbox.snapshots import SnapshotStore
from tests.conftest import require


@pytest.fixture(autouse=True)
def _as_root() -> None:
    """Unpacking gives files to the sandbox's user: root only (in CI a missing root fails)."""
    require("root", os.geteuid() == 0, "unpacking gives files to the sandbox's user")


def _tree(root: Path) -> None:
    (root / "src/pkg").mkdir(parents=True)
    (root / "src/pkg/mod.py").write_text("x = 1\n")
    os.chmod(root / "src/pkg/mod.py", 0o755)
    os.utime(root / "src/pkg/mod.py", (1_000_000, 1_000_000))
    (root / "big.bin").write_bytes(os.urandom(300_000))
    os.link(root / "big.bin", root / "same.bin")
    (root / "inside").symlink_to("src/pkg/mod.py")
    (root / "outside").symlink_to("/etc/passwd")
    os.mkfifo(root / "fifo")


def _packed(source: Path, store: SnapshotStore) -> str:
    with store.reserve() as room:
        return store.add_file(pack_area(source, room))


def test_a_packed_area_unpacks_as_it_was(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    source, dest = tmp_path / "old", tmp_path / "new"
    source.mkdir()
    dest.mkdir()
    _tree(source)
    digest = _packed(source, store)
    unpack_area(store.check_object(digest), dest, max_bytes=1 << 20, max_entries=100)
    assert (dest / "src/pkg/mod.py").read_text() == "x = 1\n"
    assert (dest / "src/pkg/mod.py").stat().st_mtime == 1_000_000
    assert (dest / "src/pkg/mod.py").stat().st_mode & 0o777 == 0o755
    assert (dest / "big.bin").read_bytes() == (source / "big.bin").read_bytes()
    assert (dest / "same.bin").stat().st_ino == (dest / "big.bin").stat().st_ino
    assert os.readlink(dest / "inside") == "src/pkg/mod.py"
    assert not (dest / "fifo").exists()  # as the supervisor's archives: no FIFOs
    for path in [*dest.rglob("*")]:
        st = path.lstat()
        assert (st.st_uid, st.st_gid) == (SANDBOX_UID, SANDBOX_UID), path


def test_an_area_unpacks_its_links_out_but_never_writes_through_them(tmp_path: Path) -> None:
    """A sandbox's links to its own root (/usr/bin/python3, /etc) come back as they were;
    a tar whose member lies below a link is refused, nothing unpacked."""
    store = SnapshotStore(tmp_path / "store")
    source, dest = tmp_path / "old", tmp_path / "new"
    source.mkdir()
    dest.mkdir()
    _tree(source)
    unpack_area(store.check_object(_packed(source, store)), dest, max_bytes=1 << 20, max_entries=100)
    assert os.readlink(dest / "outside") == "/etc/passwd"
    hostile = tmp_path / "hostile.tar"
    with tarfile.open(hostile, "w", format=tarfile.PAX_FORMAT) as tar:
        link = tarfile.TarInfo("etc")
        link.type, link.linkname = tarfile.SYMTYPE, str(tmp_path / "victim")
        tar.addfile(link)
        data = b"owned"
        member = tarfile.TarInfo("etc/passwd")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    (tmp_path / "victim").mkdir()
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(StockadeError):
        unpack_area(hostile, other, max_bytes=1 << 20, max_entries=100)
    assert list(other.iterdir()) == [] and list((tmp_path / "victim").iterdir()) == []


def test_an_area_larger_than_the_new_tmpfs_is_an_incompatible_snapshot(tmp_path: Path) -> None:
    """It was ``FileTooLarge`` with a download's advice ("pass a larger max_bytes to
    files.download_dir"), which a restore has no way to take."""
    store = SnapshotStore(tmp_path / "store")
    source, dest = tmp_path / "old", tmp_path / "workspace"
    source.mkdir()
    dest.mkdir()
    with open(source / "holes", "wb") as fh:
        fh.truncate(2 << 20)
    with pytest.raises(SnapshotIncompatible, match=r"workspace does not fit .*'holes'") as refused:
        unpack_area(store.check_object(_packed(source, store)), dest, max_bytes=1 << 20, max_entries=100)
    assert not isinstance(refused.value, FileTooLarge)
    assert "download_dir" not in str(refused.value) and str(dest) not in str(refused.value)
