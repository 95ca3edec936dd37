"""``verify_run``: one run's events and their links into the chain, read in proportion to the
run (what the run viewer shows), not to the trail; and what tampering it still finds."""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import pytest

from stockade.audit.events import Chain, Draft, EventKind
from stockade.audit.ledger import ForgedRow, LedgerCall
from stockade.audit.stores import Row, SQLiteStore
from stockade.audit.verify import verify, verify_run
from stockade.audit.verify_report import ProblemKind

KEY = b"k" * 32
MINE = "mine"
# the trail, in seq order: (run, kind, idempotency key of a tool call)
TRAIL = [
    ("other", "note", ""),  # 1
    (MINE, "run_start", ""),  # 2
    ("other", "note", ""),  # 3
    (MINE, "tool_call", "k1"),  # 4
    (MINE, "command", ""),  # 5
    ("other", "note", ""),  # 6
    (MINE, "tool_call", "k2"),  # 7, between two events of another run
    ("other", "note", ""),  # 8
    (MINE, "run_end", ""),  # 9
    ("other", "note", ""),  # 10
]


def write(path: Path, trail: Iterable[tuple[str, str, str]] = TRAIL) -> None:
    drafts = [
        Draft(
            run_id=run,
            kind=EventKind(kind),
            step=1,
            timestamp_ns=1,
            attributes={"idempotency_key": key, "tool": "t"} if key else {"n": n},
        )
        for n, (run, kind, key) in enumerate(trail)
    ]
    with SQLiteStore(path) as store:
        store.append(drafts, Chain(KEY))


class Ledger:
    """The run store's ledger of ``MINE``: the calls it made."""

    def ledger_calls(self, run_id: str | None = None) -> list[LedgerCall]:
        return [LedgerCall(MINE, 1, key, "t") for key in ("k1", "k2") if run_id in (None, MINE)]

    def forged_rows(self, run_id: str | None = None) -> list[ForgedRow]:
        return []

    def calls_in_flight(self, run_id: str | None = None) -> list[LedgerCall]:
        return []

    def live_runs(self, run_ids: Collection[str]) -> Collection[str]:
        return ()

    def stored_runs(self, run_ids: Collection[str]) -> Collection[str]:
        return run_ids


def tamper(path: Path, *statements: str) -> None:
    """What someone who can write the database does around stockade."""
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TRIGGER IF EXISTS audit_events_no_update")
        conn.execute("DROP TRIGGER IF EXISTS audit_events_no_delete")
        for statement in statements:
            conn.execute(statement)


def kinds(path: Path) -> set[str]:
    with SQLiteStore(path, read_only=True) as store:
        report = verify_run(store, MINE, key=KEY, ledger=Ledger())
    return {p.kind.value for p in report.problems}


def test_an_intact_run_verifies_as_the_whole_chain_does(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    write(path)
    with SQLiteStore(path, read_only=True) as store:
        report = verify_run(store, MINE, key=KEY, ledger=Ledger())
        assert report.ok and report.found and report.run_events == 5
        assert verify(store, run_id=MINE, key=KEY, ledger=Ledger()).ok
        assert not verify_run(store, "nobody", key=KEY).found  # nothing to verify: no events
        wrong = verify_run(store, MINE, key=b"x" * 32)
        assert [p.kind for p in wrong.problems][:1] == [ProblemKind.WRONG_KEY]


@pytest.mark.parametrize(
    ("statements", "found"),
    [
        # the run's event edited in place
        (["UPDATE audit_events SET body = replace(body, '\"n\":4', '\"n\":5') WHERE seq = 5"], "edited"),
        # a queryable column changed (the run's page filters by it)
        (["UPDATE audit_events SET step = 7 WHERE seq = 5"], "column_mismatch"),
        # the run's event deleted after another of the run: the link after seq 4 is gone
        (["DELETE FROM audit_events WHERE seq = 5"], "missing"),
        # another run's event deleted just before one of the run's
        (["DELETE FROM audit_events WHERE seq = 3"], "missing"),
        # another run's event before the run's replaced, hash and all
        (["UPDATE audit_events SET hash = 'f00d' WHERE seq = 6"], "broken_link"),
        # the run's tool call deleted from between two events of another run: the ledger has it
        (["DELETE FROM audit_events WHERE seq = 7"], "not_in_trail"),
        # the tail cut, the head left
        (["DELETE FROM audit_events WHERE seq >= 9"], "truncated"),
        # the tail cut and the head moved back to an event (its MAC no longer fits)
        (
            [
                "DELETE FROM audit_events WHERE seq >= 9",
                "UPDATE audit_head SET seq = 8, hash = (SELECT hash FROM audit_events WHERE seq = 8)",
            ],
            "head_forged",
        ),
    ],
)
def test_tampering_with_the_run_or_its_links_is_found(
    tmp_path: Path, statements: list[str], found: str
) -> None:
    path = tmp_path / "a.db"
    write(path)
    tamper(path, *statements)
    assert found in kinds(path)


def test_what_it_leaves_to_the_whole_chain_check(tmp_path: Path) -> None:
    """Another run's event edited away from the run's is not this run's problem, and is
    not read: ``verify`` of the whole chain finds it."""
    path = tmp_path / "a.db"
    write(path)
    tamper(path, "UPDATE audit_events SET body = replace(body, '\"n\":0', '\"n\":1') WHERE seq = 1")
    assert kinds(path) == set()
    with SQLiteStore(path, read_only=True) as store:
        assert [p.kind for p in verify(store, key=KEY).problems] == [ProblemKind.EDITED]


class CountingStore(SQLiteStore):
    """A store that counts the rows read through it."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, read_only=True)
        self.read = 0

    def rows(self, *, run_id: str | None = None, after_seq: int = 0) -> Iterator[Row]:
        for row in super().rows(run_id=run_id, after_seq=after_seq):
            self.read += 1
            yield row

    def rows_at(self, seqs: Collection[int]) -> list[Row]:
        found = super().rows_at(seqs)
        self.read += len(found)
        return found


def test_rows_read_are_the_runs_and_their_neighbours_whatever_the_trail(tmp_path: Path) -> None:
    """A 5-event run in a trail of 50,000 events: the whole chain read each (~10 us an event:
    5 s at 500,000); the run's check reads its events, one on either side of each, the head's."""
    path = tmp_path / "a.db"
    write(path)
    with SQLiteStore(path) as store:
        for _ in range(10):
            drafts = [Draft(run_id=f"r{n % 50}", kind=EventKind.NOTE, timestamp_ns=1) for n in range(5000)]
            store.append(drafts, Chain(KEY))
    counting = CountingStore(path)
    try:
        report = verify_run(counting, MINE, key=KEY, ledger=Ledger())
        assert report.ok and report.run_events == 5 and report.last_seq == 50_010
        assert counting.read <= 3 * 5 + 2
    finally:
        counting.close()
