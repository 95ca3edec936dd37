"""The PostgreSQL audit store, for teams: many workers append to one chain.

Needs the ``postgres`` extra (psycopg 3): ``pip install "stockade[postgres]"``. Each batch is
one transaction that locks the head row (``SELECT ... FOR UPDATE``), so concurrent writers
on many hosts still produce one linear chain. Requires PostgreSQL 14 or newer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING

from stockade import exceptions as exc
from stockade.audit._store_append import check_chain, erasures, seal_batch
from stockade.audit._store_base import AuditStore, Head, Row, after
from stockade.audit._store_sql import check_namespace, window_sql
from stockade.audit.events import GENESIS, AuditEvent, Chain, Draft
from stockade.audit.sealing import new_key

if TYPE_CHECKING:
    import psycopg

__all__ = ["PostgresStore"]


def _import_psycopg() -> None:
    try:
        import psycopg  # noqa: F401
    except ImportError as error:
        raise exc.ConfigurationError(
            'the PostgreSQL audit store needs psycopg: pip install "stockade[postgres]"'
        ) from error


def _schema(ns: str) -> list[str]:
    return [
        f"""CREATE TABLE IF NOT EXISTS {ns}_events (
            seq BIGINT PRIMARY KEY,
            run_id TEXT NOT NULL,
            kind TEXT NOT NULL,
            step INTEGER NOT NULL,
            timestamp_ns BIGINT NOT NULL,
            body TEXT NOT NULL,
            hash TEXT NOT NULL)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_events_run ON {ns}_events (run_id, seq)",
        f"""CREATE TABLE IF NOT EXISTS {ns}_head (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            seq BIGINT NOT NULL,
            hash TEXT NOT NULL,
            algorithm TEXT NOT NULL,
            mac TEXT NOT NULL)""",
        f"INSERT INTO {ns}_head VALUES (1, 0, '{GENESIS}', '', '') ON CONFLICT (id) DO NOTHING",
        f"""CREATE TABLE IF NOT EXISTS {ns}_run_keys (
            run_id TEXT PRIMARY KEY,
            subject TEXT NOT NULL,
            key BYTEA NOT NULL,
            created_ns BIGINT NOT NULL)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_run_keys_subject ON {ns}_run_keys (subject)",
        f"""CREATE OR REPLACE FUNCTION {ns}_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'audit events are append-only'; END $$""",
        f"""CREATE OR REPLACE TRIGGER {ns}_events_no_change BEFORE UPDATE OR DELETE ON {ns}_events
            FOR EACH ROW EXECUTE FUNCTION {ns}_append_only()""",
        f"""CREATE OR REPLACE TRIGGER {ns}_events_no_truncate BEFORE TRUNCATE ON {ns}_events
            FOR EACH STATEMENT EXECUTE FUNCTION {ns}_append_only()""",
    ]


class PostgresStore(AuditStore):
    """Audit events in PostgreSQL tables ``<namespace>_events`` and ``<namespace>_head``.

    ``read_only``: for readers that must not change what they read (``verify``): no table is
    created, every transaction is ``READ ONLY``, a missing table is an ``AuditStoreError``.
    """

    def __init__(
        self, url: str, *, namespace: str = "audit", connect_timeout_s: float = 10.0, read_only: bool = False
    ) -> None:
        _import_psycopg()
        self.url = url
        self.ns = check_namespace(namespace)
        self.connect_timeout_s = connect_timeout_s
        self.read_only = read_only
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        if read_only:
            return
        with self._lock:
            conn = self._connection()
            try:
                with conn.transaction():
                    # Serialise concurrent first-time setups (CREATE IF NOT EXISTS races in Postgres).
                    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"stockade-{self.ns}",))
                    for statement in _schema(self.ns):
                        conn.execute(statement.encode())
            except Exception as error:
                raise self._failure(error) from error

    def _connect(self) -> psycopg.Connection[tuple[object, ...]]:
        import psycopg

        try:
            conn = psycopg.connect(self.url, connect_timeout=max(1, round(self.connect_timeout_s)))
        except psycopg.Error as error:
            raise exc.AuditStoreError(f"cannot reach the audit store {self._safe_url}: {error}") from error
        conn.read_only = self.read_only  # the transactions psycopg begins are READ ONLY
        return conn

    def _writable(self) -> None:
        if self.read_only:
            raise exc.ConfigurationError(f"audit store {self._safe_url} was opened read-only")

    @property
    def _safe_url(self) -> str:
        # Never print the password of the URL.
        head, sep, tail = self.url.rpartition("@")
        return f"{head.split('://')[0]}://…@{tail}" if sep else self.url

    def _connection(self) -> psycopg.Connection[tuple[object, ...]]:
        if self._conn is None or self._conn.closed:
            self._conn = self._connect()
        return self._conn

    def _failure(self, error: Exception) -> Exception:
        import psycopg

        if isinstance(error, exc.StockadeError):
            return error
        if isinstance(error, psycopg.OperationalError | psycopg.InterfaceError):
            if self._conn is not None:
                self._conn.close()
            self._conn = None
        return exc.AuditStoreError(f"audit store {self._safe_url}: {error}")

    def append(self, drafts: Sequence[Draft], chain: Chain) -> list[AuditEvent]:
        self._writable()
        with self._lock:
            conn = self._connection()
            try:
                with conn.transaction(), conn.cursor() as cur:
                    sealed = self._seal(cur, drafts, chain)
            except Exception as error:
                raise self._failure(error) from error
            return sealed

    def _seal(
        self, cur: psycopg.Cursor[tuple[object, ...]], drafts: Sequence[Draft], chain: Chain
    ) -> list[AuditEvent]:
        """Append ``drafts`` inside the caller's transaction."""
        ns = self.ns
        cur.execute(f"SELECT seq, hash, algorithm, mac FROM {ns}_head WHERE id = 1 FOR UPDATE".encode())
        head = _head(cur.fetchone())
        check_chain(head, chain, ns)
        sealed, new_head = seal_batch(drafts, chain, head, ns)
        cur.executemany(
            f"INSERT INTO {ns}_events VALUES (%s, %s, %s, %s, %s, %s, %s)".encode(),
            [
                (e.seq, e.run_id, e.kind.value, e.step, e.timestamp_ns, e.body.decode(), e.hash)
                for e in sealed
            ],
        )
        cur.execute(
            f"UPDATE {ns}_head SET seq = %s, hash = %s, algorithm = %s, mac = %s WHERE id = 1".encode(),
            (new_head.seq, new_head.hash, new_head.algorithm, new_head.mac),
        )
        return sealed

    def has_trail(self) -> bool:
        """Whether the events table exists: asked before reading, as a reader creates none."""
        with self._lock:
            conn = self._connection()
            try:
                with conn.transaction():
                    row = conn.execute(
                        "SELECT to_regclass(%s) IS NOT NULL", (f"{self.ns}_events",)
                    ).fetchone()
            except Exception as error:
                raise self._failure(error) from error
        return row is not None and row[0] is True

    def head(self) -> Head | None:
        with self._lock:
            conn = self._connection()
            try:
                with conn.transaction():
                    row = conn.execute(
                        f"SELECT seq, hash, algorithm, mac FROM {self.ns}_head WHERE id = 1".encode()
                    )
                    return _head(row.fetchone())
            except Exception as error:
                raise self._failure(error) from error

    def rows(self, *, run_id: str | None = None, after_seq: int = 0) -> Iterator[Row]:
        import psycopg

        after_seq = after(after_seq)
        # Its own connection and a server-side cursor: a million rows stream in bounded memory.
        conn = self._connect()
        try:
            with conn.transaction(), conn.cursor(name="stockade_audit_rows") as cur:
                cur.itersize = 10_000
                columns = "seq, run_id, kind, body, hash, step, timestamp_ns"
                sql = f"SELECT {columns} FROM {self.ns}_events WHERE seq > %s"
                params: tuple[object, ...] = (after_seq,)
                if run_id is not None:
                    sql += " AND run_id = %s"
                    params += (run_id,)
                cur.execute((sql + " ORDER BY seq").encode(), params)
                for seq, row_run, kind, body, hash_, step, timestamp_ns in cur:
                    yield Row(
                        int(str(seq)),
                        str(row_run),
                        str(kind),
                        str(body),
                        str(hash_),
                        int(str(step)),
                        int(str(timestamp_ns)),
                    )
        except psycopg.Error as error:  # no events table, a lost connection: nothing more was read
            raise exc.AuditStoreError(f"audit store {self._safe_url}: {error}") from error
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
        import psycopg

        sql, params = window_sql(
            self.ns, "%s", run_id, after_seq=after_seq, before_seq=before_seq, limit=limit, newest=newest
        )
        conn = self._connect()
        try:
            with conn.transaction():
                found = conn.execute(sql.encode(), params).fetchall()
        except psycopg.Error as error:
            raise exc.AuditStoreError(f"audit store {self._safe_url}: {error}") from error
        finally:
            conn.close()
        rows = [
            Row(int(str(q)), str(r), str(k), str(b), str(h), int(str(st)), int(str(t)))
            for q, r, k, b, h, st, t in found
        ]
        return rows[::-1] if newest else rows

    def rows_at(self, seqs: Collection[int]) -> list[Row]:
        import psycopg

        wanted = sorted({after(s) for s in seqs})
        if not wanted:
            return []
        columns = "seq, run_id, kind, body, hash, step, timestamp_ns"
        sql = f"SELECT {columns} FROM {self.ns}_events WHERE seq = ANY(%s) ORDER BY seq"
        conn = self._connect()
        try:
            with conn.transaction():
                found = conn.execute(sql.encode(), (wanted,)).fetchall()
        except psycopg.Error as error:
            raise exc.AuditStoreError(f"audit store {self._safe_url}: {error}") from error
        finally:
            conn.close()
        return [
            Row(int(str(q)), str(r), str(k), str(b), str(h), int(str(st)), int(str(t)))
            for q, r, k, b, h, st, t in found
        ]

    def run_key(self, run_id: str, subject: str) -> bytes:
        ns = self.ns
        self._writable()
        with self._lock:
            conn = self._connection()
            try:
                with conn.transaction():
                    conn.execute(
                        f"INSERT INTO {ns}_run_keys VALUES (%s, %s, %s, %s) "
                        "ON CONFLICT (run_id) DO NOTHING".encode(),
                        (run_id, subject, new_key(), time.time_ns()),
                    )
                    row = conn.execute(f"SELECT key FROM {ns}_run_keys WHERE run_id = %s".encode(), (run_id,))
                    found = row.fetchone()
            except Exception as error:
                raise self._failure(error) from error
        assert found is not None
        return _bytes(found[0])

    def run_keys(self, run_ids: Collection[str]) -> dict[str, bytes]:
        runs = list(run_ids)
        if not runs:
            return {}
        with self._lock:
            conn = self._connection()
            try:
                with conn.transaction():
                    rows = conn.execute(
                        f"SELECT run_id, key FROM {self.ns}_run_keys WHERE run_id = ANY(%s)".encode(), (runs,)
                    ).fetchall()
            except Exception as error:
                raise self._failure(error) from error
        return {str(r): _bytes(k) for r, k in rows}

    def erase_keys(
        self, chain: Chain, *, run_ids: Collection[str] = (), subject: str | None = None
    ) -> list[str]:
        self._writable()
        with self._lock:
            conn = self._connection()
            try:
                with conn.transaction(), conn.cursor() as cur:
                    cur.execute(
                        f"DELETE FROM {self.ns}_run_keys WHERE run_id = ANY(%s) OR subject = %s "
                        "RETURNING run_id".encode(),
                        (list(run_ids), subject),
                    )
                    gone = [str(r[0]) for r in cur.fetchall()]
                    if gone:  # in the deletion's transaction: both happen, or neither
                        self._seal(cur, erasures(gone), chain)
            except Exception as error:
                raise self._failure(error) from error
        return gone

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _bytes(value: object) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise exc.AuditStoreError(f"a run key is stored as {type(value).__name__}, not bytes")
    return bytes(value)


def _head(row: tuple[object, ...] | None) -> Head | None:
    if row is None or row[0] == 0:
        return None
    seq, hash_, algorithm, mac = row
    return Head(seq=int(str(seq)), hash=str(hash_), algorithm=str(algorithm), mac=str(mac))
