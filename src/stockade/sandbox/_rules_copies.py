"""Masked copies of program folders: a folder's tree made of hard links in which the masked
programs are empty files only root may read, bound over the folder in one mount
(``masked_folder``); the cache that keeps them on the host within a budget, what live
sandboxes bind of them (``masks_in_use``, read by every tier and by ``stockade gc``), and
their collection (``collect_masked``).

Apart from the binds (``_rules_binds``) because the copies outlive any sandbox: they are
files of the host, shared by every tier's sandboxes and collected without a backend.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stockade.sandbox._builds import take_away

# A masked copy no sandbox has used for this long is removed (each use touches it), unless a
# live sandbox lists it; a build left half-done by a crash, after an hour.
MASKED_UNUSED_S = 7 * 86400
# The cache's budget, held when a copy is built. Each distinct set of masks in a folder is a
# copy (an allowlist's, up to ~40), so without one a host running many policies grew by a
# copy of /usr/bin and more per policy, for a week. Each copy costs at least a folder
# (a 4 KiB block and an inode): 1,000 of them, ~4 MiB.
MASKED_COPIES_MAX = 1000
# Each entry is a name in a folder of the copy (~40 bytes) and each masked one an inode too:
# 250,000 of them, some 25 MiB at most.
MASKED_ENTRIES_MAX = 250_000
# (folder, its identity, names) -> the masked copy, and the folders beneath as they were; the
# latest MASKED_COPIES_MAX used, as the cache holds no more.
_masked: OrderedDict[tuple[Any, ...], tuple[Path, tuple[tuple[str, int, int, int], ...]]] = OrderedDict()


@dataclass(frozen=True)
class MaskCache:
    """Where masked copies are kept (``folder``), what live sandboxes bind of them
    (``in_use``: the copies' paths, asked only when one must go to make room) and how many
    copies and entries it may hold."""

    folder: Path
    in_use: Callable[[], Collection[str]]
    copies: int = MASKED_COPIES_MAX
    entries: int = MASKED_ENTRIES_MAX


def masked_folders() -> Path:
    """Where a host that runs as root keeps its masked copies of program folders:
    ``STOCKADE_MASK_CACHE``, else /var/cache/stockade, on the file system of the programs
    themselves (/usr), as hard links need (elsewhere, each program is bound instead)."""
    return Path(os.environ.get("STOCKADE_MASK_CACHE") or "/var/cache/stockade")


def collect_masked(cache: Path, in_use: set[str], *, now: float | None = None) -> list[str]:
    """Remove the masked copies in ``cache`` unused for ``MASKED_UNUSED_S`` that no live
    sandbox lists in ``in_use`` (removing one in use would empty a folder under a sandbox),
    and the stripped programs no copy links any more."""
    now = time.time() if now is None else now
    removed: list[str] = []
    for copy, used, _ in _copies(cache):
        if (
            now - used > MASKED_UNUSED_S
            and str(copy) not in in_use
            and _remove_copy(copy, now - MASKED_UNUSED_S)
        ):
            removed.append(f"masked copy {copy.name}")
    for left in (*cache.glob(".masked-*"), *cache.glob(".stripped-*"), *cache.glob("stripped-*")):
        try:
            st = left.lstat()
        except OSError:
            continue
        # a build left half-done, or a stripped program no copy links any more (its only link)
        done = left.name.startswith("stripped-")
        if now - st.st_mtime > 3600.0 and (not done or st.st_nlink == 1):
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(left, ignore_errors=True)
            else:
                left.unlink(missing_ok=True)
            removed.append(f"masked copy {left.name}")
    return removed


def _copies(cache: Path) -> list[tuple[Path, float, int]]:
    """The masked copies in ``cache``: (path, last used, entries), least lately used first."""
    found = []
    for copy in cache.glob("masked-*"):
        try:
            used = copy.stat().st_mtime
        except OSError:
            continue
        # a copy's entries are in its name; one named before that counts as the most there can be
        named = _COPY_NAME.fullmatch(copy.name)
        found.append((copy, used, int(named[1]) if named else MASKED_TREE_ENTRIES))
    return sorted(found, key=lambda c: c[1])


_COPY_NAME = re.compile(r"masked-[0-9a-f]{16}-([0-9]{1,9})")


def _remove_copy(copy: Path, used_before: float) -> bool:
    """Remove ``copy`` unless a use touched it since ``used_before`` (``_builds.take_away``:
    a use from then on finds it gone, ``_touch`` fails, and it is built again)."""
    return take_away(copy, used_before, copy.with_name(f".masked-removing-{copy.name}-{os.getpid()}"))


# A copy is evicted to make room only when unused for longer than this: a use in the last
# TOUCH_EVERY_S may not have touched it, and a sandbox lists what it binds only after it got
# the copy (the extra ten minutes: a start held up between the two).
EVICTABLE_IDLE_S = 3600.0 + 600.0


def _make_room(cache: MaskCache, entries: int) -> bool:
    """Whether a copy of ``entries`` entries fits in ``cache``'s budget, once the copies least
    lately used, unused for ``EVICTABLE_IDLE_S`` and bound by no live sandbox, are removed
    (removing one bound would empty a folder under a sandbox)."""
    copies = _copies(cache.folder)
    count, total = len(copies), sum(weight for _, _, weight in copies)
    if count < cache.copies and total + entries <= cache.entries:
        return True
    in_use = set(cache.in_use())
    cutoff = time.time() - EVICTABLE_IDLE_S
    for copy, used, weight in copies:
        if used > cutoff:
            return False  # the rest were used later
        if str(copy) not in in_use and _remove_copy(copy, cutoff):
            count, total = count - 1, total - weight
            if count < cache.copies and total + entries <= cache.entries:
                return True
    return False


# What a sandbox's run folder lists of the masked copies it binds, one a line: garbage
# collection keeps those (``masks_in_use``).
MASKS_FILE = "masks"
# The run folders of every tier's sandboxes in a state folder: the process tier's, Docker's
# containers and runsc's bundles.
RUN_FOLDERS = ("sbx-*", "ctr-*", "gv-*")


def masks_in_use(state_dir: Path) -> set[str]:
    """The masked copies the sandboxes of ``state_dir`` bind, whatever their tier (the ones
    gone too, until their tier's garbage collection removes their folders)."""
    in_use: set[str] = set()
    for pattern in RUN_FOLDERS:
        for rundir in state_dir.glob(pattern):
            with contextlib.suppress(OSError):
                in_use.update((rundir / MASKS_FILE).read_text().split())
    return in_use


# A folder whose tree holds more entries than this is not copied (its programs are bound one
# by one): /usr/lib's tree would cost a start's walk and the cache's inodes.
MASKED_TREE_ENTRIES = 5000


def masked_folder(folder: Path, names: frozenset[str], cache: MaskCache | None) -> Path | None:
    """A copy of ``folder``'s tree made of hard links (no data copied; setuid, setgid and
    capable programs are one copy without their privilege, shared), in which each of ``names`` (paths
    relative to ``folder``) is an empty file that only root may read: bound over the folder,
    it hides those programs as the /dev/null binds do, in one mount. None where it cannot
    be made (no cache, another file system, a special file, a tree over
    ``MASKED_TREE_ENTRIES``, a cache over its budget with every copy used lately): then
    each program is bound.

    Made once per host and state of the tree: the copy is named after the inode and
    modification time of each of its folders, which a package manager changes when it adds,
    removes or replaces (renames over) a file, so a stale copy is never used; a file
    rewritten in place is the same inode, seen through the link."""
    if cache is None:
        return None
    try:
        st = os.stat(folder)
    except OSError:
        return None
    key = (str(folder), st.st_dev, st.st_ino, st.st_mtime_ns, tuple(sorted(names)))
    known = _masked.get(key)
    if known is not None and _same_folders(known[1]) and _touch(known[0]):
        _masked.move_to_end(key)
        return known[0]
    tree = _folders_beneath(folder)
    if tree is None:
        return None
    folders, entries = tree
    name = hashlib.sha256(repr((key, folders)).encode()).hexdigest()[:16]
    target = cache.folder / f"masked-{name}-{entries}"
    if not _touch(target):  # not there: built, if the budget has room
        try:
            cache.folder.mkdir(parents=True, exist_ok=True, mode=0o755)
            if not _make_room(cache, entries):
                return None
            _build_masked(folder, names, cache.folder, target)
        except OSError:
            return None
    _masked[key] = (target, folders)
    _masked.move_to_end(key)
    while len(_masked) > MASKED_COPIES_MAX:
        _masked.popitem(last=False)
    return target


def _folders_beneath(folder: Path) -> tuple[tuple[tuple[str, int, int, int], ...], int] | None:
    """Each folder beneath ``folder`` (links not followed): (path, device, inode, mtime), and
    how many entries its tree holds; None if more than ``MASKED_TREE_ENTRIES``."""
    found: list[tuple[str, int, int, int]] = []
    todo, entries = [str(folder)], 0
    while todo:
        try:
            with os.scandir(todo.pop()) as listing:
                for entry in listing:
                    entries += 1
                    if entries > MASKED_TREE_ENTRIES:
                        return None
                    if entry.is_dir(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        found.append((entry.path, st.st_dev, st.st_ino, st.st_mtime_ns))
                        todo.append(entry.path)
        except OSError:
            return None
    return tuple(sorted(found)), entries


def _same_folders(folders: tuple[tuple[str, int, int, int], ...]) -> bool:
    for path, dev, ino, mtime in folders:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        if (st.st_dev, st.st_ino, st.st_mtime_ns) != (dev, ino, mtime):
            return False
    return True


# How stale a copy's time may get before a use marks it again: far below MASKED_UNUSED_S, and
# a start then pays a stat, not a write of the folder's inode each time.
TOUCH_EVERY_S = 3600.0


def _touch(copy: Path) -> bool:
    """Marks the copy used now (``collect_masked`` keeps what was used lately) unless it was
    within the hour; False if it is not there."""
    try:
        st = os.stat(copy)
        if not stat.S_ISDIR(st.st_mode):
            return False
        if time.time() - st.st_mtime > TOUCH_EVERY_S:
            os.utime(copy)
    except OSError:
        return False
    return True


def _build_masked(folder: Path, names: frozenset[str], cache: Path, target: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=".masked-", dir=cache))
    try:
        _link_tree(folder, tmp, names, "", cache)
        os.rename(tmp, target)  # whole or not at all: another process may build the same
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():
            raise


def _link_tree(folder: Path, dest: Path, names: frozenset[str], prefix: str, cache: Path) -> None:
    """``folder``'s entries into ``dest`` (made), linked, and ``names`` (relative to the
    copy's top: ``prefix`` is where this folder is in it) empty and unreadable."""
    with os.scandir(folder) as entries:
        for entry in entries:
            into = dest / entry.name
            if prefix + entry.name in names:
                os.close(os.open(into, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0))
            elif entry.is_symlink():
                os.symlink(os.readlink(entry.path), into)
            elif entry.is_dir(follow_symlinks=False):
                into.mkdir()
                _link_tree(Path(entry.path), into, names, f"{prefix}{entry.name}/", cache)
            elif entry.is_file(follow_symlinks=False):
                source = _stripped(entry, cache) if _privileged(entry) else entry.path
                os.link(source, into, follow_symlinks=False)
            else:
                raise OSError(f"{entry.path}: a special file, not linked")
    os.chmod(dest, os.stat(folder).st_mode & 0o7777)


def _privileged(entry: os.DirEntry[str]) -> bool:
    """Whether running the file gives privilege: setuid, setgid, or file capabilities."""
    if entry.stat(follow_symlinks=False).st_mode & 0o6000:
        return True
    try:
        os.getxattr(entry.path, "security.capability", follow_symlinks=False)
    except OSError:
        return False
    return True


def _stripped(entry: os.DirEntry[str], cache: Path) -> Path:
    """A copy of the privileged program ``entry`` without its privilege, in ``cache``, that
    every masked copy links: a link to the program itself would keep an old setuid or
    capable program reachable there after the host upgrades it, and a copy in each masked
    copy cost a host's /usr/bin ~1 MB a copy. Named after the program's inode and change
    time (an upgrade or a chmod makes another); removed once no copy links it."""
    st = entry.stat(follow_symlinks=False)
    path = cache / f"stripped-{st.st_dev}-{st.st_ino}-{st.st_ctime_ns}"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(prefix=".stripped-", dir=cache)
        os.close(fd)
        try:
            shutil.copyfile(entry.path, tmp, follow_symlinks=False)
            os.chmod(tmp, st.st_mode & 0o777)
            os.rename(tmp, path)  # whole or not at all; another build's is the same
        except OSError:
            os.unlink(tmp)
            raise
    return path
