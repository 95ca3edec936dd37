"""The distributed service: ``stockade serve`` with Redis and PostgreSQL, two real ``stockade
worker`` processes (Celery), and a worker SIGKILLed in the middle of a run."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stockade.client import Client
from tests.conftest import require_tier, wait_for
from tests.integration.service_env import REDIS_URL, Server, Tokens, Worker, write_tenants

pytestmark = [pytest.mark.process, pytest.mark.redis, pytest.mark.postgres, pytest.mark.slow]
TOOLS = "tests.integration.service_tools:toolset"


@dataclass
class Cluster:
    server: Server
    workers: list[Worker]
    tokens: Tokens
    effects: Path


@pytest.fixture
def cluster(tmp_path: Path, postgres_url: str, redis_queue: str) -> Iterator[Cluster]:
    require_tier("process")
    tenants, tokens = write_tenants(tmp_path)
    effects = tmp_path / "effects"
    effects.mkdir()
    env = {"STOCKADE_TEST_EFFECTS": str(effects)}
    server = Server(tenants, postgres_url, tmp_path, redis=REDIS_URL, queue=redis_queue,
                    extra=["--tools", TOOLS])  # fmt: skip
    workers: list[Worker] = []
    try:
        for name in ("a", "b"):
            workers.append(Worker(tenants, postgres_url, REDIS_URL, redis_queue, tmp_path, name, TOOLS, env))
        yield Cluster(server=server, workers=workers, tokens=tokens, effects=effects)
    finally:
        for worker in workers:
            worker.stop()
        server.stop()


def test_runs_go_through_workers_with_kills_and_approvals(cluster: Cluster) -> None:
    with Client(cluster.server.url, cluster.tokens.acme) as client:
        runs = [client.runs.submit(f"task {i}", scripted=[
            {"name": "write_file", "args": {"path": f"f{i}.txt", "content": str(i)}}, f"done {i}"])
            for i in range(6)]  # fmt: skip
        for run in runs:
            assert run.wait(timeout_s=120).status == "success", run.info
        assert {run.info["worker"].split(":")[0] for run in runs}  # ran on the workers
        assert all(f"+++ b/f{i}.txt" in run.diff() for i, run in enumerate(runs))
        # a kill reaches the run on whichever worker holds it
        sleep = {"name": "run_code", "args": {"code": "import time; time.sleep(60)", "language": "python"}}
        slow = client.runs.submit("sleep", scripted=[sleep, "never"])
        wait_for(
            lambda: slow.refresh().status == "running", what="the run to start", timeout_s=60, interval_s=0.1
        )
        time.sleep(1.5)
        slow.kill("stop it")
        assert slow.wait(timeout_s=30).status == "killed"
        # an approval decided through the API resumes the run on a worker
        turns = [{"name": "run_code", "args": {"code": "rm -r nothing || true", "language": "bash"}}, "ok"]
        paused = client.runs.submit("needs approval", scripted=turns)
        assert paused.wait(timeout_s=60).status == "paused"
        [request] = paused.refresh().info["pending_approvals"]
        paused.approve(request["id"])
        assert paused.wait(timeout_s=60).status == "success"
        assert client.verify_audit()["ok"]


def test_a_worker_sigkilled_mid_run_and_the_run_resumes_on_the_other(cluster: Cluster) -> None:
    turns = [
        {"name": "write_file", "args": {"path": "notes.txt", "content": "one\n"}},
        {"name": "pay", "args": {"invoice": "inv-1"}},
        {"name": "slow_step", "args": {"seconds": 60}},
        {"name": "pay", "args": {"invoice": "inv-2"}},
        {"name": "write_file", "args": {"path": "notes.txt", "content": "one\ntwo\n"}},
        "paid both",
    ]
    with Client(cluster.server.url, cluster.tokens.acme) as client:
        run = client.runs.submit("pay the invoices", scripted=turns)
        marker = cluster.effects / "slow-started"
        wait_for(
            marker.exists,
            what=lambda: f"the slow step to start: {run.refresh().info}",
            timeout_s=60,
            interval_s=0.05,
        )
        pid, _ = marker.read_text().split()
        victim = next(w for w in cluster.workers if os.getpgid(int(pid)) == w.pid)
        survivor = next(w for w in cluster.workers if w is not victim)
        victim.kill_group()  # the whole worker, pool and sandbox: no cleanup, no ack
        victim.proc.wait(10)
        killed_at = time.monotonic()
        done = run.wait(timeout_s=120)
        resumed_in = time.monotonic() - killed_at
        assert done.status == "success", (done.info, survivor.output()[-3000:])
        assert done.info["attempts"] >= 2 and done.info["answer"] == "paid both"
        payments = (cluster.effects / "payments.log").read_text().split("\n")
        assert sorted(line.split()[0] for line in payments if line) == ["inv-1", "inv-2"]  # none repeated
        diff = run.diff()
        assert diff.count("+++ b/notes.txt") == 1 and "+two" in diff
        kinds = [e.kind for e in run.events()]
        assert "run_crash" in kinds  # the trail says the worker died, and where the run went on
        unknown = [e for e in run.events() if e.kind == "tool_call"
                   and e.data["attributes"].get("outcome") == "unknown"]  # fmt: skip
        assert [e.data["attributes"]["tool"] for e in unknown] == ["slow_step"]  # not run again
        assert client.verify_audit()["ok"]
        assert resumed_in < 60, resumed_in
