"""AuditLog: batching, threads, and what happens when the store fails."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from stockade.audit import AuditEvent, AuditLog, Chain, Draft, EventKind, MemoryStore, SQLiteStore, verify
from stockade.exceptions import AuditStoreError, ConfigurationError, InvalidArgument
from tests.conftest import wait_for


class FlakyStore(MemoryStore):
    """A store whose next ``failures`` appends fail, as a database that is briefly away."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def append(self, drafts: Sequence[Draft], chain: Chain) -> list[AuditEvent]:
        if self.failures:
            self.failures -= 1
            raise AuditStoreError("database is away")
        return super().append(drafts, chain)


def record(log: AuditLog, step: int = 0) -> None:
    log.record(EventKind.TOOL_CALL, run_id="run-1", step=step, actor="agent", attributes={"tool": "ls"})


def test_events_are_written_in_batches() -> None:
    store = MemoryStore()
    log = AuditLog(store, batch_size=3, flush_interval_s=None)

    record(log)
    record(log)
    assert store.head() is None and log.pending == 2
    record(log)
    assert store.head() is not None and store.head().seq == 3  # type: ignore[union-attr]


def test_flush_and_close_write_what_is_queued() -> None:
    store = MemoryStore()
    with AuditLog(store, flush_interval_s=None) as log:
        record(log)
        assert [e.seq for e in log.flush()] == [1]
        record(log)
    assert [e.seq for e in store.events()] == [1, 2]


def test_a_background_thread_flushes_after_the_interval() -> None:
    store = MemoryStore()
    log = AuditLog(store, flush_interval_s=0.01)
    record(log)
    for _ in range(500):
        if store.head() is not None:
            break
        threading.Event().wait(0.01)
    assert store.head() is not None
    log.close()


def test_many_threads_make_one_linear_chain(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "audit.db")
    log = AuditLog(store, batch_size=64, flush_interval_s=0.005)

    def worker() -> None:
        for i in range(300):
            record(log, i)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()

    report = verify(store)
    assert report.ok, report.problems
    assert report.checked == 1800


def test_a_failed_write_keeps_the_events_and_stops_the_caller() -> None:
    store = FlakyStore(failures=3)
    log = AuditLog(store, batch_size=2, flush_interval_s=None)
    record(log, 1)

    with pytest.raises(AuditStoreError):
        record(log, 2)  # fills the batch; the write fails: the caller hears of it
    assert log.pending == 2

    with pytest.raises(AuditStoreError):  # still broken (its write tried again): stopped, its event kept
        record(log, 3)
    with pytest.raises(AuditStoreError):  # and what checks before it acts (a write tried again) does not act
        log.check()
    assert store.failures == 0 and log.pending == 3
    # The store is back: the next record's write mends it by itself. (Nothing wrote before: a
    # log without a flusher refused every record for ever after a full disk had cleared.)
    record(log, 4)
    assert log.pending == 0
    log.check()
    assert [e.step for e in store.events()] == [1, 2, 3, 4]
    assert verify(store).ok


def test_a_failed_background_write_stops_every_caller_until_one_succeeds() -> None:
    store = FlakyStore(failures=3)
    log = AuditLog(store, flush_interval_s=0.01)
    record(log, 1)
    wait_for(lambda: store.failures < 3, what="the background write to fail", timeout_s=5, interval_s=0.01)
    with pytest.raises(AuditStoreError):
        log.check()
    wait_for(lambda: store.head() is not None, what="a write to succeed", timeout_s=5, interval_s=0.01)
    log.check()
    record(log, 2)
    log.close()
    assert [e.step for e in store.events()] == [1, 2]


@pytest.mark.parametrize("run_id", ["job-\udcff", "job\x00", "x" * 257, "a\nb"])
def test_a_run_id_no_store_can_keep_is_refused_and_never_wedges_the_log(run_id: str, tmp_path: Path) -> None:
    """A lone surrogate (bytes that are no UTF-8) SQLite refuses to store, a NUL PostgreSQL: queued,
    it failed its batch, for good, with every event after it."""
    store = SQLiteStore(tmp_path / "audit.db")
    log = AuditLog(store, flush_interval_s=None)
    with pytest.raises(InvalidArgument) as refused:
        log.record(EventKind.TOOL_CALL, run_id=run_id)
    assert refused.value.argument == "run_id" and log.pending == 0
    record(log, 1)
    log.close()
    assert [e.step for e in store.events()] == [1]


def test_a_closed_log_refuses_events() -> None:
    log = AuditLog(MemoryStore())
    log.close()
    with pytest.raises(ConfigurationError):
        record(log)


def test_attributes_are_redacted_before_they_are_queued() -> None:
    store = MemoryStore()
    with AuditLog(store) as log:
        log.redactor.add_secret("s3cr3t-value")
        log.record(EventKind.COMMAND, run_id="r", attributes={"argv": ["echo", "s3cr3t-value"]})
    (event,) = store.events()
    assert event.attributes == {"argv": ["echo", "[REDACTED:secret]"]}


def test_a_store_refuses_a_chain_of_another_kind() -> None:
    store = MemoryStore()
    with AuditLog(store, key=b"k" * 32) as log:
        record(log)
    with pytest.raises(ConfigurationError, match="pass its key"), AuditLog(store) as log:
        record(log)
        log.flush()


def test_a_writer_with_another_key_is_refused_before_it_writes(tmp_path: Path) -> None:
    """A second process with another key appended to a keyed store: its events verified under
    neither key (under the first, they read as edited and the head as forged; under the second,
    the first's did), so the trail could never be verified again."""
    path = tmp_path / "audit.db"
    with SQLiteStore(path) as store, AuditLog(store, key=b"a" * 32, flush_interval_s=None) as log:
        for step in range(5):
            record(log, step)
    with SQLiteStore(path) as store:
        with pytest.raises(ConfigurationError, match="does not verify under this writer's key"):
            AuditLog(store, key=b"b" * 32)
        # the store refuses it too, whoever calls it (the head may move after a log is made)
        with pytest.raises(ConfigurationError, match="does not verify"):
            store.append([Draft(run_id="r", kind=EventKind.NOTE, timestamp_ns=1)], Chain(b"b" * 32))
        assert [e.seq for e in store.events()] == [1, 2, 3, 4, 5]
        with AuditLog(store, key=b"a" * 32, flush_interval_s=None) as log:  # its own key goes on
            record(log, 5)
        assert verify(store, key=b"a" * 32).ok and verify(store, key=b"a" * 32).checked == 6


def test_a_head_moved_back_is_not_signed_over_by_the_next_write(tmp_path: Path) -> None:
    """The tail cut and the head moved back (its MAC no longer fits): appending after it
    would write a fresh MAC over the cut, and verify would find nothing."""
    path = tmp_path / "audit.db"
    with SQLiteStore(path) as store, AuditLog(store, flush_interval_s=None) as log:
        for step in range(3):
            record(log, step)
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TRIGGER audit_events_no_delete")
        conn.execute("DELETE FROM audit_events WHERE seq = 3")
        conn.execute("UPDATE audit_head SET seq = 2, hash = (SELECT hash FROM audit_events WHERE seq = 2)")
    with SQLiteStore(path) as store:
        with pytest.raises(ConfigurationError, match="its head was edited"):
            store.append([Draft(run_id="r", kind=EventKind.NOTE, timestamp_ns=1)], Chain())
        assert [p.kind.value for p in verify(store).problems] == ["head_forged"]


def test_a_lone_surrogate_in_an_event_is_recorded_and_jams_nothing(tmp_path: Path) -> None:
    # A label of bytes that are no UTF-8 (a lone surrogate) failed to encode: its batch was
    # tried again at every flush, and every later event of that log was lost.
    with SQLiteStore(tmp_path / "audit.db") as store:
        with AuditLog(store, flush_interval_s=None) as log:
            log.record(EventKind.SANDBOX_START, run_id="r", attributes={"labels": {"\ud800": "x"}})
            log.flush()
            log.record(EventKind.COMMAND, run_id="r", attributes={"argv": ["true"]})
        events = list(store.events(run_id="r"))
        assert [e.kind for e in events] == [EventKind.SANDBOX_START, EventKind.COMMAND]
        assert events[0].attributes["labels"] == {"\ud800": "x"}
        assert verify(store).ok


def test_an_event_the_store_cannot_keep_is_refused_at_record_and_the_log_goes_on() -> None:
    """Found from outside: a step of 2**70 or an attribute of 10**5000 failed at the flush,
    went back to the front of the queue, and every later record() failed."""
    store = MemoryStore()
    with AuditLog(store) as log:
        for bad in ({"step": 2**70}, {"timestamp_ns": -1}, {"duration_s": float("inf")}):
            with pytest.raises(InvalidArgument):
                log.record(EventKind.COMMAND, run_id="r", **bad)
        with pytest.raises(InvalidArgument, match="no audit event kind"):
            log.record("bogus", run_id="r")  # type: ignore[arg-type]
        log.record(EventKind.COMMAND, run_id="r", attributes={"n": 10**5000, "m": -(2**63)})
        log.record(EventKind.COMMAND, run_id="r", step=1)
    (first, second) = list(store.events())
    assert first.attributes == {"n": "<an integer of 16610 bits>", "m": -(2**63)} and second.step == 1
    assert verify(store).ok
    assert list(store.events(after_seq=2**70)) == [] and len(list(store.events(after_seq=-(2**70)))) == 2
    with pytest.raises(InvalidArgument):
        verify(store, expected_head=("a", "x"))  # type: ignore[arg-type]


class FullStore(MemoryStore):
    """A store whose disk fills at ``room`` events: a batch past them fails, as SQLite's
    "database or disk is full" (the batch is one transaction: none of it is written)."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def append(self, drafts: Sequence[Draft], chain: Chain) -> list[AuditEvent]:
        held = 0 if self.head() is None else self.head().seq  # type: ignore[union-attr]
        if held + len(drafts) > self.room:
            raise AuditStoreError("database or disk is full")
        return super().append(drafts, chain)


def test_check_writes_what_is_queued_so_an_action_waits_for_no_background_write() -> None:
    """Before an action, ``check()`` writes what came before it: the store filling is known
    then, not at a background write up to ``flush_interval_s`` later (every action in between
    ran unrecorded: 11 ``run_code`` calls of 15, found from outside)."""
    store = FullStore(room=3)
    log = AuditLog(store, flush_interval_s=60)  # a background write far off
    record(log, 1)
    record(log, 2)
    log.check()
    assert [e.step for e in store.events()] == [1, 2] and log.pending == 0
    record(log, 3)
    record(log, 4)
    with pytest.raises(AuditStoreError, match="disk is full") as refused:
        log.check()
    assert refused.value.retryable  # kept queued: a write once there is room writes them
    assert log.pending == 2
    store.room = 10
    log.check()
    assert [e.step for e in store.events()] == [1, 2, 3, 4]
    log.close()


@pytest.mark.parametrize(
    "bad",
    [{"batch_size": None}, {"batch_size": 0}, {"max_pending": None}, {"flush_interval_s": "x"},
     {"flush_interval_s": float("nan")}, {"flush_interval_s": {}}, {"redactor": 0}, {"clock": None},
     {"key": 0}, {"key": "a str key of 32 characters....."}],
)  # fmt: skip
def test_a_log_refuses_settings_it_cannot_keep(bad: dict[str, object]) -> None:
    """Taken before, each failed later: a TypeError at the first record, or (a flush interval
    of "x") a flusher thread that died and never wrote again."""
    with pytest.raises(InvalidArgument):
        AuditLog(MemoryStore(), **bad)  # type: ignore[arg-type]
