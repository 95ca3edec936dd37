"""Files of this user's alone: the records, keys, messages, approvals and workspaces stockade
keeps on the host.

Each is made 0600 and each folder made for them 0700, at creation, whatever the umask: with
the common 022 they were readable by every local user, who could copy an audit store's sealing
keys before erasure destroyed them (crypto-shredding then erases nothing), or read every
tenant's messages in the service's database. SQLite makes its ``-wal``, ``-shm`` and journal
with the database file's mode, so the database file is made first, here. A file or folder that
exists is left as it is (its owner may share it on purpose); a database that others can read
is reported once, as a warning, when it is opened.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

__all__ = ["create_private", "private_database", "private_dir", "replace_private", "write_private"]

FILE_MODE = 0o600
DIR_MODE = 0o700
_log = logging.getLogger("stockade")


def private_dir(folder: Path) -> Path:
    """``folder`` with each missing folder on its way made 0700 (``Path.mkdir(parents=True)``
    gives the parents the umask's mode)."""
    missing: list[Path] = []
    at = folder
    while not os.path.lexists(at) and at != at.parent:
        missing.append(at)
        at = at.parent
    for each in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            each.mkdir(mode=DIR_MODE)
    return folder


def create_private(path: Path) -> TextIO:
    """``path`` opened to write text, truncated; a new file is made 0600 (an existing one,
    which its owner named, keeps its mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    return os.fdopen(fd, "w", encoding="utf-8")


@contextlib.contextmanager
def replace_private(path: Path) -> Iterator[TextIO]:
    """``path`` written as a new file, renamed over it once the writer is done: until then the
    file of that name is left whole, and a writer that fails leaves it as it was (an export
    truncated its output, the database it was reading, before the first read). A new file is
    0600, one that exists keeps its mode; through a symlink its target is written. What is no
    regular file (a FIFO, ``/dev/stdout``) cannot be replaced, and is written as it is."""
    target = Path(os.path.realpath(path))
    try:
        mode: int | None = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        with create_private(path) as stream:
            yield stream
        return
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        if mode is not None:
            os.fchmod(fd, stat.S_IMODE(mode))
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())  # whole on disk before it takes the name
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, a file of mode 0600 (a leftover file of that name too)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        os.fchmod(fd, FILE_MODE)  # before any byte: a leftover kept its earlier mode
        fh.write(text)


def private_database(path: Path, holds: str) -> None:
    """Make the SQLite file ``path`` (empty: SQLite takes it for a new database) 0600 in a
    0700 folder before SQLite opens it; an existing one others can read is warned about.
    ``holds``: what it holds, for the warning."""
    if str(path) == ":memory:" or str(path).startswith("file:"):
        return
    private_dir(path.parent)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE))
        return
    except FileExistsError:
        pass
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if stat.S_IMODE(mode) & 0o077:
        _log.warning(
            "%s (%s) is open to other users (mode %o): chmod 600 it and its -wal and -shm files, "
            "and 700 its folder",
            path,
            holds,
            stat.S_IMODE(mode),
        )
