"""The distributed service: ``stockade serve`` with Redis and PostgreSQL, two real ``stockade
worker`` processes (Celery), and a worker SIGKILLed in the middle of a run."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stockade import Limits
from stockade.client import Client, RemoteSandbox
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
        # with acme's 3 sandboxes held through the API, a run waits queued, off the workers
        held = [
            RemoteSandbox.create(tier="process", limits=Limits(memory_mb=256), client=client)
            for _ in range(3)
        ]
        try:
            waiting = client.runs.submit("after", scripted=["done"])
            wait_for(lambda: "quota" in (waiting.refresh().info.get("error") or ""), what="the run to wait",
                     timeout_s=60)  # fmt: skip
            assert waiting.refresh().status == "queued"
            held.pop().close()
            assert waiting.wait(timeout_s=60).status == "success"
        finally:
            for sbx in held:
                sbx.close()
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


# The code of the egress run: the API with the role's credential, a host the policy does not
# name, and where the token could be in the sandbox (tests/integration/test_egress.py's scan).
FETCH = """
import json, urllib.error, urllib.request
out = {{"auth": urllib.request.urlopen("https://api.test:{port}/auth", timeout=30).read().decode(),
       "echo": urllib.request.urlopen("https://api.test:{port}/echo-auth", timeout=30).read().decode()}}
try:
    urllib.request.urlopen("http://other.test:{port}/", timeout=30)
    out["other"] = [200, "allowed"]
except urllib.error.HTTPError as err:
    out["other"] = [err.code, err.read().decode()]
open("fetched.json", "w").write(json.dumps(out, sort_keys=True) + "\\n")
"""


def _tables_text(url: str) -> str:
    """Every row of every table of the test's schema, as text (the run store, the trail)."""
    import psycopg

    with psycopg.connect(url) as conn:
        names = [row[0] for row in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
        )]  # fmt: skip
        return "\n".join(
            str(row[0]) for name in names for row in conn.execute(f'SELECT t::text FROM "{name}" t'.encode())
        )


def test_a_worker_run_reaches_an_allowed_host_with_the_workers_credential(
    tmp_path: Path, postgres_url: str, redis_queue: str
) -> None:
    """A run submitted to the service and run by a real worker: its code fetches from a local
    HTTPS server under a made-up name through the allowlist, and the proxy (in the worker)
    adds the credential the worker's environment holds. The token reaches the server, never
    the sandbox, the run's trail or the database; a host not allowed is refused and audited."""
    require_tier("process")
    from tests.egress_servers import TOKEN, servers
    from tests.integration.test_egress import LEAK_SCAN

    tenants, tokens = write_tenants(tmp_path)
    with servers(tmp_path) as local:
        (tmp_path / "policy.toml").write_text(
            f"""version = 1
[trust]
level = "trusted"
[models]
approved = ["scripted:*"]
[network]
allow = [{{ host = "api.test", ports = [{local.https_port}] }}]
allow_addresses = ["127.0.0.3/32"]
resolve = {{ "api.test" = ["127.0.0.3"], "other.test" = ["127.0.0.3"] }}
upstream_ca = "{local.ca_file}"
[credentials.api]
source = "env:EGRESS_TEST_API_TOKEN"
hosts = ["api.test"]
roles = ["dev"]
[roles.dev]
tiers = ["process"]
[roles.viewer]
tiers = ["process"]
"""
        )
        # The token is in the worker's environment only: the server never holds it.
        server = Server(tenants, postgres_url, tmp_path, redis=REDIS_URL, queue=redis_queue)
        worker = None
        try:
            worker = Worker(tenants, postgres_url, REDIS_URL, redis_queue, tmp_path, "egress",
                            env={"EGRESS_TEST_API_TOKEN": TOKEN})  # fmt: skip
            turns = [
                {
                    "name": "run_code",
                    "args": {"code": FETCH.format(port=local.https_port), "language": "python"},
                },
                {
                    "name": "run_code",
                    "args": {"code": "exec > scan.txt 2>&1\n" + LEAK_SCAN, "language": "bash"},
                },
                "fetched",
            ]
            with Client(server.url, tokens.acme) as client:
                run = client.runs.submit("fetch from the API", scripted=turns)
                done = run.wait(timeout_s=180)
                assert done.status == "success", (done.info, worker.output()[-3000:])
                pid = int(done.info["worker"].rsplit(":", 1)[1])
                assert os.getpgid(pid) == worker.pid, done.info  # run by the worker's pool
                diff = run.diff()
                events = [e.data for e in run.events() if e.kind != "end"]
                worker.stop()
                # A worker whose environment lacks the credential: the run stops, saying which.
                bare = Worker(tenants, postgres_url, REDIS_URL, redis_queue, tmp_path, "bare")
                try:
                    missing = client.runs.submit("fetch without the token", scripted=turns).wait(
                        timeout_s=120
                    )
                    assert missing.status == "error", (missing.info, bare.output()[-3000:])
                    assert "EGRESS_TEST_API_TOKEN" in str(missing.info.get("error")), missing.info
                finally:
                    bare.stop()
                assert client.verify_audit()["ok"]
        finally:
            if worker is not None:
                worker.stop()
            server.stop()
        seen = list(local.https_seen.authorizations)
    fetched = next(line for line in diff.splitlines() if line.startswith('+{"auth"'))
    out = json.loads(fetched[1:])
    assert out["auth"] == "https authorized=True", out
    assert "[REDACTED]" in out["echo"], out  # the server echoed it back: scrubbed on the way in
    code, text = out["other"]
    assert code == 403 and "stockade egress:" in text and "(rule: " in text, out
    assert "+clean" in diff.splitlines(), diff  # the scan of the sandbox's processes and files
    assert f"Bearer {TOKEN}" in seen  # the token reached the server
    egress = [e["attributes"] for e in events if e.get("kind") == "egress"]
    allowed = [a for a in egress if a["decision"] == "allow" and a["host"] == "api.test"]
    assert allowed and all(a["credential_name"] == "api" and a["status"] == 200 for a in allowed), egress
    denied = [a for a in egress if a["decision"] == "deny"]
    assert [(a["host"], a["status"]) for a in denied] == [("other.test", 403)], egress
    assert TOKEN not in diff and TOKEN not in json.dumps(events)
    assert TOKEN not in _tables_text(postgres_url)  # the run store and the trail, all of it
    assert TOKEN not in server.output() + worker.output()
    assert "Traceback" not in server.output() + worker.output(), worker.output()[-3000:]
