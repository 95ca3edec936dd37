"""The service's scratch folders: a run's seed, uploads being checked, downloads being packed.

They hold a tenant's files, so one that outlives its process (a worker killed with SIGKILL, an
out-of-memory kill) must not stay on the host's disk for good. Each is claimed while in use
(``_host.claim_folder``: a lock its process holds, which dies with it), and ``collect``
(``stockade gc``, and every server and worker as it starts) removes the ones nobody holds.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from stockade.sandbox._host import claim_folder, claimed, collect_staging, release_folder

__all__ = ["Kind", "collect", "scratch"]

Kind = Literal["run", "artifacts", "workspace", "upload", "download"]
CLAIM = "claim"
_NAME = re.compile(r"stockade-(run|artifacts|workspace|upload|download)-[0-9a-f]{16}")


@contextlib.contextmanager
def scratch(kind: Kind, parent: Path | None = None) -> Iterator[Path]:
    """A new folder under ``parent`` (the system's temporary folder by default), removed when
    the block ends, and by ``collect`` if this process dies first."""
    folder = Path(parent or tempfile.gettempdir()) / f"stockade-{kind}-{secrets.token_hex(8)}"
    claim_folder(folder, file=CLAIM)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        release_folder(folder)


def collect(parent: Path | None = None) -> list[str]:
    """Remove the scratch folders under ``parent`` whose process is gone."""
    base = Path(parent or tempfile.gettempdir())
    removed: list[str] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    collect_staging(base)  # a process killed between its folder's staging and its rename
    for folder in entries:
        if not _NAME.fullmatch(folder.name) or not _ours(folder) or claimed(folder, CLAIM):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(f"service scratch folder {folder.name}")
    return removed


def _ours(folder: Path) -> bool:
    """A folder (not a link) of this user's with a claim file: another user's look-alike in a
    shared temporary folder is not ours to remove."""
    try:
        info = folder.lstat()
        return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and (folder / CLAIM).is_file()
    except OSError:
        return False
