"""The service's timer in the database (``server/wakes.py``), on a real SQLite file shared by
two wakers (as by two worker processes): a waiting run goes again when its time comes, once;
a running run is left to the process whose lease is live, and sent again when that process
is gone; a run that pauses or ends has nothing to wake."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import exceptions as exc
from stockade.runs.lease import LEASE_S, owner_token
from stockade.runs.store import RunStore
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore
from stockade.server.wakes import LEASE_GRACE_S, RESEND_S, START_GRACE_S, Waker, Wakes
from tests.conftest import in_forked_child

S = 1_000_000_000  # nanoseconds in a second


class Sent(list[tuple[str, str]]):
    def __call__(self, run_id: str, reason: str) -> None:
        self.append((run_id, reason))


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'service.db'}"


@pytest.fixture
def store(db_url: str) -> Iterator[ServiceStore]:
    opened = ServiceStore(open_database(db_url))
    RunStore(opened.db, namespace="runs")  # its leases table, as the runner has it
    opened.add_run(run_id="r1", tenant="acme", role=None, spec={}, labels={}, max_active=10)
    yield opened
    opened.close()


@pytest.fixture
def wakers(store: ServiceStore, db_url: str) -> Iterator[tuple[Waker, Waker, Sent]]:
    sent = Sent()
    pair = (Waker(Wakes(open_database(db_url)), sent), Waker(Wakes(open_database(db_url)), sent))
    yield pair[0], pair[1], sent
    for waker in pair:
        waker.close()


def lease(store: ServiceStore, owner: str, expires_ns: int) -> None:
    sql = "INSERT INTO runs_leases (run_id, owner, expires_ns, acquired_ns) VALUES ('r1', ?, ?, 0)"
    store.db.write([(sql, [(owner, expires_ns)])])


def dead_owner() -> str:
    """The lease owner of a process of this machine that has ended."""
    # a fork, not a new interpreter: the same proof (its pid ended) without importing stockade
    # again (3 s a token under load)
    return str(in_forked_child(owner_token))


def test_a_waiting_run_goes_again_when_its_time_comes_and_from_one_waker(
    store: ServiceStore, wakers: tuple[Waker, Waker, Sent]
) -> None:
    a, b, sent = wakers
    a.wakes.set("r1", 10.0)  # its tenant's window frees in 10 s
    now = time.time_ns()
    assert a.tick(now) == [] and b.tick(now) == []  # not yet
    assert a.tick(now + 11 * S) == [("r1", "wake")]
    assert b.tick(now + 11 * S) == []  # the other waker found it moved: one message
    # a message lost with the process that sent it: sent once more, long after
    assert b.tick(now + 11 * S + int(RESEND_S * S) + S) == [("r1", "wake")]
    assert sent == [("r1", "wake"), ("r1", "wake")]


def test_a_running_run_is_left_to_the_process_that_holds_its_lease(
    store: ServiceStore, wakers: tuple[Waker, Waker, Sent]
) -> None:
    a, _, sent = wakers
    store.set_status("r1", "running", started=True)
    started = time.time_ns()
    lease(store, owner_token(), started + 60 * S)  # this process: alive
    assert a.tick(started + int(START_GRACE_S * S) + S) == []
    # looked at again just after the lease would end (its holder renews it meanwhile)
    assert a.wakes.at("r1") == started + 60 * S + int(LEASE_GRACE_S * S)
    assert sent == []


def test_a_running_run_whose_process_died_is_sent_again_once(
    store: ServiceStore, wakers: tuple[Waker, Waker, Sent]
) -> None:
    a, b, sent = wakers
    store.set_status("r1", "running", started=True)
    started = time.time_ns()
    lease(store, dead_owner(), started + 3600 * S)  # unexpired, but its process is gone
    first = started + int(START_GRACE_S * S) + S
    assert a.tick(first) == []  # one look is not enough: it may be writing how the run stopped
    second = first + int(LEASE_GRACE_S * S) + 1
    assert a.tick(second) == [("r1", "orphaned")]
    assert b.tick(second) == []
    assert sent == [("r1", "orphaned")]
    # the worker that took it marks it running again: its own grace to claim the lease
    store.set_status("r1", "running", started=True)
    assert a.tick(time.time_ns() + S) == []


def test_a_worker_that_dies_in_a_runs_first_seconds_leaves_it_no_longer_than_one_that_dies_later(
    store: ServiceStore, wakers: tuple[Waker, Waker, Sent]
) -> None:
    """A run's worker dies just after it started the run: the run is sent again within the
    time one whose worker died later waits (its lease's last renewal, the lease's length, a
    second look). Before, a waker first looked 30 s after the start: ~32 s, not ~20 s."""
    a, _, sent = wakers
    store.set_status("r1", "running", started=True)
    started = time.time_ns()
    lease(store, dead_owner(), started + int(LEASE_S * S))  # claimed, then its process died
    first = started + int((LEASE_S + LEASE_GRACE_S) * S)  # when a later death's first look falls
    assert a.tick(first) == []  # one look is not enough: it may be writing how the run stopped
    assert a.tick(first + int(LEASE_GRACE_S * S) + 1) == [("r1", "orphaned")]
    assert sent == [("r1", "orphaned")]


def test_a_copy_sent_for_a_dead_worker_is_sent_once_more_only_after_the_resend_time(
    store: ServiceStore, wakers: tuple[Waker, Waker, Sent]
) -> None:
    """Every worker is down: the copy sent waits in the broker, and each one more would start a
    sandbox (or bounce off the lease) once they come back."""
    a, b, sent = wakers
    store.set_status("r1", "running", started=True)
    started = time.time_ns()
    lease(store, dead_owner(), started + 3600 * S)
    first = started + int(START_GRACE_S * S) + S
    assert a.tick(first) == []
    second = first + int(LEASE_GRACE_S * S) + 1
    assert a.tick(second) == [("r1", "orphaned")]
    # a 130 s outage: before, a copy every START_GRACE_S + LEASE_GRACE_S (4 in all)
    for after_s in range(5, 295, 5):
        assert a.tick(second + after_s * S) == [] and b.tick(second + after_s * S) == []
    # still nobody took it up (or the copy was lost): once more, as for a waiting run
    assert b.tick(second + int(RESEND_S * S) + S) == [("r1", "orphaned")]
    assert sent == [("r1", "orphaned"), ("r1", "orphaned")]


def test_a_run_that_never_claimed_its_lease_is_sent_after_its_grace(
    store: ServiceStore, wakers: tuple[Waker, Waker, Sent]
) -> None:
    a, _, sent = wakers
    store.set_status("r1", "running", started=True)  # its worker died starting its sandbox
    started = time.time_ns()
    assert a.tick(started + int(START_GRACE_S * S) - S) == []
    assert a.tick(started + int(START_GRACE_S * S) + S) == []
    assert a.tick(started + int((START_GRACE_S + LEASE_GRACE_S) * S) + 2 * S) == [("r1", "orphaned")]
    assert sent == [("r1", "orphaned")]


def test_a_run_that_released_its_lease_to_pause_is_not_sent(
    store: ServiceStore, wakers: tuple[Waker, Waker, Sent]
) -> None:
    a, _, sent = wakers
    store.set_status("r1", "running", started=True)
    started = time.time_ns()
    lease(store, owner_token(), 0)  # released: the run stopped, its status about to be written
    assert a.tick(started + int(START_GRACE_S * S) + S) == []
    store.set_status("r1", "paused")  # waits for a person: nothing to wake
    assert a.wakes.at("r1") is None
    assert a.tick(started + 3600 * S) == [] and sent == []


def test_an_ended_run_loses_its_wake_and_a_row_left_behind_is_dropped(
    store: ServiceStore, wakers: tuple[Waker, Waker, Sent]
) -> None:
    a, _, sent = wakers
    store.set_status("r1", "running", started=True)
    store.set_status("r1", "success")
    assert a.wakes.at("r1") is None
    a.wakes.set("r1", 0.0)  # a wake written after the run ended (a late copy)
    assert a.tick(time.time_ns() + S) == [] and a.wakes.at("r1") is None
    assert sent == []


def test_a_run_is_created_with_its_wake_so_a_send_that_never_happened_is_made_later(
    store: ServiceStore, wakers: tuple[Waker, Waker, Sent]
) -> None:
    a, _, sent = wakers  # r1 was added, and its process died before sending it
    assert a.tick(time.time_ns() + int(RESEND_S * S) + S) == [("r1", "wake")]
    assert sent == [("r1", "wake")]


def test_a_send_that_fails_brings_the_wake_back_soon_not_in_resend_s(
    store: ServiceStore, db_url: str
) -> None:
    def away(run_id: str, reason: str) -> None:
        raise exc.ServiceUnavailable("the broker cannot be reached", retry_after=5.0)

    waker = Waker(Wakes(open_database(db_url)), away)
    try:
        waker.wakes.set("r1", 0.0)
        before = time.time_ns()
        with pytest.raises(exc.ServiceUnavailable):
            waker.tick(before + S)
        at = waker.wakes.at("r1")
        # within seconds (SEND_RETRY_S); before: RESEND_S (5 minutes) on, though nothing was sent
        assert at is not None and at <= time.time_ns() + 10 * S
    finally:
        waker.close()
