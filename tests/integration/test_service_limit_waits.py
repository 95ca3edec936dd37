"""A run that waits for its tenant's rate window waits off the worker: one worker slot, tenant
acme with a small rate and two runs that need more than it allows, tenant other with one run
submitted after them. The acme runs stop where they are when the window is full for longer
than a short wait, go back to "queued" with the reason, and come back when it frees; other's
run takes the slot meanwhile instead of waiting behind them. The same on Celery workers and
on the server's own threads (no Redis)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stockade.client import Client
from stockade.server.state.rows import RunRow
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore
from tests.conftest import require_tier, wait_for
from tests.integration.service_env import REDIS_URL, Server, Tokens, Worker, write_tenants

pytestmark = [pytest.mark.process, pytest.mark.redis, pytest.mark.postgres, pytest.mark.slow]

# two tool actions per 8 s for every run of acme: its third write waits ~8 s for the window (over the
# 5 s a run waits in place)
ACME_RATE = "rate_per_minute = 2\nrate_period_s = 8\n"


@dataclass
class Service:
    server: Server
    tokens: Tokens
    store: ServiceStore
    workers: list[Worker]  # Celery's (none on the server's own threads)
    tenants: Path
    db: str
    queue: str
    folder: Path

    def row(self, run_id: str) -> RunRow:
        row = self.store.run(run_id)
        assert row is not None
        return row

    def ended(self, run_id: str, *, what: str, timeout_s: float) -> RunRow:
        def over() -> RunRow | None:
            row = self.row(run_id)
            return row if row.status not in ("queued", "running") else None

        row = wait_for(over, what=lambda: f"{what}: {self.row(run_id)}", timeout_s=timeout_s, interval_s=0.1)
        assert row is not None
        return row


@contextlib.contextmanager
def started(tmp_path: Path, postgres_url: str, queue: str | None) -> Iterator[Service]:
    """The service on one Celery worker (``queue`` given), else on one of the server's threads."""
    require_tier("process")
    tenants, tokens = write_tenants(tmp_path, acme_rate=ACME_RATE)
    store = ServiceStore(open_database(postgres_url))
    workers: list[Worker] = []
    if queue is not None:  # one worker, one slot
        server = Server(tenants, postgres_url, tmp_path, redis=REDIS_URL, queue=queue)
        workers.append(Worker(tenants, postgres_url, REDIS_URL, queue, tmp_path, "a"))
    else:  # the server's own threads: one of them
        server = Server(tenants, postgres_url, tmp_path, extra=["--run-threads", "1"])
    try:
        yield Service(server=server, tokens=tokens, store=store, workers=workers, tenants=tenants,
                      db=postgres_url, queue=queue or "", folder=tmp_path)  # fmt: skip
    finally:
        for worker in workers:
            worker.stop()
        server.stop()
        store.close()


@pytest.fixture(params=["celery", "in_process"])
def service(request: pytest.FixtureRequest, tmp_path: Path, postgres_url: str) -> Iterator[Service]:
    queue = request.getfixturevalue("redis_queue") if request.param == "celery" else None
    with started(tmp_path, postgres_url, queue) as running:
        yield running


@pytest.fixture
def celery_service(tmp_path: Path, postgres_url: str, redis_queue: str) -> Iterator[Service]:
    with started(tmp_path, postgres_url, redis_queue) as running:
        yield running


def writes(n: int) -> list[object]:
    """A run of ``n`` tool actions."""
    return [
        *({"name": "write_file", "args": {"path": f"f{i}.txt", "content": str(i)}} for i in range(n)),
        "ok",
    ]


def test_a_run_waiting_for_its_tenants_rate_leaves_the_slot_to_other_tenants(service: Service) -> None:
    with Client(service.server.url, service.tokens.acme) as acme:
        # (two API calls: acme's API rate is a window of its own; the test reads the database)
        slow = [acme.runs.submit(f"acme {i}", scripted=writes(3)).id for i in range(2)]
    wait_for(lambda: service.row(slow[0]).status == "running", what="acme's first run to start",
             timeout_s=60, interval_s=0.1)  # fmt: skip
    with Client(service.server.url, service.tokens.other) as other:
        quick = other.runs.submit("other", scripted=writes(1)).id
    seen: list[RunRow] = []  # what acme's runs said meanwhile

    def quick_ended() -> RunRow | None:
        seen.extend(service.row(run_id) for run_id in slow)
        row = service.row(quick)
        return row if row.status not in ("queued", "running") else None

    done = wait_for(quick_ended, what=lambda: f"other's run to end: {service.row(quick)}", timeout_s=90,
                    interval_s=0.1)  # fmt: skip
    assert done is not None and done.status == "success" and done.started_ns is not None, done
    waited = (done.started_ns - done.submitted_ns) / 1e9
    # before, it waited behind both acme runs (41-52 s here), each holding the slot asleep
    assert waited < 10, f"other's run waited {waited:.1f} s for the slot"
    # acme's runs stopped at their full window, queued, saying why and when they go on
    reasons = {row.error for row in seen if row.status == "queued" and row.attempts >= 1}
    assert any("rate" in (why or "") and "again in" in (why or "") for why in reasons), reasons

    # and they go on once the window frees, to the end
    for run_id in slow:
        row = service.ended(run_id, what="acme's run to end", timeout_s=120)
        assert row.status == "success", (row.status, row.error)
        assert row.attempts >= 2, row  # it left the slot and came back
        assert row.error is None
    assert service.store.holds("acme") == []  # nothing holds acme's quota now


def test_a_worker_killed_while_a_run_waits_for_its_window_strands_nothing(celery_service: Service) -> None:
    service = celery_service
    with Client(service.server.url, service.tokens.acme) as acme:
        run_id = acme.runs.submit("acme", scripted=writes(3)).id
    wait_for(lambda: "again in" in (service.row(run_id).error or ""), what="the run to wait off the worker",
             timeout_s=60, interval_s=0.1)  # fmt: skip
    # the worker dies (SIGKILL) while the run waits: before, the worker held the run's countdown
    # message, and the run stayed queued until the broker's visibility timeout (an hour)
    [victim] = service.workers
    victim.kill_group()
    victim.proc.wait(10)
    service.workers.append(Worker(service.tenants, service.db, REDIS_URL, service.queue, service.folder, "b"))
    row = service.ended(run_id, what="the run to go on on the other worker", timeout_s=90)
    assert row.status == "success", (row.status, row.error)
    assert row.attempts >= 2 and row.error is None
