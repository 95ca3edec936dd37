"""One suite, every audit store: the chain survives honest use and exposes any tampering.

Tampering is done the way an attacker with database access would: raw SQL, with the
append-only triggers disabled first. PostgreSQL comes from ``scripts/start-services.sh
postgres``; its URL is ``STOCKADE_TEST_POSTGRES_URL``.
"""

from __future__ import annotations

import itertools
import json
import os
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stockade.audit import (
    GENESIS,
    AuditLog,
    AuditStore,
    Chain,
    Draft,
    EventKind,
    ProblemKind,
    SQLiteStore,
    canonical,
    open_store,
    verify,
)
from stockade.audit.verify import verify_run
from stockade.exceptions import AuditStoreError, ConfigurationError
from tests.conftest import require

POSTGRES_URL = os.environ.get(
    "STOCKADE_TEST_POSTGRES_URL", "postgresql://stockade:stockade@127.0.0.1:5432/stockade"
)
KEY = b"test-key-0123456789abcdef"


def postgres_reachable() -> tuple[bool, str]:
    try:
        import psycopg
    except ImportError:
        return False, 'psycopg is not installed: pip install "stockade[postgres]"'
    try:
        psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
    except psycopg.Error as error:
        return False, f"{POSTGRES_URL.rpartition('@')[2]}: {error} (run scripts/start-services.sh postgres)"
    return True, ""


@dataclass
class Target:
    """A store under test, a way to open it again, and an attacker's raw SQL access."""

    store: AuditStore
    reopen: Callable[[], AuditStore]
    sql: Callable[[str], None]  # "{events}", "{head}", "{keys}" stand for the table names
    reader: Callable[[], AuditStore]  # the store opened read-only, as verify opens it
    # the same database under a second namespace (another tenant's); "{other}" in ``sql`` is
    # its tables' prefix
    other: Callable[[], AuditStore]

    def fill(self, events: int = 10, key: bytes | None = None) -> None:
        with AuditLog(self.store, key=key, flush_interval_s=None) as log:
            for step in range(events):
                log.record(
                    EventKind.TOOL_CALL,
                    run_id="run-a" if step < events // 2 else "run-b",
                    step=step,
                    actor="agent",
                    attributes={"tool": "run_code", "n": step},
                )

    def rows(self) -> list[tuple[int, str, str]]:
        return [(r.seq, r.body, r.hash) for r in self.store.rows()]

    def set_row(self, seq: int, body: str, digest: str) -> None:
        body_sql = body.replace("'", "''").replace("{", "{{").replace("}", "}}")
        self.sql(f"UPDATE {{events}} SET body = '{body_sql}', hash = '{digest}' WHERE seq = {seq}")


@pytest.fixture(params=["sqlite", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    if request.param == "sqlite":
        path = tmp_path / "audit.db"

        def sqlite_sql(statement: str) -> None:
            with sqlite3.connect(path) as conn:
                conn.execute("DROP TRIGGER IF EXISTS audit_events_no_update")
                conn.execute("DROP TRIGGER IF EXISTS audit_events_no_delete")
                conn.execute(
                    statement.format(
                        events="audit_events", head="audit_head", keys="audit_run_keys", other="other"
                    )
                )

        store: AuditStore = SQLiteStore(path)
        yield Target(
            store,
            lambda: SQLiteStore(path),
            sqlite_sql,
            lambda: SQLiteStore(path, read_only=True),
            lambda: SQLiteStore(path, namespace="other"),
        )
        store.close()
        return

    ok, why = postgres_reachable()
    require("postgres", ok, why)
    import psycopg

    ns = f"t_{uuid.uuid4().hex[:12]}"

    def postgres_sql(statement: str) -> None:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"ALTER TABLE {ns}_events DISABLE TRIGGER USER".encode())
            conn.execute(
                statement.format(
                    events=f"{ns}_events", head=f"{ns}_head", keys=f"{ns}_run_keys", other=f"{ns}_other"
                ).encode()
            )

    store = open_store(POSTGRES_URL, namespace=ns)
    try:
        yield Target(
            store,
            lambda: open_store(POSTGRES_URL, namespace=ns),
            postgres_sql,
            lambda: open_store(POSTGRES_URL, namespace=ns, read_only=True),
            lambda: open_store(POSTGRES_URL, namespace=f"{ns}_other"),
        )
    finally:
        store.close()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            for prefix in (ns, f"{ns}_other"):
                conn.execute(
                    f"DROP TABLE IF EXISTS {prefix}_events, {prefix}_head, {prefix}_run_keys".encode()
                )
                conn.execute(f"DROP FUNCTION IF EXISTS {prefix}_append_only".encode())


def kinds_at(target: Target, key: bytes | None = None) -> list[tuple[int, ProblemKind]]:
    return [(p.seq, p.kind) for p in verify(target.store, key=key).problems]


def test_an_honest_chain_verifies_and_reads_back(target: Target) -> None:
    target.fill(10)
    report = verify(target.store)
    assert report.ok, report.problems
    assert report.checked == 10 and report.last_seq == 10
    events = list(target.store.events())
    assert [e.seq for e in events] == list(range(1, 11))
    assert all(b.prev_hash == a.hash for a, b in itertools.pairwise(events))
    assert [e.step for e in target.store.events(run_id="run-b")] == [5, 6, 7, 8, 9]


def test_one_runs_check_reads_its_events_and_their_neighbours(target: Target) -> None:
    """``verify_run``, as the run viewer calls it, over every store: the events around the
    run's read by their seq (``rows_at``), a deletion next to the run's found."""
    target.fill(events=20, key=KEY)  # run-a: seqs 1-10, run-b: 11-20
    reader = target.reader()
    try:
        for store in (target.store, reader):
            assert [r.seq for r in store.rows_at([0, 10, 12, 21, 12])] == [10, 12]
            report = verify_run(store, "run-b", key=KEY)
            assert report.ok and report.run_events == 10 and report.checked == 11
        target.sql("DELETE FROM {events} WHERE seq = 10")
        assert [(p.seq, p.kind) for p in verify_run(reader, "run-b", key=KEY).problems] == [
            (10, ProblemKind.MISSING)
        ]
    finally:
        reader.close()


def window_seqs(
    store: AuditStore, *, limit: int, after_seq: int = 0, before_seq: int | None = None, newest: bool = False
) -> list[int]:
    found = store.window("run-b", after_seq=after_seq, before_seq=before_seq, limit=limit, newest=newest)
    return [r.seq for r in found]


def test_a_window_of_one_run_reads_from_either_end(target: Target) -> None:
    """What the run viewer shows of a run: its first events, its newest, those between two
    seqs; the same from every store (the SQL ones read that many rows of the run's index)."""
    target.fill(events=20)  # run-a: seqs 1-10, run-b: 11-20
    reader = target.reader()
    try:
        for store in (target.store, reader):
            assert window_seqs(store, limit=3) == [11, 12, 13]
            assert window_seqs(store, limit=3, newest=True) == [18, 19, 20]
            assert window_seqs(store, limit=3, newest=True, before_seq=15) == [12, 13, 14]
            assert window_seqs(store, limit=100, after_seq=16) == [17, 18, 19, 20]
            assert window_seqs(store, limit=100, after_seq=12, before_seq=15) == [13, 14]
            assert window_seqs(store, limit=1, newest=True, before_seq=11) == []  # not run-a's
            assert window_seqs(store, limit=0) == [] and store.window("run-c", limit=5) == []
        opened = list(reader.opened(reader.window("run-a", limit=2)))
        assert [e.attributes["n"] for e in opened] == [0, 1]
    finally:
        reader.close()


def test_the_store_refuses_updates_and_deletes(target: Target) -> None:
    target.fill(2)
    import psycopg

    errors = (sqlite3.DatabaseError, psycopg.Error)
    statement = "DELETE FROM {events} WHERE seq = 1"
    if isinstance(target.store, SQLiteStore):
        with pytest.raises(errors), sqlite3.connect(target.store.path) as conn:
            conn.execute(statement.format(events="audit_events"))
    else:
        with pytest.raises(errors), psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(statement.format(events=f"{target.store.ns}_events").encode())
    assert verify(target.store).ok


def test_an_edited_event_is_found_at_its_seq(target: Target) -> None:
    target.fill()
    target.sql("UPDATE {events} SET body = replace(body, 'run_code', 'rm -rf /') WHERE seq = 4")
    assert kinds_at(target) == [(4, ProblemKind.EDITED)]


def test_an_edit_with_a_recomputed_hash_breaks_the_next_link(target: Target) -> None:
    target.fill()
    seq, body, _ = target.rows()[3]
    forged = body.replace("run_code", "harmless")
    target.set_row(seq, forged, Chain().link(f"{target.rows()[2][2]}", forged.encode()))
    assert kinds_at(target) == [(5, ProblemKind.BROKEN_LINK)]


def test_a_deleted_event_is_a_gap(target: Target) -> None:
    target.fill()
    target.sql("DELETE FROM {events} WHERE seq = 6")
    assert kinds_at(target) == [(6, ProblemKind.MISSING), (7, ProblemKind.BROKEN_LINK)]


def test_reordered_events_are_found(target: Target) -> None:
    target.fill()
    target.sql("UPDATE {events} SET seq = -1 WHERE seq = 5")
    target.sql("UPDATE {events} SET seq = 5 WHERE seq = 6")
    target.sql("UPDATE {events} SET seq = 6 WHERE seq = -1")
    found = kinds_at(target)
    assert (5, ProblemKind.OUT_OF_ORDER) in found and (6, ProblemKind.OUT_OF_ORDER) in found
    assert {seq for seq, _ in found} <= {5, 6, 7}


def test_an_inserted_event_is_found(target: Target) -> None:
    target.fill()
    target.sql("UPDATE {events} SET seq = seq + 1000 WHERE seq >= 5")
    target.sql("UPDATE {events} SET seq = seq - 999 WHERE seq >= 1000")
    target.sql(
        "INSERT INTO {events} SELECT 5, run_id, kind, step, timestamp_ns, body, hash "
        "FROM {events} WHERE seq = 4"
    )
    found = kinds_at(target)
    assert found[0] == (5, ProblemKind.OUT_OF_ORDER)
    assert (5, ProblemKind.BROKEN_LINK) in found


def test_an_event_appended_behind_the_logs_back_is_found(target: Target) -> None:
    target.fill()
    _, body, last_hash = target.rows()[-1]
    forged = canonical({**json.loads(body), "seq": 11, "prev_hash": last_hash}).decode()
    target.sql(
        "INSERT INTO {events} SELECT 11, run_id, kind, step, timestamp_ns, body, hash "
        "FROM {events} WHERE seq = 10"
    )
    target.set_row(11, forged, Chain().link(last_hash, forged.encode()))
    assert (10, ProblemKind.HEAD_FORGED) in kinds_at(target)


def test_a_truncated_tail_is_found_against_the_head_record(target: Target) -> None:
    target.fill()
    target.sql("DELETE FROM {events} WHERE seq > 7")
    assert kinds_at(target) == [(8, ProblemKind.TRUNCATED)]


def test_with_a_key_a_head_moved_back_fails_its_mac(target: Target) -> None:
    target.fill(key=KEY)
    seq7_hash = target.rows()[6][2]
    target.sql("DELETE FROM {events} WHERE seq > 7")
    target.sql(f"UPDATE {{head}} SET seq = 7, hash = '{seq7_hash}' WHERE id = 1")
    assert kinds_at(target, key=KEY) == [(7, ProblemKind.HEAD_FORGED)]


def test_without_a_key_only_a_head_kept_outside_exposes_a_clean_truncation(target: Target) -> None:
    target.fill()
    pinned = verify(target.store)
    rows = target.rows()
    plain = Chain()
    target.sql("DELETE FROM {events} WHERE seq > 7")
    mac = plain.head_mac(7, rows[6][2], target.store.ns)
    target.sql(f"UPDATE {{head}} SET seq = 7, hash = '{rows[6][2]}', mac = '{mac}' WHERE id = 1")
    assert verify(target.store).ok  # the documented limit of an unkeyed chain
    report = verify(target.store, expected_head=(pinned.last_seq, pinned.last_hash))
    assert [(p.seq, p.kind) for p in report.problems] == [(10, ProblemKind.UNEXPECTED_HEAD)]


def test_rewriting_the_whole_chain_without_the_key_is_found(target: Target) -> None:
    target.fill(key=KEY)
    prev = "0" * 64
    for seq, body, _ in target.rows():  # the attacker recomputes every hash, without the key
        forged = body.replace("run_code", "nothing")
        digest = Chain(b"attacker-guessed-key!!").link(prev, forged.encode())
        target.set_row(seq, forged, digest)
        prev = digest
    found = kinds_at(target, key=KEY)
    assert found[0] == (0, ProblemKind.WRONG_KEY)
    assert (10, ProblemKind.HEAD_FORGED) in found


def test_a_keyed_chain_needs_its_key(target: Target) -> None:
    target.fill(key=KEY)
    assert verify(target.store, key=KEY).ok
    assert kinds_at(target) == [(0, ProblemKind.WRONG_KEY)]
    assert kinds_at(target, key=b"another-key-0123456789")[0] == (0, ProblemKind.WRONG_KEY)


def downgrade(target: Target, keep: int) -> None:
    """What an attacker without the key does: cut the chain after ``keep`` events and rewrite
    what is left as a plain SHA-256 chain, its head (algorithm and MAC) with it."""
    target.sql(f"DELETE FROM {{events}} WHERE seq > {keep}")
    plain, prev = Chain(), GENESIS
    for seq, body, _ in target.rows():
        forged = canonical({**json.loads(body), "prev_hash": prev}).replace(b"run_code", b"nothing")
        prev = plain.link(prev, forged)
        target.set_row(seq, forged.decode(), prev)
    mac = plain.head_mac(keep, prev, target.store.ns)
    target.sql(
        f"UPDATE {{head}} SET seq = {keep}, hash = '{prev}', algorithm = 'sha256', mac = '{mac}' WHERE id = 1"
    )


def test_a_keyed_chain_rewritten_without_its_key_is_downgraded_under_the_key(target: Target) -> None:
    """The key's holder was told ``wrong_key``: "pass no key (it is not keyed)", and, doing so,
    that the chain was intact: the head's word that the chain is unkeyed was taken."""
    target.fill(key=KEY)
    downgrade(target, keep=7)
    assert verify(target.store).ok  # the documented limit of an unkeyed chain
    for report in (verify(target.store, key=KEY), verify_run(target.store, "run-a", key=KEY)):
        assert [(p.seq, p.kind) for p in report.problems] == [(0, ProblemKind.DOWNGRADED)]
        assert "no key" not in report.problems[0].detail and "downgraded" in report.problems[0].detail


def test_a_writer_with_another_key_is_refused_before_it_writes(target: Target) -> None:
    """Another key's writer was let in: the trail then verified under neither key."""
    target.fill(key=KEY)
    other = target.reopen()
    try:
        with pytest.raises(ConfigurationError, match="does not verify under this writer's key"):
            AuditLog(other, key=b"another-key-0123456789")
        with pytest.raises(ConfigurationError, match="does not verify"):
            other.append(
                [Draft(run_id="r", kind=EventKind.NOTE, timestamp_ns=1)], Chain(b"another-key-0123456789")
            )
    finally:
        other.close()
    assert len(target.rows()) == 10
    target.fill(events=2, key=KEY)  # its own key goes on
    report = verify(target.store, key=KEY)
    assert report.ok and report.checked == 12


def test_a_reader_writes_nothing_and_creates_nothing(target: Target) -> None:
    """Opened for verify, the store ran its schema: a deleted head record came back."""
    target.fill()
    target.sql("DELETE FROM {head}")
    reader = target.reader()
    try:
        assert reader.head() is None
        assert [(p.seq, p.kind) for p in verify(reader).problems] == [(0, ProblemKind.HEAD_FORGED)]
        with pytest.raises(ConfigurationError, match="read-only"):
            reader.append([Draft(run_id="r", kind=EventKind.NOTE, timestamp_ns=1)], Chain())
        target.sql("DROP TABLE {head}")
        with pytest.raises(AuditStoreError):
            verify(reader)  # a damaged store is no verdict either way
    finally:
        reader.close()
    target.sql("DROP TABLE {events}")
    reader = target.reader()
    try:
        with pytest.raises(AuditStoreError):
            list(reader.rows())
    finally:
        reader.close()
    with pytest.raises(Exception, match="_events"):  # still gone: nothing made it again
        target.sql("SELECT 1 FROM {events}")


def test_a_column_that_disagrees_with_the_signed_body_is_found(target: Target) -> None:
    target.fill()
    target.sql("UPDATE {events} SET run_id = 'run-z' WHERE seq = 2")
    assert kinds_at(target) == [(2, ProblemKind.COLUMN_MISMATCH)]


@pytest.mark.parametrize("column", ["step = step + 100", "timestamp_ns = 0"])
def test_an_edited_step_or_timestamp_column_is_found(target: Target, column: str) -> None:
    """A query by hour or by step reads these columns: an event moved out of its hour is found."""
    target.fill()
    target.sql(f"UPDATE {{events}} SET {column} WHERE seq = 3")
    assert kinds_at(target) == [(3, ProblemKind.COLUMN_MISMATCH)]


def test_rows_of_types_stockade_never_writes_are_problems_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "audit.db"
    target = Target(
        SQLiteStore(path),
        lambda: SQLiteStore(path),
        lambda statement: None,
        lambda: SQLiteStore(path, read_only=True),
        lambda: SQLiteStore(path, namespace="other"),
    )
    target.fill()
    target.store.close()
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TRIGGER IF EXISTS audit_events_no_update")
        conn.execute(
            "UPDATE audit_events SET body = CAST(replace(body, 'run_code', 'rm') AS BLOB) WHERE seq = 2"
        )
        conn.execute("UPDATE audit_events SET body = CAST(X'7b22ff' AS TEXT) WHERE seq = 4")  # not UTF-8
        conn.execute("UPDATE audit_events SET body = ? WHERE seq = 6", ("[" * 100_000 + "]" * 100_000,))
        conn.execute("UPDATE audit_events SET step = 'two' WHERE seq = 8")
    with SQLiteStore(path) as store:
        found = {(p.seq, p.kind) for p in verify(store).problems}
        assert {(2, ProblemKind.EDITED), (4, ProblemKind.UNREADABLE), (6, ProblemKind.UNREADABLE)} <= found
        assert (8, ProblemKind.COLUMN_MISMATCH) in found
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE audit_head SET seq = 'ten' WHERE id = 1")
    with SQLiteStore(path) as store:
        report = verify(store)
    assert (0, ProblemKind.HEAD_FORGED) in {(p.seq, p.kind) for p in report.problems}
    assert report.checked == 10  # and every event was still read


def test_verify_of_one_run_reports_that_run_and_counts_the_rest(target: Target) -> None:
    # A problem of another run only: an event of run-b whose column says run-c (its signed
    # body says run-b, and is intact).
    target.fill()
    target.sql("UPDATE {events} SET run_id = 'run-c' WHERE seq = 8")  # run-b
    report = verify(target.store, run_id="run-a")
    assert report.ok and report.run_events == 5 and report.problems_elsewhere == 1
    assert not verify(target.store, run_id="run-b").ok


def test_verify_of_one_run_reports_its_events_moved_away_and_edits_whose_run_nobody_can_tell(
    target: Target,
) -> None:
    # An event of run-a moved to another run by its column passed a check of run-a; so did
    # one whose body was edited to name another run (an edited body's run proves nothing).
    target.fill(key=KEY)
    target.sql("UPDATE {events} SET run_id = 'zzz' WHERE seq = 2")  # run-a
    moved = verify(target.store, run_id="run-a", key=KEY)
    assert [(p.seq, p.kind) for p in moved.problems] == [(2, ProblemKind.COLUMN_MISMATCH)]
    target.sql("UPDATE {events} SET run_id = 'run-a' WHERE seq = 2")
    target.sql("UPDATE {events} SET run_id = 'zzz', body = replace(body, 'run-a', 'zzz') WHERE seq = 3")
    edited = verify(target.store, run_id="run-a", key=KEY)
    assert [(p.seq, p.kind) for p in edited.problems] == [(3, ProblemKind.EDITED)]
    assert not verify(target.store, run_id="run-b", key=KEY).ok  # it could have been anyone's


def test_two_writers_on_two_connections_make_one_chain(target: Target) -> None:
    other = target.reopen()

    def write(store: AuditStore, run: str) -> None:
        with AuditLog(store, batch_size=16, flush_interval_s=None) as log:
            for step in range(200):
                log.record(EventKind.COMMAND, run_id=run, step=step)

    threads = [threading.Thread(target=write, args=(s, r)) for s, r in ((target.store, "a"), (other, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    other.close()
    report = verify(target.store)
    assert report.ok, report.problems
    assert report.checked == 400


def test_a_chain_another_writer_appends_to_meanwhile_verifies(target: Target) -> None:
    # verify reads the head record, then the events: a writer of another process appends
    # between the two (and moves the head with its events). Its events are no forgery.
    target.fill()
    other = target.reopen()
    done = threading.Event()

    def write() -> None:
        with AuditLog(other, batch_size=4, flush_interval_s=None) as log:
            for step in range(600):
                log.record(EventKind.COMMAND, run_id="live", step=step)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    reports = []
    try:
        while not done.is_set():
            reports.append(verify(target.store))
    finally:
        writer.join()
        other.close()
    assert reports and all(r.ok for r in reports), [r.problems for r in reports if not r.ok][:3]
    assert verify(target.store).checked == 610


def test_a_sealed_run_is_erased_by_forgetting_its_key(target: Target) -> None:
    with AuditLog(target.store, key=KEY, flush_interval_s=None) as log:
        log.seal_run("run-a", "alice")
        for run_id in ("run-a", "run-b"):
            log.record(EventKind.TOOL_CALL, run_id=run_id, attributes={"tool": "t", "note": "alice's record"})
    assert "alice's record" not in target.rows()[0][1]
    assert [e.attributes["note"] for e in target.store.events()] == ["alice's record"] * 2
    before = target.rows()
    assert target.store.erase_keys(Chain(KEY), subject="alice") == ["run-a"]
    reopened = target.reopen()  # the key is gone for every reader, not just this connection
    try:
        erased = [e.attributes for e in reopened.events(run_id="run-a") if e.kind is EventKind.TOOL_CALL]
        assert erased == [{"tool": "t", "$erased": True}]
        assert [e.attributes["note"] for e in reopened.events(run_id="run-b")] == ["alice's record"]
        after = target.rows()
        assert after[: len(before)] == before and verify(reopened, key=KEY).ok  # not one event changed
        assert [e.kind for e in reopened.events(after_seq=len(before))] == [EventKind.RUN_ERASED]
    finally:
        reopened.close()


def sealed_run_and_a_bystander(target: Target) -> None:
    with AuditLog(target.store, key=KEY, flush_interval_s=None) as log:
        log.seal_run("run-a", "alice")
        log.seal_run("run-c", "carol")
        for run_id in ("run-a", "run-b", "run-c"):
            log.record(EventKind.TOOL_CALL, run_id=run_id, attributes={"tool": "t", "note": "personal"})


def test_a_sealed_runs_key_deleted_or_replaced_outside_stockade_fails_verify(target: Target) -> None:
    """The keys table cannot be append-only (erasure forgets keys): a key deleted in the
    database made its run read as erased, and a key replaced made it unreadable, while verify
    said intact (found from outside). The chain now records each erasure, and the table must
    agree with it."""
    sealed_run_and_a_bystander(target)
    assert verify(target.store, key=KEY).ok
    target.sql(
        "UPDATE {keys} SET key = (SELECT key FROM {keys} WHERE run_id = 'run-a') WHERE run_id = 'run-c'"
    )
    target.sql("DELETE FROM {keys} WHERE run_id = 'run-a'")
    reader = target.reader()
    try:
        report = verify(reader, key=KEY)
        assert sorted((p.run_id, p.kind) for p in report.problems) == [
            ("run-a", ProblemKind.RUN_KEY_GONE),
            ("run-c", ProblemKind.RUN_KEY_FORGED),
        ], report.problems
        assert [p.kind for p in verify(reader, key=KEY, run_id="run-b").problems] == []
    finally:
        reader.close()


def test_an_erasure_is_in_the_chain_and_a_key_made_after_it_is_reported(target: Target) -> None:
    sealed_run_and_a_bystander(target)
    with AuditLog(target.store, key=KEY, flush_interval_s=None) as log:
        assert log.erase(subject="alice") == ["run-a"]
        assert log.erase(subject="alice") == []  # once: nothing left to record
    report = verify(target.store, key=KEY)
    assert report.ok, report.problems  # an erasure stockade made is no problem
    assert [e.run_id for e in target.store.events() if e.kind is EventKind.RUN_ERASED] == ["run-a"]
    target.store.run_key("run-a", "alice")  # a key for the erased run, made afresh
    assert [(p.run_id, p.kind) for p in verify(target.store, key=KEY).problems] == [
        ("run-a", ProblemKind.RUN_KEY_FORGED)
    ]


def test_a_chain_copied_under_another_namespace_fails_verify(target: Target) -> None:
    """One tenant's trail copied whole, head and all, under another tenant's namespace in the
    same database verified as that tenant's (found from outside): the head's MAC now names
    the namespace."""
    target.fill(6, key=KEY)
    other = target.other()
    try:
        target.sql("INSERT INTO {other}_events SELECT * FROM {events}")
        target.sql("DELETE FROM {other}_head")
        target.sql("INSERT INTO {other}_head SELECT * FROM {head}")
        report = verify(other, key=KEY)
        assert [p.kind for p in report.problems] == [ProblemKind.HEAD_FORGED], report.problems
        assert "another namespace" in report.problems[0].detail
        with pytest.raises(ConfigurationError, match="head record"):
            AuditLog(other, key=KEY)  # nor does a writer append to it
        assert verify(target.store, key=KEY).ok
    finally:
        other.close()


def test_verify_of_a_postgresql_trail_with_no_run_store_checks_the_trail_alone(
    postgres_url: str, tmp_path: Path
) -> None:
    """On a database holding only the audit tables, verify exited 3 ("run store ... lacks
    runs_runs, ..."): it opened the run store where the SQLite path first looks for it."""
    from typer.testing import CliRunner

    from stockade.cli.main import app
    from stockade.runs import open_run_store

    with open_store(postgres_url, namespace="trail") as store, AuditLog(store, key=KEY) as log:
        log.record(EventKind.NOTE, run_id="run-a", attributes={"n": 1})
    (tmp_path / "key").write_bytes(KEY + b"\n")
    verify_args = [
        "audit",
        "verify",
        "--db",
        postgres_url,
        "--namespace",
        "trail",
        "--key-file",
        str(tmp_path / "key"),
    ]

    alone = CliRunner().invoke(app, [*verify_args, "--json"])
    assert alone.exit_code == 0 and json.loads(alone.stdout)["ledger"] is False, alone.output
    said = CliRunner().invoke(app, verify_args)
    assert said.exit_code == 0 and "not cross-checked" in said.output, said.output
    named = CliRunner().invoke(app, [*verify_args, "--runs-db", postgres_url])
    assert named.exit_code == 2 and "no run store" in named.output, named.output

    open_run_store(postgres_url, key=KEY).close()  # a run store now: cross-checked
    checked = CliRunner().invoke(app, [*verify_args, "--json"])
    assert checked.exit_code == 0 and json.loads(checked.stdout)["ledger"] is True, checked.output
