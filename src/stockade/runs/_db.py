"""The two SQL databases a run store can live in, behind three methods.

SQL is written once, with ``?`` placeholders and the syntax SQLite (3.24+) and PostgreSQL
share (``INSERT ... ON CONFLICT ... DO UPDATE SET x = excluded.x``); the PostgreSQL side
swaps the placeholders. Each ``write`` is one transaction; its ``require`` is a query run
first, in the same transaction, that must find a row (the lease of the run being written is
still the writer's): without one nothing is written and ``write`` returns False. SQLite's
``BEGIN IMMEDIATE`` already excludes other writers; PostgreSQL locks the row found
(``FOR UPDATE``), so that a takeover of the lease waits for the write to commit.

Opened ``read_only`` (for readers that must not change what they read: ``audit verify``, the
run viewer, ``runs list``), a database writes nothing: SQLite's file is read as
``SQLiteReader`` reads it (never made, nothing made beside it), PostgreSQL's transactions
are ``READ ONLY``, and ``write`` is refused.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from stockade import _sqlite_writer as sqlite_writer
from stockade import exceptions as exc
from stockade._private import private_database
from stockade._sqlite_reader import SQLiteReader

if TYPE_CHECKING:
    import psycopg

__all__ = ["Database", "PostgresDatabase", "Requirement", "SQLiteDatabase", "Statement", "display_url"]

# One statement and the parameter rows it runs with (executemany).
Statement = tuple[str, Sequence[Sequence[object]]]
# A query that must find a row for a write to happen, and its parameters.
Requirement = tuple[str, Sequence[object]]
Rows = list[tuple[object, ...]]


class Database(Protocol):
    url: str
    serial: str  # the column type of an auto-numbered primary key
    blob: str  # the column type of bytes
    read_only: bool  # a reader's: ``write`` is refused, nothing is created

    def write(self, statements: Sequence[Statement], *, require: Requirement | None = None) -> bool:
        """Run all ``statements`` in one transaction (none when ``require`` finds no row: False)."""

    def query(self, sql: str, params: Sequence[object] = ()) -> Rows: ...

    def create(self, statements: Sequence[str], *, name: str) -> None:
        """Run the ``CREATE ... IF NOT EXISTS`` statements of the tables ``name`` names, one
        process at a time (processes started together race on them otherwise)."""

    def add_column(self, table: str, column: str, declaration: str) -> None:
        """Add ``column`` to ``table`` unless it has it (a database made by an earlier version)."""

    def columns(self, table: str) -> set[str]:
        """The columns ``table`` has (none: there is no such table)."""

    def close(self) -> None: ...


class SQLiteDatabase:
    """One connection in WAL mode, shared by threads under a lock.

    A committed write survives the process being killed (it is in the WAL); with
    ``synchronous=NORMAL`` a power cut may lose the last commits, never corrupt the file.
    """

    serial = "INTEGER PRIMARY KEY"
    blob = "BLOB"

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.url = f"sqlite:///{self.path}"
        self.read_only = read_only
        self._lock = threading.Lock()
        self._reader: SQLiteReader | None = None
        if read_only:
            try:
                self._reader = SQLiteReader(self.path)
            except sqlite3.Error as error:
                raise exc.RunStoreError(f"cannot open the run store {self.path}: {error}") from error
            return
        private_database(self.path, "runs, their messages and keys")
        try:
            self._conn = sqlite_writer.connect(self.path)
        except sqlite3.Error as error:
            raise exc.RunStoreError(f"cannot open the run store {self.path}: {error}") from error

    def create(self, statements: Sequence[str], *, name: str) -> None:
        self.write([(sql, [()]) for sql in statements])  # BEGIN IMMEDIATE: one writer at a time

    def add_column(self, table: str, column: str, declaration: str) -> None:
        # SQLite has no ADD COLUMN IF NOT EXISTS: the check and the change in one transaction
        have = {str(r[1]) for r in self.query(f"PRAGMA table_info({table})")}
        if column in have:
            return
        try:
            self.write([(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}", [()])])
        except exc.RunStoreError:
            if column not in {str(r[1]) for r in self.query(f"PRAGMA table_info({table})")}:
                raise  # another process did not add it first: a failure of its own

    def columns(self, table: str) -> set[str]:
        return {str(r[1]) for r in self.query(f"PRAGMA table_info({table})")}

    def write(self, statements: Sequence[Statement], *, require: Requirement | None = None) -> bool:
        _writable(self)
        with self._lock:
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    if require is not None and conn.execute(require[0], tuple(require[1])).fetchone() is None:
                        conn.execute("ROLLBACK")
                        return False
                    for sql, rows in statements:
                        conn.executemany(sql, rows)
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
            except sqlite3.Error as error:
                raise exc.RunStoreError(f"run store {self.path}: {error}") from error
            return True

    def query(self, sql: str, params: Sequence[object] = ()) -> Rows:
        try:
            if self._reader is not None:
                return self._reader.query(sql, params)
            with self._lock:
                return self._conn.execute(sql, tuple(params)).fetchall()
        except sqlite3.Error as error:
            raise exc.RunStoreError(f"run store {self.path}: {error}") from error

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            return
        with self._lock:
            self._conn.close()


class _Unmet(Exception):
    """A write's requirement found no row: its transaction is rolled back."""


def _import_psycopg() -> None:
    try:
        import psycopg  # noqa: F401
    except ImportError as error:
        raise exc.ConfigurationError(
            'the PostgreSQL run store needs psycopg: pip install "stockade[postgres]"'
        ) from error


class PostgresDatabase:
    """One connection, reopened after a network failure; each write one transaction."""

    serial = "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"
    blob = "BYTEA"

    def __init__(self, url: str, *, connect_timeout_s: float = 10.0, read_only: bool = False) -> None:
        _import_psycopg()
        self.url = url
        self.connect_timeout_s = connect_timeout_s
        self.read_only = read_only
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None

    @property
    def safe_url(self) -> str:
        # Never print the password of the URL.
        head, sep, tail = self.url.rpartition("@")
        return f"{head.split('://')[0]}://…@{tail}" if sep else self.url

    def _connection(self) -> psycopg.Connection[tuple[object, ...]]:
        import psycopg

        if self._conn is None or self._conn.closed:
            try:
                self._conn = psycopg.connect(self.url, connect_timeout=max(1, round(self.connect_timeout_s)))
            except psycopg.Error as error:
                raise exc.RunStoreError(f"cannot reach the run store {self.safe_url}: {error}") from error
            self._conn.read_only = self.read_only  # the transactions psycopg begins are READ ONLY
        return self._conn

    def _failure(self, error: Exception) -> exc.StockadeError:
        import psycopg

        if isinstance(error, exc.StockadeError):
            return error
        if isinstance(error, psycopg.OperationalError | psycopg.InterfaceError) and self._conn is not None:
            self._conn.close()
            self._conn = None
        return exc.RunStoreError(f"run store {self.safe_url}: {error}")

    def write(self, statements: Sequence[Statement], *, require: Requirement | None = None) -> bool:
        _writable(self)
        with self._lock:
            try:
                conn = self._connection()
                with conn.transaction(), conn.cursor() as cur:
                    if require is not None:
                        query = require[0].replace("?", "%s") + " FOR UPDATE"
                        if cur.execute(query.encode(), tuple(require[1])).fetchone() is None:
                            raise _Unmet  # leaving the block rolls the transaction back
                    for sql, rows in statements:
                        cur.executemany(sql.replace("?", "%s").encode(), rows)
            except _Unmet:
                return False
            except Exception as error:
                raise self._failure(error) from error
            return True

    def create(self, statements: Sequence[str], *, name: str) -> None:
        # CREATE TABLE IF NOT EXISTS is not safe against itself in PostgreSQL: two processes
        # both find the table missing and one fails on the catalog's unique index
        lock = ("SELECT pg_advisory_xact_lock(hashtext(?))", [(f"stockade-{name}",)])
        self.write([lock, *((sql, [()]) for sql in statements)])

    def add_column(self, table: str, column: str, declaration: str) -> None:
        # ALTER TABLE locks the table even when the column is there: look first
        sql = "SELECT 1 FROM information_schema.columns WHERE table_name = ? AND column_name = ?"
        if self.query(sql, (table.lower(), column.lower())):
            return
        self.write([(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {declaration}", [()])])

    def columns(self, table: str) -> set[str]:
        sql = (
            "SELECT column_name FROM information_schema.columns WHERE table_name = ? "
            "AND table_schema = ANY(current_schemas(false))"
        )
        return {str(r[0]) for r in self.query(sql, (table.lower(),))}

    def query(self, sql: str, params: Sequence[object] = ()) -> Rows:
        with self._lock:
            try:
                conn = self._connection()
                with conn.transaction():
                    return conn.execute(sql.replace("?", "%s").encode(), tuple(params)).fetchall()
            except Exception as error:
                raise self._failure(error) from error

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _writable(db: Database) -> None:
    if db.read_only:
        raise exc.ConfigurationError(f"the run store {display_url(db)} was opened read-only")


def octets(db: Database, column: str) -> str:
    """SQL for the size in bytes of a text ``column`` (its length counts characters)."""
    if isinstance(db, PostgresDatabase):
        return f"OCTET_LENGTH({column})"
    return f"LENGTH(CAST({column} AS BLOB))"


def display_url(db: Database) -> str:
    """The database as error messages name it (a PostgreSQL URL without its password)."""
    return db.safe_url if isinstance(db, PostgresDatabase) else db.url
