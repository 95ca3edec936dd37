"""The one way a writer of ours opens a SQLite file (the audit store, the run store, often the
same file): WAL mode, ``synchronous=NORMAL`` (a committed write survives the process being
killed; a power cut may lose the last commits, never corrupt the file), a busy timeout."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

__all__ = ["connect"]

_WAL_ATTEMPTS = 40  # ~4 s of waits in all


def connect(path: Path, *, timeout_s: float = 30.0) -> sqlite3.Connection:
    """A connection to ``path`` in WAL mode; ``sqlite3.Error`` if it cannot be had. A fresh
    file takes the mode from its first opener: of several opening it at once, SQLite answers
    "database is locked" to one without waiting out the busy timeout (it will not wait where
    two connections upgrading their locks could deadlock; CI run 112), so the switch is asked
    again: the mode is there by then, or this one sets it."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=timeout_s)
    try:
        for attempt in range(_WAL_ATTEMPTS):
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as error:
                if "locked" not in str(error) or attempt == _WAL_ATTEMPTS - 1:
                    raise
                time.sleep(0.005 * (attempt + 1))
        conn.execute("PRAGMA synchronous=NORMAL")
    except BaseException:
        conn.close()
        raise
    return conn
