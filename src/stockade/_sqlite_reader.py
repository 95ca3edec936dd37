"""A SQLite file read by a reader that must not change it (``audit verify``, the run viewer,
``runs list``): nothing is written into it, and nothing is made beside it.

``mode=ro`` alone is not enough: on a database in WAL mode whose ``-wal`` is gone (no writer
has it open) SQLite makes a ``-wal`` and a ``-shm`` beside it, and leaves them there; in a
read-only folder it cannot make them and fails. Such a file holds everything in its main
file, so it is read ``immutable`` (no locks, no side files). That reader would miss a writer
that starts later, so before each query it looks again: a ``-wal`` that appeared, or a main
file that changed, opens a new connection (an ordinary WAL reader once there is a ``-wal``);
a file that changed during a query (a writer came, wrote and checkpointed meanwhile) is read
again.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["SQLiteReader"]

_WAL = 2  # bytes 18 and 19 of the header, the file format versions: 2 for WAL
_ATTEMPTS = 5  # reads of a file that changed meanwhile, before reading it as a WAL reader


class _Sight(NamedTuple):
    """How the file looked: a change of any of these is a writer's."""

    immutable: bool
    inode: int
    size: int
    mtime_ns: int


class SQLiteReader:
    """One read-only connection to ``path``, renewed when the file changed under it.

    ``sqlite3.Error`` for a file that is missing (a reader never makes an empty database) or
    cannot be read; ``connect`` gives a connection of its own for a long read."""

    def __init__(self, path: Path, *, timeout_s: float = 30.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._sight: _Sight | None = None
        self._look()  # a missing file fails here, at open

    def _look(self) -> _Sight:
        try:
            # O_NONBLOCK: a FIFO given as the database (`--db sqlite:///a-fifo`) would hold
            # the open until a writer came; any file but a regular one is refused
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise sqlite3.OperationalError(f"cannot read {self.path}: not a regular file")
                header = os.pread(fd, 20, 0)
            finally:
                os.close(fd)
        except OSError as error:
            raise sqlite3.OperationalError(f"cannot read {self.path}: {error.strerror}") from error
        wal = len(header) == 20 and header[18] == _WAL
        immutable = wal and not os.path.exists(f"{self.path}-wal")
        return _Sight(immutable, st.st_ino, st.st_size, st.st_mtime_ns)

    def _open(self, sight: _Sight) -> sqlite3.Connection:
        uri = f"{self.path.resolve().as_uri()}?mode=ro" + ("&immutable=1" if sight.immutable else "")
        return sqlite3.connect(
            uri, uri=True, isolation_level=None, check_same_thread=False, timeout=self.timeout_s
        )

    def connect(self) -> tuple[sqlite3.Connection, Callable[[], bool]]:
        """A connection of its own for a long read (the caller closes it), opened as the file is
        now, and whether the file is still as it was then (a read through a connection opened
        ``immutable`` is whole only if so)."""
        sight = self._look()
        return self._open(sight), lambda: not sight.immutable or self._look() == sight

    def query(self, sql: str, params: Sequence[object] = ()) -> list[Any]:
        """The rows, as ``fetchall`` gives them."""
        with self._lock:
            for attempt in range(_ATTEMPTS):
                sight = self._look()
                if attempt == _ATTEMPTS - 1:  # a writer is at work: read under its locks, as WAL does
                    sight = sight._replace(immutable=False)
                if self._conn is None or sight != self._sight:
                    if self._conn is not None:
                        self._conn.close()
                    self._conn, self._sight = self._open(sight), sight
                rows: list[Any] = self._conn.execute(sql, tuple(params)).fetchall()
                if not sight.immutable or self._look() == sight:
                    return rows
            raise AssertionError("the last attempt reads without immutable")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
