"""A host folder copied into a sandbox (``tar_directory``): what the rules hide stays out, and
so does what holds it under another name."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

from stockade.sandbox.facade import tar_directory

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
    assert set(copied) == {"src", "src/app.py", "vendor", "vendor/lib"}
    assert not any(b"TOPSECRET" in content for content in copied.values())


def test_with_nothing_hidden_everything_comes_and_hard_links_stay_links(tmp_path: Path) -> None:
    root = project(tmp_path)
    with tarfile.open(fileobj=io.BytesIO(tar_directory(root))) as tar:
        kinds = {m.name: m for m in tar.getmembers()}
    assert {"secrets/key", ".env", ".gitdata/HEAD", ".svn/pristine/00/key.svn-base"} <= set(kinds)
    assert kinds["secrets/key"].islnk() and kinds["secrets/key"].linkname == "aaa-before"
