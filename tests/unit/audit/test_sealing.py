"""A run about a data subject is sealed: its audit events' attributes are encrypted under a key
of the run, kept apart from the chain. Erasing the subject forgets the key: the events stay,
the chain verifies as before, and what they said can never be read again."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade.audit import AuditLog, AuditStore, Chain, EventKind, MemoryStore, SQLiteStore, verify
from stockade.audit.sealing import ERASED, SEALED, Sealer, new_key, open_attributes
from stockade.exceptions import AuditIntegrityError

KEY = b"chain-key-0123456789abcdef"
SECRET = "the patient's diagnosis"


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[AuditStore]:
    made: AuditStore = MemoryStore() if request.param == "memory" else SQLiteStore(tmp_path / "audit.db")
    yield made
    made.close()


def record_two_runs(store: AuditStore) -> None:
    """alice's run is sealed (it is about her); bob's, without a subject, is not."""
    with AuditLog(store, key=KEY, flush_interval_s=None) as log:
        log.seal_run("alice-1", "alice")
        for run_id in ("alice-1", "bob-1"):
            log.record(
                EventKind.TOOL_CALL,
                run_id=run_id,
                step=1,
                actor="agent",
                attributes={"tool": "write_file", "call_id": "c1", "arguments": {"content": SECRET}},
            )


def test_a_sealed_run_reads_back_as_written_and_its_rows_hold_no_plaintext(store: AuditStore) -> None:
    record_two_runs(store)
    alice, bob = (next(store.events(run_id=r)) for r in ("alice-1", "bob-1"))
    assert (
        alice.attributes
        == bob.attributes
        == {
            "tool": "write_file",
            "call_id": "c1",
            "arguments": {"content": SECRET},
        }
    )
    raw = {row.run_id: row.body for row in store.rows()}
    assert SECRET not in raw["alice-1"] and SEALED in raw["alice-1"]
    assert '"tool":"write_file"' in raw["alice-1"]  # what ties events together stays in clear
    assert SECRET in raw["bob-1"]  # a run without a subject is not sealed
    assert verify(store, key=KEY).ok


def test_erasing_the_subject_makes_the_events_unreadable_and_the_chain_still_verifies(
    store: AuditStore,
) -> None:
    record_two_runs(store)
    before = [row.hash for row in store.rows()]
    assert store.erase_keys(Chain(KEY), subject="alice") == ["alice-1"]
    alice, erasure = store.events(run_id="alice-1")
    assert alice.attributes == {"tool": "write_file", "call_id": "c1", ERASED: True}
    assert erasure.kind is EventKind.RUN_ERASED and erasure.attributes == {}
    assert SECRET in json.dumps(next(store.events(run_id="bob-1")).attributes)  # bob is untouched
    after = list(store.rows())
    assert [row.hash for row in after[: len(before)]] == before  # not one event changed
    assert [(row.run_id, row.kind) for row in after[len(before) :]] == [("alice-1", "run_erased")]
    report = verify(store, key=KEY)
    assert report.ok and report.checked == 3
    assert store.erase_keys(Chain(KEY), subject="alice") == []  # idempotent


def test_an_erased_key_is_gone_from_the_database_file(tmp_path: Path) -> None:
    path = tmp_path / "audit.db"
    with SQLiteStore(path) as store:
        record_two_runs(store)
        key = store.run_keys(["alice-1"])["alice-1"]
        store.erase_keys(Chain(KEY), run_ids=["alice-1"])
    data = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("audit.db"))
    assert key not in data  # overwritten (secure_delete, the WAL checkpointed), not in a free page
    with sqlite3.connect(path) as conn:  # the events are still all there
        assert conn.execute("SELECT count(*) FROM audit_events").fetchone() == (3,)  # and the erasure


def test_a_resumed_run_stays_sealed_and_an_erased_one_is_not_sealed_again() -> None:
    store = MemoryStore()
    record_two_runs(store)
    with AuditLog(store, key=KEY, flush_interval_s=None) as resumed:
        assert resumed.continue_sealing("alice-1") and not resumed.continue_sealing("bob-1")
        resumed.record(EventKind.RUN_END, run_id="alice-1", actor="agent", attributes={"note": SECRET})
    assert SECRET not in list(store.rows())[-1].body
    store.erase_keys(Chain(KEY), subject="alice")
    with AuditLog(store, key=KEY, flush_interval_s=None) as later:
        assert not later.continue_sealing("alice-1")  # no key to seal with: nothing to resume


def test_a_sealed_value_opens_only_in_its_own_run_under_its_own_key() -> None:
    key = new_key()
    sealed = Sealer("run-1", key).seal({"tool": "run_code", "code": "print(1)"})
    assert open_attributes("run-1", sealed, key) == {"tool": "run_code", "code": "print(1)"}
    with pytest.raises(AuditIntegrityError, match="does not open"):
        open_attributes("run-2", sealed, key)  # moved to another run's event
    with pytest.raises(AuditIntegrityError):
        open_attributes("run-1", sealed, new_key())
    edited = {**sealed, SEALED: sealed[SEALED][:-4] + "AAAA"}
    with pytest.raises(AuditIntegrityError):
        open_attributes("run-1", edited, key)
    assert Sealer("run-1", key).seal({"tool": "x"}) == {"tool": "x"}  # nothing to hide: no ciphertext


def test_the_export_holds_the_opened_attributes(store: AuditStore) -> None:
    record_two_runs(store)
    (alice,) = store.events(run_id="alice-1")
    exported = alice.to_json()
    assert exported["attributes"] == alice.attributes and exported["hash"] == alice.hash
