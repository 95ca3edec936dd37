"""The service's scratch folders: a run's seed, uploads being checked, downloads being packed.

They hold a tenant's files, so one that outlives its process (a worker killed with SIGKILL, an
out-of-memory kill) must not stay on the host's disk for good. Each is claimed while in use
(``_host.claim_folder``: a lock its process holds, which dies with it), and ``collect``
(``stockade gc``, and every server and worker as it starts) removes the ones nobody holds.

Versions before the claims made them with ``tempfile.TemporaryDirectory`` (``stockade-run-``
and 8 characters of its alphabet): nothing says whether their process lives. ``collect``
removes them once unchanged for a day (``OLD_AGE_S``): no version that makes them runs after an
upgrade but one still running through it, and it changes its folders as it fills them. The
limit left: such a process that holds a folder unchanged for over a day (a run's seed, for a
run that long) loses it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from stockade.sandbox._host import claim_folder, claimed, collect_staging, release_folder

__all__ = ["Kind", "collect", "scratch"]

Kind = Literal["run", "artifacts", "workspace", "upload", "download"]
CLAIM = "claim"
_NAME = re.compile(r"stockade-(run|artifacts|workspace|upload|download)-[0-9a-f]{16}")
# A previous version's (tempfile's names): unclaimed, removed once unchanged for OLD_AGE_S.
_OLD_NAME = re.compile(r"stockade-(run|artifacts|workspace|upload|download)-[a-z0-9_]{8}")
OLD_AGE_S = 24 * 3600


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
        if _OLD_NAME.fullmatch(folder.name) and _old_and_ours(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(
                f"service scratch folder {folder.name} (a previous version's, unchanged for a day)"
            )
            continue
        if not _NAME.fullmatch(folder.name) or not _ours(folder) or claimed(folder, CLAIM):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(f"service scratch folder {folder.name}")
    return removed


def _old_and_ours(folder: Path) -> bool:
    """A previous version's folder (not a link) of this user's, unchanged for ``OLD_AGE_S``."""
    try:
        info = folder.lstat()
    except OSError:
        return False
    idle = time.time() - info.st_mtime
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and idle > OLD_AGE_S


def _ours(folder: Path) -> bool:
    """A folder (not a link) of this user's with a claim file: another user's look-alike in a
    shared temporary folder is not ours to remove."""
    try:
        info = folder.lstat()
        return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and (folder / CLAIM).is_file()
    except OSError:
        return False
