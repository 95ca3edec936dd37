"""What the tiers build once per version of stockade in the state folder, named after a digest
of their content: ``supervisor-<digest>`` (a container's, gVisor's or a microVM's supervisor),
``shared-<digest>`` (what every process sandbox binds) and ``microvm-initrd-<digest>.cpio``.

An upgrade changes the digests and the old builds stay; the state folder is tmpfs (/run) for
root, so they held host memory until a reboot. Each use marks a build (``touch``, a write at
most once an hour) and ``collect`` (``stockade gc``, and each process sandbox backend as it
starts) removes the builds unused for ``UNUSED_S``. Several versions may share one state
folder (a CI clone and a developer's checkout), so a build's name never says it is stale,
only its idleness; and a live sandbox binds the build it started with (a process sandbox's
/etc is in one) for as long as it runs, touching it no more: a build used since the oldest
live sandbox folder here was made stays too. What is missing when needed is built again.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
import time
from pathlib import Path

# A build nothing used for this long goes, far above TOUCH_EVERY_S (each use marks it).
UNUSED_S = 7 * 86400.0
# How stale a build's time may get before a use marks it again: a start pays a stat, and a
# write of the build's inode once an hour at most.
TOUCH_EVERY_S = 3600.0
# A sandbox's start may mark its build this long before it makes its folder (a backend marks
# it as it prepares): the folder's time is later than the sandbox's use of the build.
START_SLACK_S = 3600.0
_BUILT = re.compile(r"(?:supervisor|shared)-[0-9a-f]{16}|microvm-initrd-[0-9a-f]{16}\.cpio", re.ASCII)
# Half-made builds (a crash before their rename), gone after an hour, and half-removed ones.
_PARTIAL = (".supervisor-", ".shared-", ".initrd-")
_REMOVING = ".removing-"
# The tiers' sandbox folders in the state folder (process, container, gVisor, microVM).
_SANDBOXES = ("sbx-", "ctr-", "gv-", "vm-")
_used: set[str] = set()  # what this process used: never its own collection's to remove


def touch(build: Path) -> bool:
    """Marks ``build`` used now, unless it was within ``TOUCH_EVERY_S``; False if it is not there."""
    try:
        if time.time() - os.stat(build).st_mtime > TOUCH_EVERY_S:
            os.utime(build)
    except OSError:
        return False
    _used.add(str(build))
    return True


def collect(state_dir: Path, *, now: float | None = None) -> list[str]:
    """Remove the builds in ``state_dir`` unused for ``UNUSED_S`` and since before the oldest
    live sandbox folder there (less ``START_SLACK_S``), but none this process used."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        entries = list(state_dir.iterdir())
    except OSError:
        return removed
    before = min(now - UNUSED_S, _oldest_sandbox(entries, now) - START_SLACK_S)
    for path in entries:
        name = path.name
        if name.startswith(_REMOVING):
            _remove(path)  # a collection stopped half-way: nobody uses what it began to remove
        elif name.startswith(_PARTIAL):
            if _used_at(path) < now - 3600.0:
                _remove(path)
        elif _BUILT.fullmatch(name) and str(path) not in _used and take_away(path, before):
            removed.append(f"build {name}")
    return removed


def _used_at(path: Path) -> float:
    """When ``path`` was last used (infinity if it is gone: nothing to remove)."""
    try:
        return path.lstat().st_mtime
    except OSError:
        return float("inf")


def _oldest_sandbox(entries: list[Path], now: float) -> float:
    """When the oldest sandbox folder in the state folder was made, at the latest: the
    earliest time of it and its files (written as it starts). Negative infinity if one
    cannot be read: then every build stays."""
    oldest = now
    for path in entries:
        if not path.name.startswith(_SANDBOXES):
            continue
        try:
            times = [path.lstat().st_mtime]
            with os.scandir(path) as found:
                times += [entry.stat(follow_symlinks=False).st_mtime for entry in found]
        except FileNotFoundError:
            continue  # its sandbox ended while we looked
        except OSError:
            return float("-inf")
        oldest = min(oldest, *times)
    return oldest


def take_away(path: Path, before: float, aside: Path | None = None) -> bool:
    """Remove ``path`` (a build, a masked copy) if it was last used ``before``: renamed to
    ``aside`` first, so a start sees the whole of it or none (and makes it again); one a use
    marked between our look and the rename is put back."""
    if _used_at(path) >= before:
        return False
    hidden = aside or path.with_name(f"{_REMOVING}{path.name}-{secrets.token_hex(4)}")
    try:
        os.rename(path, hidden)
    except OSError:
        return False  # gone meanwhile, or another is removing it
    if _used_at(hidden) >= before:
        with contextlib.suppress(OSError):  # else made again meanwhile: ours goes
            os.rename(hidden, path)
            return False
    _remove(hidden)
    return True


def _remove(path: Path) -> None:
    try:
        if stat.S_ISDIR(path.lstat().st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
    except OSError:
        pass
