"""The runtime controls of service runs, end to end: ``stockade serve`` with Redis and
PostgreSQL and a real ``stockade worker``. A tenant's rate makes its run wait for the window
(the model is not asked again for a refusal; the run succeeds), ``stockade kill --all --tenant``
aimed at the service's database stops the tenant's live run on the worker, and a run its
breaker stopped ("broken") goes on once a person resumes it through the API, not when a copy of
its message reaches a worker."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stockade.client import Client
from stockade.distributed.tasks import make_app, send_run
from stockade.server.state.kills import DatabaseKillSource
from stockade.server.state.rows import RunRow
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore
from tests.conftest import require_tier, wait_for
from tests.integration.service_env import REDIS_URL, Server, Tokens, Worker, _env, write_tenants

pytestmark = [pytest.mark.process, pytest.mark.redis, pytest.mark.postgres]

# two tool actions per 3 s for every run of acme (and two API calls: the test reads the database)
ACME_RATE = "rate_per_minute = 2\nrate_period_s = 3\n"


@dataclass
class Cluster:
    server: Server
    worker: Worker
    tokens: Tokens
    database: str
    store: ServiceStore
    queue: str

    def row(self, run_id: str) -> RunRow:
        row = self.store.run(run_id)
        assert row is not None
        return row

    def wait_status(self, run_id: str, *statuses: str, timeout_s: float = 60.0) -> RunRow:
        def reached() -> RunRow | None:
            row = self.row(run_id)
            return row if row.status in statuses else None

        found = wait_for(reached, what=f"run {run_id} to be {' or '.join(statuses)}", timeout_s=timeout_s,
                         interval_s=0.1)  # fmt: skip
        assert found is not None
        return found

    def events(self, tenant: str, run_id: str) -> list[tuple[str, dict[str, object]]]:
        rows = self.store.audit_rows(f"audit_t_{tenant}", run_id, 0, limit=10_000)
        return [(kind, json.loads(body)) for _, kind, body in rows]


@pytest.fixture
def cluster(tmp_path: Path, postgres_url: str, redis_queue: str) -> Iterator[Cluster]:
    require_tier("process")
    tenants, tokens = write_tenants(tmp_path, acme_rate=ACME_RATE)
    server = Server(tenants, postgres_url, tmp_path, redis=REDIS_URL, queue=redis_queue)
    worker: Worker | None = None
    store = ServiceStore(open_database(postgres_url))
    try:
        worker = Worker(tenants, postgres_url, REDIS_URL, redis_queue, tmp_path, "a")
        yield Cluster(
            server=server, worker=worker, tokens=tokens, database=postgres_url, store=store, queue=redis_queue
        )
    finally:
        if worker is not None:
            worker.stop()
        server.stop()
        store.close()


def kill_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stockade.cli.main", "kill", *args],
        capture_output=True, text=True, env=_env(), timeout=60, check=False,
    )  # fmt: skip


def test_a_tenants_rate_makes_its_run_wait_and_kill_all_stops_its_live_run(cluster: Cluster) -> None:
    writes = [{"name": "write_file", "args": {"path": f"f{i}.txt", "content": str(i)}} for i in range(3)]
    with Client(cluster.server.url, cluster.tokens.acme) as client:
        run_id = client.runs.submit("three files", scripted=[*writes, "wrote three"]).id
    started = cluster.wait_status(run_id, "running").started_ns
    done = cluster.wait_status(run_id, "success", "error", "budget", timeout_s=60)
    assert done.status == "success", (done.error, cluster.worker.output()[-3000:])
    assert done.finished_ns is not None and started is not None
    events = cluster.events("acme", run_id)
    models = [body for kind, body in events if kind == "model_call"]
    assert len(models) == 4  # three writes and the answer: no model call spent on a refusal
    waits = [body["attributes"] for kind, body in events if kind == "rate_limited"]
    assert waits and all(w["decision"] == "wait" and w["key"] == "tenant:acme" for w in waits)  # type: ignore[index]
    tools = [body["attributes"] for kind, body in events if kind == "tool_call"]
    assert not any("RateLimited" in json.dumps(t) for t in tools)  # the model never saw a refusal
    assert (done.finished_ns - started) / 1e9 >= 1.0  # the third write waited for the window

    # a live run of acme on the worker, stopped from the command line through the database
    sleep = {"name": "run_code", "args": {"code": "import time; time.sleep(60)", "language": "python"}}
    with Client(cluster.server.url, cluster.tokens.acme) as client:
        slow = client.runs.submit("sleep", scripted=[sleep, "never"]).id
    source = DatabaseKillSource(cluster.store, poll_s=0.0)
    wait_for(
        lambda: [r.run_id for r in source.live_runs()] == [slow], what="the run to be live", timeout_s=60
    )
    assert [r.tenant for r in source.live_runs()] == ["acme"]  # its mark names its tenant
    time.sleep(1.0)  # into its sleep
    nobody = kill_cli("--all", "--tenant", "other", "--target", cluster.database)
    assert nobody.returncode == 1 and "no live or waiting run of tenant other" in nobody.stderr, nobody
    assert cluster.row(slow).status == "running"
    stopped = kill_cli("--all", "--tenant", "acme", "--target", cluster.database, "--reason", "incident 7")
    assert stopped.returncode == 0, (stopped.stdout, stopped.stderr)
    assert f"kill switch pulled for live run {slow}" in stopped.stdout and "tenant acme" in stopped.stdout
    row = cluster.wait_status(slow, "killed", timeout_s=15)
    assert "incident 7" in (row.error or "")
    assert source.live_runs() == []


def test_a_broken_run_goes_on_once_a_person_resumes_it(cluster: Cluster) -> None:
    failing = {"name": "run_code", "args": {"code": "raise ValueError('still broken')", "language": "python"}}
    fixed = {"name": "write_file", "args": {"path": "fixed.txt", "content": "ok"}}
    with Client(cluster.server.url, cluster.tokens.other) as client:
        run = client.runs.submit("fix it", scripted=[failing] * 5 + [fixed, "fixed"])
        assert run.wait(timeout_s=60).status == "broken", run.info
        assert "failed" in (run.info["error"] or "")
        # one more message for it (a waker's resend behind a backlog, the broker's copy of a
        # dead worker's): before, it closed the breaker and ran the write ("success" in 2 s)
        app = make_app(REDIS_URL, queue=cluster.queue)
        try:
            send_run(app, run.id, "wake")
        finally:
            app.close()
        # one worker, one run at a time, one queue: a run sent after the copy ends after it
        after = client.runs.submit("after the copy", scripted=["done"])
        assert after.wait(timeout_s=60).status == "success"
        assert cluster.row(run.id).status == "broken"
        assert "fixed.txt" not in run.diff()
        resumed = run.resume()
        assert resumed.status in ("queued", "running", "success")
        done = run.wait(timeout_s=60)
        assert done.status == "success" and done.info["answer"] == "fixed", done.info
        assert "+++ b/fixed.txt" in run.diff()
        assert client.verify_audit()["ok"]
