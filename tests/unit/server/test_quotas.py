"""Quotas in the service's database (``ServiceStore``, on a real SQLite file): the arithmetic of
live sandboxes, CPUs and memory, what the refusal says, and reservations racing from several
connections (as from several API processes)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import exceptions as exc
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore
from stockade.server.tenants import Quotas

QUOTAS = Quotas(sandboxes=3, cpus=2.0, memory_mb=1024)


@pytest.fixture
def db_path(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'service.db'}"


@pytest.fixture
def store(db_path: str) -> Iterator[ServiceStore]:
    opened = ServiceStore(open_database(db_path))
    yield opened
    opened.close()


def reserve(
    store: ServiceStore, sandbox_id: str, *, cpus: float = 0.5, memory_mb: int = 256, tenant: str = "acme",
    quotas: Quotas = QUOTAS,
) -> None:  # fmt: skip
    store.reserve_sandbox(
        sandbox_id=sandbox_id, tenant=tenant, owner="owner-1", tier="process", cpus=cpus,
        memory_mb=memory_mb, quotas=quotas,
    )  # fmt: skip


def held(store: ServiceStore, tenant: str = "acme") -> list[str]:
    return sorted(r.sandbox_id for r in store.sandboxes() if r.tenant == tenant)


def test_the_count_is_a_quota_and_a_release_frees_its_place(store: ServiceStore) -> None:
    for i in range(3):
        reserve(store, f"s{i}", cpus=0.1, memory_mb=10)
    with pytest.raises(exc.QuotaExceeded) as full:
        reserve(store, "s3", cpus=0.1, memory_mb=10)
    assert (full.value.quota, full.value.limit, full.value.used) == ("sandboxes", 3, 3)
    assert not full.value.retryable and "delete a sandbox" in str(full.value)
    store.release_sandbox("s1")
    store.release_sandbox("s1")  # twice: harmless
    reserve(store, "s3", cpus=0.1, memory_mb=10)
    assert held(store) == ["s0", "s2", "s3"]


def test_cpus_add_up_exactly_to_the_quota(store: ServiceStore) -> None:
    tenths = Quotas(sandboxes=10, cpus=0.3, memory_mb=1024)
    for i in range(3):  # 0.1 + 0.1 + 0.1 is 0.30000000000000004 in floating point
        reserve(store, f"s{i}", cpus=0.1, memory_mb=1, quotas=tenths)
    with pytest.raises(exc.QuotaExceeded) as over:
        reserve(store, "s3", cpus=0.001, memory_mb=1, quotas=tenths)
    assert over.value.quota == "cpus" and over.value.limit == 0.3 and over.value.used == pytest.approx(0.3)
    assert "0.3 of its 0.3 cpus" in str(over.value)


def test_cpus_past_the_quota_are_refused_with_what_is_used(store: ServiceStore) -> None:
    reserve(store, "a", cpus=1.5)
    with pytest.raises(exc.QuotaExceeded) as over:
        reserve(store, "b", cpus=0.75)
    assert (over.value.quota, over.value.limit, over.value.used) == ("cpus", 2.0, 1.5)
    reserve(store, "b", cpus=0.5)  # exactly at the quota: taken


def test_memory_past_the_quota_is_refused(store: ServiceStore) -> None:
    reserve(store, "a", memory_mb=1000)
    with pytest.raises(exc.QuotaExceeded) as over:
        reserve(store, "b", memory_mb=25)
    assert (over.value.quota, over.value.limit, over.value.used) == ("memory_mb", 1024, 1000)
    reserve(store, "b", memory_mb=24)
    assert held(store) == ["a", "b"]


def test_one_sandbox_bigger_than_the_whole_quota_is_refused_on_an_empty_tenant(store: ServiceStore) -> None:
    with pytest.raises(exc.QuotaExceeded) as over:
        reserve(store, "a", cpus=4.0)
    assert over.value.quota == "cpus" and over.value.used == 0
    nothing = Quotas(sandboxes=0, cpus=8.0, memory_mb=8192)
    with pytest.raises(exc.QuotaExceeded) as none:
        reserve(store, "b", quotas=nothing)
    assert none.value.quota == "sandboxes"
    assert held(store) == []


def test_tenants_have_quotas_of_their_own(store: ServiceStore) -> None:
    for i in range(3):
        reserve(store, f"a{i}")
    for i in range(3):
        reserve(store, f"b{i}", tenant="other")
    assert len(held(store)) == 3 and len(held(store, "other")) == 3


def test_reservations_racing_from_several_connections_never_exceed_the_quota(db_path: str) -> None:
    stores = [ServiceStore(open_database(db_path)) for _ in range(6)]
    quotas = Quotas(sandboxes=5, cpus=100.0, memory_mb=100_000)
    won: list[str] = []
    refused: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(stores))

    def contend(n: int, store: ServiceStore) -> None:
        barrier.wait()
        for i in range(4):
            sandbox_id = f"s{n}-{i}"
            try:
                reserve(store, sandbox_id, quotas=quotas)
            except exc.QuotaExceeded:
                with lock:
                    refused.append(sandbox_id)
            else:
                with lock:
                    won.append(sandbox_id)

    threads = [threading.Thread(target=contend, args=(n, s)) for n, s in enumerate(stores)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert len(won) == 5 and len(refused) == 19
        assert held(stores[0]) == sorted(won)
    finally:
        for store in stores:
            store.close()


def test_runs_queued_or_running_are_a_quota(store: ServiceStore) -> None:
    spec: dict[str, object] = {"task": "t"}
    for i in range(2):
        assert store.add_run(run_id=f"r{i}", tenant="acme", role=None, spec=spec, labels={}, max_active=2)
    assert not store.add_run(run_id="r2", tenant="acme", role=None, spec=spec, labels={}, max_active=2)
    assert store.run("r2") is None  # refused: nothing written
    assert store.set_status("r0", "success")
    assert store.add_run(run_id="r2", tenant="acme", role=None, spec=spec, labels={}, max_active=2)
    with pytest.raises(exc.RunConflict):
        store.add_run(run_id="r2", tenant="acme", role=None, spec=spec, labels={}, max_active=9)


def run(
    store: ServiceStore, run_id: str, *, cpus: float = 0.5, memory_mb: int = 256, quotas: Quotas = QUOTAS
) -> None:
    """A run of acme's that starts: recorded, then holding its sandbox's share."""
    if store.run(run_id) is None:
        store.add_run(run_id=run_id, tenant="acme", role=None, spec={"task": "t"}, labels={}, max_active=100)
    store.hold_run(run_id=run_id, tenant="acme", worker="w1", cpus=cpus, memory_mb=memory_mb, quotas=quotas)
    store.set_status(run_id, "running", worker="w1", started=True)


def test_running_runs_and_sandboxes_fill_one_quota(store: ServiceStore) -> None:
    run(store, "r0", cpus=1.0, memory_mb=512)
    run(store, "r1", cpus=0.5, memory_mb=256)
    with pytest.raises(exc.QuotaExceeded) as cpus:  # the runs' sandboxes count for the API's
        reserve(store, "s0", cpus=0.75)
    assert (cpus.value.quota, cpus.value.used) == ("cpus", 1.5)
    reserve(store, "s0", cpus=0.5, memory_mb=256)
    with pytest.raises(exc.QuotaExceeded) as count:  # and the API's for the runs'
        run(store, "r2", cpus=0.0, memory_mb=0)
    assert count.value.quota == "sandboxes" and "this run's sandbox" in str(count.value)
    assert store.run("r2") is not None and store.run("r2").status == "queued"  # type: ignore[union-attr]
    assert store.holds("acme") == ["r0", "r1"]


def test_a_run_gives_its_share_back_when_it_stops_running(store: ServiceStore) -> None:
    for status in ("paused", "success", "queued", "interrupted", "error"):
        run(store, "r0", cpus=2.0)
        assert store.holds("acme") == ["r0"]
        store.set_status("r0", status)
        assert store.holds("acme") == [], status
    run(store, "r0", cpus=2.0)
    run(store, "r0", cpus=2.0)  # another delivery of the run that runs: its one share, kept
    assert store.holds("acme") == ["r0"]


def test_a_refused_set_status_keeps_the_share(store: ServiceStore) -> None:
    run(store, "r0")
    assert not store.set_status("r0", "success", only_from=["queued"])
    assert store.holds("acme") == ["r0"]
