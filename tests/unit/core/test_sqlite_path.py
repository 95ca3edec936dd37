"""Which ``--db`` a command reads as a SQLite file: ``sqlite:///PATH`` or a bare path, never
another database's URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from stockade._state import sqlite_path


@pytest.mark.parametrize(
    ("given", "file"),
    [
        ("sqlite:///.stockade/audit.db", Path(".stockade/audit.db")),
        ("sqlite:////var/lib/stockade/service.db", Path("/var/lib/stockade/service.db")),
        ("runs.db", Path("runs.db")),
        ("/srv/audit.db", Path("/srv/audit.db")),
        ("postgresql://user@db/stockade", None),
        ("sqlite://relative.db", None),  # not sqlite:/// (three slashes): no file of ours
    ],
)
def test_a_database_given_as_a_sqlite_url_or_a_path_is_a_file(given: str, file: Path | None) -> None:
    assert sqlite_path(given) == file
