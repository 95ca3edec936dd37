"""A host folder copied into a sandbox (``tar_directory``): what the rules hide stays out, and
so does what holds it under another name."""

from __future__ import annotations

import io
import os
import tarfile
import tracemalloc
from pathlib import Path
from typing import Any

from stockade import Sandbox
from stockade.sandbox._transfers import TRANSFER_CHUNK
from stockade.sandbox.facade import tar_directory
from stockade.sandbox.ops import HostFolder, Op, PutArchive
from stockade.testing import FakeBackend

HIDE = ("secrets/**", ".env", ".git", ".git/**", "**/.git", "**/.git/**")


def project(root: Path) -> Path:
    (root / "src").mkdir()
    (root / "src" / "app.py").write_text("print('hi')\n")
    (root / "secrets").mkdir()
    (root / "secrets" / "key").write_text("TOPSECRET-1\n")
    (root / ".env").write_text("TOKEN=TOPSECRET-2\n")
    os.link(root / "secrets" / "key", root / "aaa-before")  # sorts before what it is
    os.link(root / ".env", root / "src" / "zz-after")  # and after
    for store in (".gitdata", "backup.git", "vendor/lib/.history"):  # git stores, any name
        (root / store / "objects" / "ab").mkdir(parents=True)
        (root / store / "refs" / "heads").mkdir(parents=True)
        (root / store / "HEAD").write_text("ref: refs/heads/main\n")
        (root / store / "objects" / "ab" / "cdef").write_text("TOPSECRET-3 (a blob, zlib'd in life)\n")
    # git stores without HEAD or refs: a copied objects/ (loose, packed), a bare store's remains
    for loose in ("old/objects/ab", "objects/ab", "attic/.git/objects/cd"):
        (root / loose).mkdir(parents=True)
        (root / loose / ("0" * 38)).write_text("TOPSECRET-5 (a loose object)\n")
    for packed in ("archive/objects/pack", "saved/pack"):
        (root / packed).mkdir(parents=True)
        (root / packed / "pack-1.pack").write_text("TOPSECRET-6 (a pack)\n")
    (root / ".svn" / "pristine" / "00").mkdir(parents=True)
    (root / ".svn" / "pristine" / "00" / "key.svn-base").write_text("TOPSECRET-4\n")
    (root / ".hg" / "store").mkdir(parents=True)
    return root


def members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {
            m.name: (tar.extractfile(m).read() if m.isreg() else b"")  # type: ignore[union-attr]
            for m in tar.getmembers()
        }


def test_hidden_files_stay_out_under_their_other_names_and_in_repository_history(tmp_path: Path) -> None:
    copied = members(tar_directory(project(tmp_path), HIDE))
    assert set(copied) == {"src", "src/app.py", "vendor", "vendor/lib", "attic"}
    assert not any(b"TOPSECRET" in content for content in copied.values())


def test_with_nothing_hidden_everything_comes_and_hard_links_stay_links(tmp_path: Path) -> None:
    root = project(tmp_path)
    with tarfile.open(fileobj=io.BytesIO(tar_directory(root))) as tar:
        kinds = {m.name: m for m in tar.getmembers()}
    assert {"secrets/key", ".env", ".gitdata/HEAD", ".svn/pristine/00/key.svn-base"} <= set(kinds)
    assert kinds["secrets/key"].islnk() and kinds["secrets/key"].linkname == "aaa-before"


MiB = 1024 * 1024


def test_an_upload_is_packed_as_it_is_sent_a_chunk_at_a_time(tmp_path: Path) -> None:
    """The host never holds the folder's tar: a 64 MiB file goes out in 4 MiB pieces (what
    ``files.write`` sends) with the host's memory at a few pieces. Built whole, the tar of a
    560 MiB folder took 1.2 GB, and its one frame killed the sandbox's supervisor."""
    folder = tmp_path / "src"
    folder.mkdir()
    with open(folder / "data.bin", "wb") as f:
        f.truncate(64 * MiB)
    pieces: list[int] = []

    def sandbox(op: Op[Any]) -> None:
        assert isinstance(op, PutArchive) and op.folder is not None
        pieces.extend(len(chunk) for chunk in op.folder.chunks(TRANSFER_CHUNK))

    with Sandbox.create(backend=FakeBackend(sandbox)) as sbx:
        tracemalloc.start()
        try:
            sbx.files.upload_dir(folder)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert sum(pieces) > 64 * MiB and max(pieces) == TRANSFER_CHUNK
    assert peak < 4 * TRANSFER_CHUNK, f"the host held {peak / MiB:.0f} MiB at once"


def test_the_stream_is_the_archive_tarfile_makes(tmp_path: Path) -> None:
    """Links, long names, empty files: the same bytes whatever the piece size."""
    root = project(tmp_path)
    (root / ("long-" * 40)).write_bytes(os.urandom(5000))
    (root / "empty").touch()
    os.symlink("src/app.py", root / "alias")
    whole = tar_directory(root, HIDE)
    for size in (512, 1000, 1 << 20):
        pieces = list(HostFolder(source=root, hide=HIDE).chunks(size))
        assert all(len(p) == size for p in pieces[:-1]) and 0 < len(pieces[-1]) <= size
        assert b"".join(pieces) == whole
    assert len(whole) % tarfile.RECORDSIZE == 0
    assert members(whole)["long-" * 40] == (root / ("long-" * 40)).read_bytes()
