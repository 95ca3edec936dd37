"""Where audit events live: one small interface, a store per database.

A store is append-only by construction: its interface has no update or delete, and the SQL
stores also refuse UPDATE/DELETE with triggers (a guard against accidents; an attacker with
the database can drop triggers, which is what ``verify`` and a keyed chain are for).

Each store keeps one chain and a *head* record (last seq, its hash, the chain algorithm and a
MAC over them) updated in the same transaction as every batch. The head is what reveals a
truncated tail; see ``stockade.audit.verify`` for what it can and cannot prove.

Beside the chain, a store keeps the keys of sealed runs (``stockade.audit.sealing``): a table
that is not append-only, so that erasing a data subject can forget them.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import math
import re
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from stockade import _sqlite_writer as sqlite_writer
from stockade import exceptions as exc
from stockade._checks import check_number
from stockade._private import private_database
from stockade._sqlite_reader import SQLiteReader
from stockade.audit.events import GENESIS, AuditEvent, Chain, Draft, EventKind
from stockade.audit.sealing import SEALED, new_key, open_attributes

__all__ = ["AuditStore", "Head", "MemoryStore", "Row", "SQLiteStore", "open_store"]

_NAMESPACE = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")


def after(seq: object) -> int:
    """A reader's ``after_seq``: a whole number (``InvalidArgument`` else), held to what a
    stored seq can be (one past every seq reads nothing; below 0, from the start)."""
    check_number(seq, argument="after_seq", integer=True, low=-math.inf, high=math.inf)
    assert isinstance(seq, int)
    return max(0, min(seq, 2**63 - 1))


@dataclass(frozen=True, kw_only=True)
class Head:
    """The last event of a store's chain as the store recorded it, with the chain's algorithm."""

    seq: int
    hash: str
    algorithm: str
    mac: str


class Row(NamedTuple):
    """One stored event as it is on disk: the columns ``verify`` cross-checks against ``body``."""

    seq: int
    run_id: str
    kind: str
    body: str
    hash: str
    step: int
    timestamp_ns: int


class AuditStore(abc.ABC):
    """An append-only home for one hash chain."""

    url: str
    ns: str = "audit"  # the namespace the chain is kept under: its head's MAC names it

    @abc.abstractmethod
    def append(self, drafts: Sequence[Draft], chain: Chain) -> list[AuditEvent]:
        """Atomically seal ``drafts`` after the current head, write them and move the head.

        Raises ``ConfigurationError`` if ``chain`` is not the chain this store was started with
        (another algorithm, or another key: the head's MAC does not verify), writing nothing.
        """

    @abc.abstractmethod
    def rows(self, *, run_id: str | None = None, after_seq: int = 0) -> Iterator[Row]:
        """Stored events in ``seq`` order, as stored (no check)."""

    @abc.abstractmethod
    def head(self) -> Head | None:
        """The head record, or ``None`` for an empty store."""

    def events(self, *, run_id: str | None = None, after_seq: int = 0) -> Iterator[AuditEvent]:
        """Stored events, parsed (unverified: use ``verify`` to trust them). A sealed run's
        attributes are opened with its key, or marked ``$erased`` once the key is gone.
        ``AuditIntegrityError`` naming the seq at a row that is no readable event (edited)."""
        return self.opened(self.rows(run_id=run_id, after_seq=after_seq))

    def opened(self, rows: Iterable[Row]) -> Iterator[AuditEvent]:
        """``rows`` as events (``events``, of rows read otherwise: a ``window``)."""
        keys: dict[str, bytes | None] = {}
        for row in rows:
            event = AuditEvent.from_body(row.body.encode(errors="surrogatepass"), row.hash, seq=row.seq)
            if SEALED in event.attributes:
                if event.run_id not in keys:
                    keys[event.run_id] = self.run_keys([event.run_id]).get(event.run_id)
                try:
                    opened = open_attributes(event.run_id, event.attributes, keys[event.run_id])
                except exc.AuditIntegrityError as error:
                    raise exc.AuditIntegrityError(f"seq {row.seq}: {error}") from None
                event = dataclasses.replace(event, attributes=opened)
            yield event

    def window(
        self,
        run_id: str,
        *,
        after_seq: int = 0,
        before_seq: int | None = None,
        limit: int,
        newest: bool = False,
    ) -> list[Row]:
        """At most ``limit`` stored events of ``run_id`` between ``after_seq`` and
        ``before_seq`` (both left out), in ``seq`` order: the first of them, or the newest
        (``newest``). What the run viewer shows of a run: the SQL stores read that many rows
        of the run's index from either end, whatever the run's size; this reads the run's
        rows up to them."""
        start, end = after(after_seq), None if before_seq is None else after(before_seq)
        kept: deque[Row] = deque(maxlen=max(0, limit))
        for row in self.rows(run_id=run_id, after_seq=start):
            if end is not None and row.seq >= end:
                break
            kept.append(row)
            if not newest and len(kept) >= limit:
                break
        return list(kept)

    def rows_at(self, seqs: Collection[int]) -> list[Row]:
        """The stored events at these ``seq`` (those there are), in ``seq`` order: the
        neighbours a run's check reads to see how its events link into the chain
        (``verify_run``). The SQL stores read them by their key; this reads from each."""
        found = []
        for seq in sorted(set(seqs)):
            for row in self.rows(after_seq=seq - 1):
                if row.seq == seq:
                    found.append(row)
                break
        return found

    # -- the keys of sealed runs (stockade.audit.sealing): kept apart from the chain, erasable --

    @abc.abstractmethod
    def run_key(self, run_id: str, subject: str) -> bytes:
        """The key the events of ``run_id``, a run about data subject ``subject``, are sealed
        with; made and kept on first use."""

    @abc.abstractmethod
    def run_keys(self, run_ids: Collection[str]) -> dict[str, bytes]:
        """The keys of these runs that are still kept (an erased run has none)."""

    @abc.abstractmethod
    def erase_keys(
        self, chain: Chain, *, run_ids: Collection[str] = (), subject: str | None = None
    ) -> list[str]:
        """Forget the keys of these runs, and of every run of ``subject``, and append one
        ``run_erased`` event of each (``chain``: the writers' chain, as for ``append``), in one
        transaction: what their events said can never be read again, the chain verifies as
        before, and ``verify`` tells this erasure from a key deleted or replaced outside
        stockade. Returns the runs (none: nothing appended, no chain needed)."""

    def close(self) -> None:  # noqa: B027 - stores without resources need nothing here
        """Release connections. Idempotent."""

    def __enter__(self) -> AuditStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def erasures(runs: Sequence[str]) -> list[Draft]:
    """The ``run_erased`` events of runs whose keys are being forgotten."""
    now = time.time_ns()
    return [Draft(run_id=run, kind=EventKind.RUN_ERASED, actor="stockade", timestamp_ns=now) for run in runs]


def check_chain(head: Head | None, chain: Chain, namespace: str) -> None:
    """``ConfigurationError`` unless ``chain`` is the chain the store's head was written with:
    the same algorithm and, for a keyed chain, the same key (the head's MAC verifies under it).
    A writer with another key would append events no key verifies together: every event of
    one writer reads as edited under the other's key."""
    if head is None:
        return
    if head.algorithm != chain.algorithm:
        hint = (
            "pass its key"
            if head.algorithm == "hmac-sha256"
            else "it was written without a key, or rewritten without one (`stockade audit verify` "
            "with the key reports it downgraded)"
        )
        raise exc.ConfigurationError(
            f"this audit store's chain uses {head.algorithm}, not {chain.algorithm}: {hint}"
        )
    if not chain.head_verifies(head.seq, head.hash, namespace, head.mac):  # no secret to time: it is stored
        # also what a head moved back, or copied from another namespace, looks like
        raise exc.ConfigurationError(
            f"this audit store's head record (seq {head.seq}) does not verify under this writer's "
            f"{'key' if chain.keyed else 'chain'}: the store was written with another key, or its head "
            "was edited (run `stockade audit verify` with the store's key); refusing to append"
        )


def seal_batch(
    drafts: Sequence[Draft], chain: Chain, head: Head | None, namespace: str
) -> tuple[list[AuditEvent], Head]:
    seq, prev = (head.seq, head.hash) if head is not None else (0, GENESIS)
    sealed = []
    for draft in drafts:
        seq += 1
        event = chain.seal(draft, seq, prev)
        prev = event.hash
        sealed.append(event)
    return sealed, Head(
        seq=seq, hash=prev, algorithm=chain.algorithm, mac=chain.head_mac(seq, prev, namespace)
    )


class MemoryStore(AuditStore):
    """Events in a list: for tests (``stockade.testing.capture_audit``) and short-lived tools."""

    url = "memory:"

    def __init__(self) -> None:
        self._rows: list[Row] = []
        self._head: Head | None = None
        self._keys: dict[str, tuple[str, bytes]] = {}  # run id -> (subject, key)
        self._lock = threading.Lock()

    def run_key(self, run_id: str, subject: str) -> bytes:
        with self._lock:
            return self._keys.setdefault(run_id, (subject, new_key()))[1]

    def run_keys(self, run_ids: Collection[str]) -> dict[str, bytes]:
        with self._lock:
            return {r: self._keys[r][1] for r in run_ids if r in self._keys}

    def erase_keys(
        self, chain: Chain, *, run_ids: Collection[str] = (), subject: str | None = None
    ) -> list[str]:
        with self._lock:
            gone = [r for r, (s, _) in self._keys.items() if r in set(run_ids) or s == subject]
            if gone:
                self._seal(erasures(gone), chain)
            for run in gone:
                del self._keys[run]
            return gone

    def append(self, drafts: Sequence[Draft], chain: Chain) -> list[AuditEvent]:
        with self._lock:
            return self._seal(drafts, chain)

    def _seal(self, drafts: Sequence[Draft], chain: Chain) -> list[AuditEvent]:
        check_chain(self._head, chain, self.ns)
        sealed, self._head = seal_batch(drafts, chain, self._head, self.ns)
        self._rows.extend(
            Row(e.seq, e.run_id, e.kind.value, e.body.decode(), e.hash, e.step, e.timestamp_ns)
            for e in sealed
        )
        return sealed

    def rows(self, *, run_id: str | None = None, after_seq: int = 0) -> Iterator[Row]:
        with self._lock:
            snapshot = list(self._rows)
        start = after(after_seq)
        return (r for r in snapshot if r.seq > start and (run_id is None or r.run_id == run_id))

    def head(self) -> Head | None:
        return self._head

    def rows_at(self, seqs: Collection[int]) -> list[Row]:
        with self._lock:
            stored = self._rows  # seq n is at n - 1: the list is only ever appended to
            return [stored[s - 1] for s in sorted(set(seqs)) if 0 < s <= len(stored)]


_ROW_COLUMNS = "seq, run_id, kind, body, hash, step, timestamp_ns"


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


def window_sql(
    ns: str, mark: str, run_id: str, *, after_seq: int, before_seq: int | None, limit: int, newest: bool
) -> tuple[str, tuple[object, ...]]:
    """``AuditStore.window`` in SQL: the run's index read from one end, ``limit`` rows."""
    sql = f"SELECT {_ROW_COLUMNS} FROM {ns}_events WHERE run_id = {mark} AND seq > {mark}"
    params: tuple[object, ...] = (run_id, after(after_seq))
    if before_seq is not None:
        sql += f" AND seq < {mark}"
        params += (after(before_seq),)
    sql += f" ORDER BY seq {'DESC' if newest else 'ASC'} LIMIT {mark}"
    return sql, (*params, max(0, limit))


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


def check_namespace(namespace: str) -> str:
    if not _NAMESPACE.match(namespace):
        raise exc.ConfigurationError(f"audit namespace {namespace!r} must match {_NAMESPACE.pattern}")
    return namespace


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
            sql = f"SELECT {_ROW_COLUMNS} FROM {self.ns}_events WHERE seq > ?"
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
                sql = f"SELECT {_ROW_COLUMNS} FROM {self.ns}_events WHERE seq IN ({marks})"
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


def open_store(url: str, *, namespace: str = "audit", read_only: bool = False) -> AuditStore:
    """A store from a URL: ``sqlite:///path``, a plain file path, ``postgresql://...`` or ``memory:``.
    ``read_only``: a reader's, that creates nothing and writes nothing (``verify``, ``export``)."""
    if url.startswith(("postgresql://", "postgres://")):
        from stockade.audit.postgres import PostgresStore

        return PostgresStore(url, namespace=namespace, read_only=read_only)
    if url == "memory:":
        return MemoryStore()
    if url.startswith("sqlite:///"):
        return SQLiteStore(url[len("sqlite:///") :], namespace=namespace, read_only=read_only)
    if "://" in url:
        raise exc.ConfigurationError(
            f"unknown audit store URL {url!r}: use sqlite:///PATH or postgresql://..."
        )
    return SQLiteStore(url, namespace=namespace, read_only=read_only)
