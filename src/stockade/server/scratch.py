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
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from stockade.sandbox._host import claim_folder, claimed, collect_staging, release_folder

__all__ = ["Kind", "collect", "remove_tree", "scratch"]

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
        try:
            remove_tree(folder)
        finally:  # held, the folder is one collect skips: its bytes stay while the server runs
            release_folder(folder)


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def remove_tree(folder: Path) -> None:
    """Remove ``folder`` and all it holds, as far as it can (never raises an ``OSError``),
    whatever its depth or its folders' modes. Not ``shutil.rmtree``: it recurses (a tar of
    1,100 nested folders made a RecursionError that ``ignore_errors`` does not catch) and
    holds a descriptor a level. Here each folder met is first moved up beside ``folder``'s
    own children, so that no more than two are open and no path is longer than two names;
    by descriptor, never through a link."""
    try:
        root = os.open(folder, _DIR)
    except OSError:
        return
    tag = f".rm-{secrets.token_hex(8)}-"  # the moved folders' names: none of the tree's
    moved = 0
    try:
        todo = _empty(root)
        while todo:
            name = todo.pop()
            try:
                fd = os.open(name, _DIR, dir_fd=root)
            except OSError:
                continue
            try:
                for child in _empty(fd):
                    moved += 1
                    with contextlib.suppress(OSError):
                        os.rename(child, f"{tag}{moved}", src_dir_fd=fd, dst_dir_fd=root)
                        todo.append(f"{tag}{moved}")
            finally:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=root)
    finally:
        os.close(root)
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def _empty(fd: int) -> list[str]:
    """Unlink what folder ``fd`` holds but folders; the names of its folders."""
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o700)  # a mode from the archive (0500) must not keep its contents
    try:
        with os.scandir(fd) as listing:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in listing]
    except OSError:
        return []
    for name, is_dir in entries:
        if not is_dir:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)
    return [name for name, is_dir in entries if is_dir]


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
            remove_tree(folder)
            removed.append(
                f"service scratch folder {folder.name} (a previous version's, unchanged for a day)"
            )
            continue
        if not _NAME.fullmatch(folder.name) or not _ours(folder) or claimed(folder, CLAIM):
            continue
        remove_tree(folder)
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
