"""The distributed service when things fail for good: a run whose worker dies each time it
runs it, and a broker (Redis) that cannot be reached when a run is submitted. Real ``stockade
serve`` and ``stockade worker`` processes, on a Redis server of the test's own (stopped and
started again) and PostgreSQL."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade.client import Client
from tests.conftest import require, require_tier, wait_for
from tests.integration.service_env import Server, Worker, free_port, write_tenants

pytestmark = [pytest.mark.process, pytest.mark.redis, pytest.mark.postgres, pytest.mark.slow]
TOOLS = "tests.integration.service_tools:toolset"


class OwnRedis:
    """``redis-server`` on a port of its own, without persistence: stopped and started at will."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log = folder / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no"],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_for(self._answers, what=lambda: f"redis-server to start: {self.log.read_text()}", timeout_s=20)

    def _answers(self) -> bool:
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=1)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    require("redis-server", shutil.which("redis-server") is not None, "not on PATH")
    server = OwnRedis(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def test_a_run_whose_worker_dies_each_time_ends_error_after_max_attempts(
    tmp_path: Path, postgres_url: str, own_redis: OwnRedis
) -> None:
    """Each time a worker's pool child runs the run, it is SIGKILLed: the broker gives the
    run again at once (``task_reject_on_worker_lost``). With ``STOCKADE_MAX_ATTEMPTS=3`` (the
    worker's ``--max-attempts``) it ends "error" after its third attempt, in the embedded
    executor's words, and its trail says so. Before, it was given again for ever (41 attempts
    in 150 s, a new sandbox each time; here until its script ran out)."""
    require_tier("process")
    tenants, tokens = write_tenants(tmp_path)
    effects = tmp_path / "effects"
    effects.mkdir()
    server = Server(tenants, postgres_url, tmp_path, redis=own_redis.url, extra=["--tools", TOOLS])
    worker = None
    try:
        worker = Worker(tenants, postgres_url, own_redis.url, "stockade", tmp_path, "a", TOOLS,
                        {"STOCKADE_TEST_EFFECTS": str(effects), "STOCKADE_MAX_ATTEMPTS": "3"})  # fmt: skip
        slow = {"name": "slow_step", "args": {"seconds": 120}}
        with Client(server.url, tokens.acme) as client:
            run = client.runs.submit("dies each time", scripted=[*[slow] * 10, "never"])
            marker, killed = effects / "slow-started", set[int]()
            deadline = time.monotonic() + 90
            # "interrupted" between attempts: its lease lapsed, the broker gives it again
            while (
                run.refresh().status in ("queued", "running", "interrupted") and time.monotonic() < deadline
            ):
                with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
                    pid = int(marker.read_text().split()[0])  # the pool child running the step
                    if pid not in killed:
                        killed.add(pid)
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                time.sleep(0.1)
            info = run.refresh().info
            assert info["status"] == "error", (info, len(killed), worker.output()[-3000:])
            assert info["error"].startswith("gave up after 3 attempts"), info
            assert info["attempts"] == 3 and len(killed) == 3, (info, killed)

            def gave_up() -> list[dict[str, object]]:
                return [e.data["attributes"] for e in run.events()
                        if e.kind == "run_end" and e.data["actor"] == "service:executor"]  # fmt: skip

            [end] = gave_up()
            assert end["failed_attempts"] == 3 and end["status"] == "error"
            verified = client.verify_audit()
            assert verified["ok"], verified
    finally:
        if worker is not None:
            worker.stop()
        server.stop()


def test_a_submit_while_the_broker_is_away_is_503_creates_nothing_and_a_retry_runs_once(
    tmp_path: Path, postgres_url: str, own_redis: OwnRedis
) -> None:
    """Redis stopped: ``POST /v1/runs`` is a typed, retryable 503 with Retry-After, and no run
    is left behind (before: a 500 "StockadeError", not retryable, and a run queued for ever
    with no wake, holding a slot of the tenant's runs quota). Redis back: the same request
    (same idempotency key) makes the run, once, and a worker runs it."""
    import httpx2

    require_tier("process")
    tenants, tokens = write_tenants(tmp_path)
    server = Server(tenants, postgres_url, tmp_path, redis=own_redis.url)
    worker = None
    auth = {"Authorization": f"Bearer {tokens.acme}"}
    body = {
        "task": "while the broker is away", "tier": "process", "idempotency_key": "submit-1",
        "scripted": [{"name": "write_file", "args": {"path": "a.txt", "content": "a"}}, "done"],
    }  # fmt: skip
    try:
        own_redis.stop()
        refused = httpx2.post(server.url + "/v1/runs", json=body, headers=auth, timeout=60)
        assert refused.status_code == 503, refused.text
        problem = refused.json()
        assert problem["error"] == "ServiceUnavailable" and problem["retryable"] is True, problem
        assert refused.headers["Retry-After"] == "5"
        assert httpx2.get(server.url + "/v1/runs", headers=auth, timeout=30).json() == []

        own_redis.start()
        worker = Worker(tenants, postgres_url, own_redis.url, "stockade", tmp_path, "a")
        accepted = httpx2.post(server.url + "/v1/runs", json=body, headers=auth, timeout=60)
        assert accepted.status_code == 202, accepted.text
        again = httpx2.post(server.url + "/v1/runs", json=body, headers=auth, timeout=60)
        assert again.status_code == 200 and again.json()["run_id"] == accepted.json()["run_id"]
        with Client(server.url, tokens.acme) as client:
            run = client.runs.get(accepted.json()["run_id"])
            assert run.wait(timeout_s=120).status == "success", (run.info, worker.output()[-3000:])
            assert [r.id for r in client.runs.list()] == [run.id]
    finally:
        if worker is not None:
            worker.stop()
        server.stop()


def test_an_approval_decided_while_the_broker_is_away_is_kept_and_the_run_goes_on_once_it_is_back(
    tmp_path: Path, postgres_url: str, own_redis: OwnRedis
) -> None:
    """The run paused; Redis stopped; the approval is decided. Before: a 503 "run ... was not
    sent", yet the decision was recorded and the run queued with no wake and no message:
    deciding again was a 409, POST /resume a 409 ("run is queued"), and it stayed queued for
    ever, holding a place of its tenant's runs quota. Now the decision is answered (the run
    queued, its wake written with it) and a waker sends the run once Redis is back."""
    import httpx2

    require_tier("process")
    tenants, tokens = write_tenants(tmp_path)
    server = Server(tenants, postgres_url, tmp_path, redis=own_redis.url)
    worker = Worker(tenants, postgres_url, own_redis.url, "stockade", tmp_path, "a")
    auth = {"Authorization": f"Bearer {tokens.acme}"}
    try:
        with Client(server.url, tokens.acme) as client:
            turns = [
                {"name": "run_code", "args": {"code": "rm -r nothing || true", "language": "bash"}},
                "ok",
            ]
            run = client.runs.submit("needs approval", scripted=turns)
            assert run.wait(timeout_s=60).status == "paused", (run.info, worker.output()[-3000:])
            [request] = run.refresh().info["pending_approvals"]

            worker.stop()
            own_redis.stop()
            decided = httpx2.post(
                f"{server.url}/v1/runs/{run.id}/approvals/{request['id']}",
                json={"decision": "approve"}, headers=auth, timeout=60,
            )  # fmt: skip
            assert decided.status_code == 200, decided.text
            assert decided.json()["status"] == "queued" and decided.json()["pending_approvals"] == []

            own_redis.start()
            worker = Worker(tenants, postgres_url, own_redis.url, "stockade", tmp_path, "b")
            assert run.wait(timeout_s=90).status == "success", (run.info, worker.output()[-3000:])
            assert client.verify_audit()["ok"]
    finally:
        worker.stop()
        server.stop()


def test_a_decision_racing_a_run_that_pauses_on_postgresql_waits_and_the_run_is_queued(
    postgres_url: str,
) -> None:
    """A decision's transaction holds the pending request when the runner writes how its run
    stopped: the runner's check (``FOR UPDATE``) waits for it, then finds nothing pending and
    queues the run, its wake with it. (Before, it wrote ``paused`` with nothing pending, and the
    decision, which had found the run running, sent nothing: paused for ever.)"""
    import threading

    import psycopg

    from stockade.policy.approval import ApprovalRequest
    from stockade.server.state.approvals import DatabaseApprovals
    from stockade.server.state.schema import open_database
    from stockade.server.state.store import ServiceStore
    from stockade.server.wakes import Wakes

    store = ServiceStore(open_database(postgres_url))
    try:
        assert store.add_run(
            run_id="r1", tenant="acme", role="dev", spec={"task": "t"}, labels={}, max_active=5
        )
        assert store.set_status("r1", "running", only_from=("queued",))
        approvals = DatabaseApprovals(store)
        request = ApprovalRequest(
            run_id="r1", action="run `rm -r d`", rule="commands.approve", reason="asked"
        )
        approvals.submit(request)
        paused: list[bool] = []
        with psycopg.connect(postgres_url) as deciding:  # a decision, not yet committed
            deciding.execute(
                "UPDATE svc_approvals SET status = 'approved' WHERE run_id = 'r1' AND request_id = %s",
                (request.id,),
            )
            pausing = threading.Thread(target=lambda: paused.append(store.pause("r1", error="waits")))
            pausing.start()
            deciding.commit()
        pausing.join(30)
        assert paused == [False]
        row = store.run("r1")
        assert row is not None and row.status == "queued", row
        assert Wakes(store.db).at("r1") is not None
        # with a request pending, the run pauses (its wake dropped: a person sends it on)
        assert store.set_status("r1", "running", only_from=("queued",))
        approvals.submit(
            ApprovalRequest(run_id="r1", action="run `rm -r e`", rule="commands.approve", reason="x")
        )
        assert store.pause("r1", error="waits")
        row = store.run("r1")
        assert row is not None and row.status == "paused" and Wakes(store.db).at("r1") is None, row
    finally:
        store.close()
