"""The embedded default audit store (``SQLiteStore``): one SQLite file in WAL mode, its schema
(append-only by triggers) and how its rows are read back, a reader's copy of the file
included. Apart from the interface and from PostgreSQL's store, which share none of it.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

from stockade import _sqlite_writer as sqlite_writer
from stockade import exceptions as exc
from stockade._private import private_database
from stockade._sqlite_reader import SQLiteReader
from stockade.audit._store_append import check_chain, erasures, seal_batch
from stockade.audit._store_base import AuditStore, Head, Row, after
from stockade.audit._store_sql import ROW_COLUMNS, check_namespace, window_sql
from stockade.audit.events import GENESIS, AuditEvent, Chain, Draft
from stockade.audit.sealing import new_key

__all__ = ["SQLiteStore"]


def _lenient_text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _row(raw: tuple[object, ...]) -> Row:
    """A stored row as a ``Row``; a value of another type than stockade writes (a BLOB body,
    a text step) is kept as text, for ``verify`` to find it does not match."""
    row = Row._make(raw)
    if type(row.body) is str and type(row.run_id) is str and type(row.kind) is str and type(row.hash) is str:
        return row
    return Row._make(
        v.decode("utf-8", "replace") if isinstance(v, bytes) else v if i in (0, 5, 6) else str(v)
        for i, v in enumerate(raw)
    )


def _sqlite_schema(ns: str) -> str:
    return f"""
    CREATE TABLE IF NOT EXISTS {ns}_events (
        seq INTEGER PRIMARY KEY,
        run_id TEXT NOT NULL,
        kind TEXT NOT NULL,
        step INTEGER NOT NULL,
        timestamp_ns INTEGER NOT NULL,
        body TEXT NOT NULL,
        hash TEXT NOT NULL
    );
    CREATE INDEX IF NOT EXISTS {ns}_events_run ON {ns}_events (run_id, seq);
    CREATE TABLE IF NOT EXISTS {ns}_head (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        seq INTEGER NOT NULL,
        hash TEXT NOT NULL,
        algorithm TEXT NOT NULL,
        mac TEXT NOT NULL
    );
    INSERT OR IGNORE INTO {ns}_head VALUES (1, 0, '{GENESIS}', '', '');
    CREATE TABLE IF NOT EXISTS {ns}_run_keys (
        run_id TEXT PRIMARY KEY,
        subject TEXT NOT NULL,
        key BLOB NOT NULL,
        created_ns INTEGER NOT NULL
    );
    CREATE INDEX IF NOT EXISTS {ns}_run_keys_subject ON {ns}_run_keys (subject);
    CREATE TRIGGER IF NOT EXISTS {ns}_events_no_update BEFORE UPDATE ON {ns}_events
        BEGIN SELECT RAISE(ABORT, 'audit events are append-only'); END;
    CREATE TRIGGER IF NOT EXISTS {ns}_events_no_delete BEFORE DELETE ON {ns}_events
        BEGIN SELECT RAISE(ABORT, 'audit events are append-only'); END;
    """


class SQLiteStore(AuditStore):
    """The embedded default: one SQLite file in WAL mode (readers never block the writer).

    Several processes may append to the same file: each batch is one ``BEGIN IMMEDIATE``
    transaction that reads the head, so the chain stays linear.

    ``read_only``: for readers that must not change what they read (``verify``, the run
    viewer): the file is read as ``SQLiteReader`` reads it (nothing written, nothing made beside
    it), no table is created, a missing one is an ``AuditStoreError``.
    """

    def __init__(self, path: str | Path, *, namespace: str = "audit", read_only: bool = False) -> None:
        self.path = Path(path)
        self.ns = check_namespace(namespace)
        self.url = f"sqlite:///{self.path}"
        self.read_only = read_only
        self._lock = threading.Lock()
        self._reader: SQLiteReader | None = None
        if read_only:
            try:
                self._reader = SQLiteReader(self.path)
            except sqlite3.Error as error:
                raise exc.AuditStoreError(f"cannot open audit store {self.path}: {error}") from error
            return
        private_database(self.path, "an audit trail and its sealing keys")
        self._conn = self._connect()
        try:
            # an erased key is overwritten, not left in a free page
            self._conn.execute("PRAGMA secure_delete=ON")
            # One transaction: a store that cannot be made (a full disk) is left with all its
            # tables or none, never events without the head that says where they end.
            self._conn.executescript(f"BEGIN IMMEDIATE; {_sqlite_schema(self.ns)} COMMIT;")
        except sqlite3.Error as error:
            with contextlib.suppress(sqlite3.Error):  # a rollback that fails is one on close
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
            self._conn.close()
            raise exc.AuditStoreError(f"cannot open audit store {self.path}: {error}") from error

    def _connect(self) -> sqlite3.Connection:
        try:
            conn = sqlite_writer.connect(self.path)  # WAL, NORMAL: a power cut never corrupts the chain
        except sqlite3.Error as error:
            raise exc.AuditStoreError(f"cannot open audit store {self.path}: {error}") from error
        return conn

    def _writable(self) -> None:
        if self.read_only:
            raise exc.ConfigurationError(f"audit store {self.path} was opened read-only")

    def append(self, drafts: Sequence[Draft], chain: Chain) -> list[AuditEvent]:
        self._writable()
        with self._lock:
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    sealed = self._seal(conn, drafts, chain)
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
            except sqlite3.Error as error:
                raise exc.AuditStoreError(f"audit store {self.path}: {error}") from error
            return sealed

    def _seal(self, conn: sqlite3.Connection, drafts: Sequence[Draft], chain: Chain) -> list[AuditEvent]:
        """Append ``drafts`` inside the caller's transaction."""
        ns = self.ns
        head = self._read_head(conn)
        check_chain(head, chain, ns)
        sealed, new_head = seal_batch(drafts, chain, head, ns)
        conn.executemany(
            f"INSERT INTO {ns}_events VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                (e.seq, e.run_id, e.kind.value, e.step, e.timestamp_ns, e.body.decode(), e.hash)
                for e in sealed
            ],
        )
        conn.execute(
            f"UPDATE {ns}_head SET seq = ?, hash = ?, algorithm = ?, mac = ? WHERE id = 1",
            (new_head.seq, new_head.hash, new_head.algorithm, new_head.mac),
        )
        return sealed

    def _read_head(self, conn: sqlite3.Connection | SQLiteReader) -> Head | None:
        sql = f"SELECT seq, hash, algorithm, mac FROM {self.ns}_head WHERE id = 1"
        if isinstance(conn, SQLiteReader):
            rows = conn.query(sql)
            row = rows[0] if rows else None
        else:
            row = conn.execute(sql).fetchone()
        if row is None or row[0] == 0:
            return None
        seq, hash_, algorithm, mac = row
        if not isinstance(seq, int) or not all(isinstance(v, str) for v in (hash_, algorithm, mac)):
            raise exc.AuditIntegrityError(f"audit store {self.path}: the head record is not a head (edited)")
        return Head(seq=seq, hash=hash_, algorithm=algorithm, mac=mac)

    def head(self) -> Head | None:
        with self._lock:
            try:
                return self._read_head(self._reader or self._conn)
            except sqlite3.Error as error:  # no head table (a damaged store, opened read-only)
                raise exc.AuditStoreError(f"audit store {self.path}: {error}") from error

    def rows(self, *, run_id: str | None = None, after_seq: int = 0) -> Iterator[Row]:
        after_seq = after(after_seq)
        # A connection of its own: a long read (verify, export) never holds up appends.
        try:
            conn, steady = self._reader.connect() if self._reader is not None else (self._connect(), None)
        except sqlite3.Error as error:
            raise exc.AuditStoreError(f"cannot open audit store {self.path}: {error}") from error
        try:
            sql = f"SELECT {ROW_COLUMNS} FROM {self.ns}_events WHERE seq > ?"
            if run_id is not None:
                sql += " AND run_id = ?"
            sql += " ORDER BY seq"
            last = after_seq
            while True:
                try:
                    cursor = conn.execute(sql, (last,) if run_id is None else (last, run_id))
                    while batch := cursor.fetchmany(4096):
                        for raw in batch:
                            row = _row(raw)
                            last = row.seq
                            yield row
                    if steady is not None and not steady():
                        raise exc.AuditStoreChanged(
                            f"audit store {self.path} changed while it was read (a writer wrote into "
                            "the file meanwhile): nothing read is proven, read it again"
                        )
                    return
                except sqlite3.OperationalError:
                    if conn.text_factory is _lenient_text:
                        raise
                    # a text column that is not UTF-8 (written around stockade): read on from the
                    # row it broke at with a decoder that keeps it, so verify reports it as edited
                    conn.text_factory = _lenient_text
        except sqlite3.Error as error:  # no events table, a damaged file: nothing read can be trusted
            raise exc.AuditStoreError(f"audit store {self.path}: {error}") from error
        finally:
            conn.close()

    def window(
        self,
        run_id: str,
        *,
        after_seq: int = 0,
        before_seq: int | None = None,
        limit: int,
        newest: bool = False,
    ) -> list[Row]:
        sql, params = window_sql(
            self.ns, "?", run_id, after_seq=after_seq, before_seq=before_seq, limit=limit, newest=newest
        )
        try:
            if self._reader is not None:
                found = self._reader.query(sql, params)
            else:
                with self._lock:
                    found = self._conn.execute(sql, params).fetchall()
        except sqlite3.Error as error:
            raise exc.AuditStoreError(f"audit store {self.path}: {error}") from error
        rows = [_row(raw) for raw in found]
        return rows[::-1] if newest else rows

    def rows_at(self, seqs: Collection[int]) -> list[Row]:
        wanted = sorted({after(s) for s in seqs})
        found: list[tuple[object, ...]] = []
        try:
            for at in range(0, len(wanted), 500):  # a query's parameters are bounded
                part = wanted[at : at + 500]
                marks = ",".join("?" * len(part))
                sql = f"SELECT {ROW_COLUMNS} FROM {self.ns}_events WHERE seq IN ({marks})"
                if self._reader is not None:
                    found.extend(self._reader.query(sql, part))
                else:
                    with self._lock:
                        found.extend(self._conn.execute(sql, part).fetchall())
        except sqlite3.Error as error:
            raise exc.AuditStoreError(f"audit store {self.path}: {error}") from error
        return sorted((_row(raw) for raw in found), key=lambda row: row.seq)

    def run_key(self, run_id: str, subject: str) -> bytes:
        ns = self.ns
        self._writable()
        with self._lock:
            try:
                self._conn.execute(
                    f"INSERT OR IGNORE INTO {ns}_run_keys VALUES (?, ?, ?, ?)",
                    (run_id, subject, new_key(), time.time_ns()),
                )
                sql = f"SELECT key FROM {ns}_run_keys WHERE run_id = ?"
                row = self._conn.execute(sql, (run_id,)).fetchone()
            except sqlite3.Error as error:
                raise exc.AuditStoreError(f"audit store {self.path}: {error}") from error
        return bytes(row[0])

    def run_keys(self, run_ids: Collection[str]) -> dict[str, bytes]:
        runs = list(run_ids)
        if not runs:
            return {}
        with self._lock:
            try:
                marks = ",".join("?" * len(runs))
                sql = f"SELECT run_id, key FROM {self.ns}_run_keys WHERE run_id IN ({marks})"
                if self._reader is not None:
                    rows = self._reader.query(sql, runs)
                else:
                    rows = self._conn.execute(sql, runs).fetchall()
            except sqlite3.Error as error:
                raise exc.AuditStoreError(f"audit store {self.path}: {error}") from error
        return {str(r): bytes(k) for r, k in rows}

    def erase_keys(
        self, chain: Chain, *, run_ids: Collection[str] = (), subject: str | None = None
    ) -> list[str]:
        runs = list(run_ids)
        where = f"run_id IN ({','.join('?' * len(runs))})" if runs else "0"
        ns, params = self.ns, [*runs, subject]
        self._writable()
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    sql = f"SELECT run_id FROM {ns}_run_keys WHERE {where} OR subject = ?"
                    gone = [str(r[0]) for r in self._conn.execute(sql, params)]
                    if gone:
                        self._seal(self._conn, erasures(gone), chain)
                    self._conn.executemany(
                        f"DELETE FROM {ns}_run_keys WHERE run_id = ?", [(r,) for r in gone]
                    )
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
                self._conn.execute("COMMIT")
                # the key's bytes must not linger in free pages of the file
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as error:
                raise exc.AuditStoreError(f"audit store {self.path}: {error}") from error
        return gone

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            return
        with self._lock:
            self._conn.close()
