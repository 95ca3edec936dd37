"""Processes and threads that open a fresh SQLite run store at once all get it: the first
opener turns it to WAL mode, and SQLite told one of the others "database is locked" without
waiting (where two connections upgrading their locks could deadlock): CI run 112 failed on it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from stockade import exceptions as exc
from stockade.audit import SQLiteStore
from stockade.runs._db import SQLiteDatabase

# the run store's database and the audit store open a file alike (often the same file)
OPENERS: dict[str, Callable[[Path], None]] = {
    "run store": lambda path: SQLiteDatabase(path).close(),
    "audit store": lambda path: SQLiteStore(path).close(),
}


@pytest.mark.parametrize("opener", OPENERS)
def test_openers_of_a_fresh_file_at_once_all_get_it(tmp_path: Path, opener: str) -> None:
    failures: list[exc.StockadeError] = []
    for round_ in range(200):  # one round in ~60 failed before
        barrier = threading.Barrier(8)

        def open_it(path: Path = tmp_path / f"runs-{round_}.db", start: threading.Barrier = barrier) -> None:
            start.wait()
            try:
                OPENERS[opener](path)
            except (exc.RunStoreError, exc.AuditStoreError) as error:
                failures.append(error)

        threads = [threading.Thread(target=open_it) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert failures == []
