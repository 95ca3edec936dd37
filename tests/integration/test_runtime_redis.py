"""Limits and the kill switch shared through a real Redis (``scripts/start-services.sh redis``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import cast

import pytest

from stockade import exceptions as exc
from stockade.runtime.killswitch import KillSwitch, RedisKillSource, kill_all
from stockade.runtime.limits import RateLimit, RedisWindow, SpendLimit
from tests.conftest import require, wait_for

pytestmark = pytest.mark.redis
URL = os.environ.get("STOCKADE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="module")
def redis_url() -> str:
    try:
        import redis

        redis.Redis.from_url(URL, socket_timeout=1).ping()
        ok, why = True, ""
    except Exception as err:  # not installed, not running
        ok, why = False, f"{URL}: {err}"
    require("redis", ok, why)
    return URL


def test_a_rate_limit_is_shared_by_every_process_on_the_same_redis(redis_url: str) -> None:
    key = uuid.uuid4().hex
    worker_a = RateLimit(per_minute=5, window=RedisWindow(redis_url))
    worker_b = RateLimit(per_minute=5, window=RedisWindow(redis_url))  # another process or host
    for limiter in (worker_a, worker_b, worker_a, worker_b, worker_a):
        limiter.acquire(key)
    with pytest.raises(exc.RateLimited) as refused:
        worker_b.acquire(key)
    assert refused.value.retry_after is not None and 0 < refused.value.retry_after <= 60


def test_spend_is_shared_too(redis_url: str) -> None:
    key = uuid.uuid4().hex
    a = SpendLimit(dollars_per_hour=1.0, window=RedisWindow(redis_url))
    b = SpendLimit(dollars_per_hour=1.0, window=RedisWindow(redis_url))
    a.record(0.7, key)
    b.check(key)
    with pytest.raises(exc.BudgetExceeded):
        b.record(0.4, key)
    with pytest.raises(exc.BudgetExceeded):
        a.check(key)


def test_a_redis_key_kills_the_run(redis_url: str) -> None:
    run_id = f"run-{uuid.uuid4().hex}"
    source = RedisKillSource(redis_url)
    switch = KillSwitch(run_id, [RedisKillSource(redis_url)])
    switch.check()
    source.kill(run_id, "from redis")
    try:
        with pytest.raises(exc.RunKilled, match="from redis"):
            switch.check()
    finally:
        source.clear(run_id)


def test_a_watched_run_is_live_in_redis_and_leaves_nothing_when_it_ends(redis_url: str) -> None:
    run_id = f"run-{uuid.uuid4().hex}"
    source = RedisKillSource(redis_url)
    switch = KillSwitch(run_id, [RedisKillSource(redis_url)], poll_s=0.01)
    assert source.live(run_id) is None
    with switch.watch():
        assert source.live(run_id) is not None
        source.kill(run_id, "stop")
        assert cast(int, source.client.ttl(source.prefix + run_id)) > 0  # a switch expires
        wait_for(lambda: switch.killed, what="the switch to see the kill", timeout_s=5, interval_s=0.01)
    assert source.live(run_id) is None and source.reason(run_id) is None


CHILD = Path(__file__).with_name("limits_child.py")


def run_children(redis_url: str, tenant: str, *args: str, count: int = 3) -> list[dict[str, object]]:
    """``count`` agent runs at once, each in a process of its own, sharing one Redis."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}:{root}"}
    children = [
        subprocess.Popen(
            [sys.executable, str(CHILD), redis_url, tenant, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(count)
    ]
    results = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_a_tenants_rate_is_shared_by_its_runs_in_every_process(redis_url: str) -> None:
    # three processes, three runs of one tenant, three actions each; 3 a minute for the tenant
    results = run_children(redis_url, f"t-{uuid.uuid4().hex}", "tenant", "stop", "3")
    assert sum(int(str(r["commands"])) for r in results) == 3
    assert sorted(str(r["status"]) for r in results).count("budget") >= 2


def test_a_runs_own_rate_is_its_own_in_every_process(redis_url: str) -> None:
    results = run_children(redis_url, f"t-{uuid.uuid4().hex}", "run", "stop", "3")
    assert [r["commands"] for r in results] == [3, 3, 3]
    assert {r["status"] for r in results} == {"success"}


def test_runs_that_wait_share_the_window_and_all_finish(redis_url: str) -> None:
    # two actions per 2 s for the tenant, two processes with two actions each: one pair waits
    results = run_children(redis_url, f"t-{uuid.uuid4().hex}", "none", "wait", "2", "2", count=2)
    assert [r["status"] for r in results] == ["success", "success"]
    assert sum(int(str(r["commands"])) for r in results) == 4
    assert max(float(str(r["seconds"])) for r in results) >= 0.9  # someone waited for the window


def test_a_kill_all_of_a_tenant_reaches_its_runs_through_redis(redis_url: str) -> None:
    tenant = f"t-{uuid.uuid4().hex}"
    ours = [KillSwitch(f"run-{uuid.uuid4().hex}", [RedisKillSource(redis_url)], poll_s=0.01, tenant=tenant)
            for _ in range(2)]  # fmt: skip
    theirs = KillSwitch(f"run-{uuid.uuid4().hex}", [RedisKillSource(redis_url)], poll_s=0.01, tenant="other")
    with ours[0].watch(), ours[1].watch(), theirs.watch():
        pulled = kill_all(RedisKillSource(redis_url), "stop them", tenant=tenant)
        assert sorted(r.run_id for r in pulled) == sorted(s.run_id for s in ours)
        wait_for(lambda: all(s.killed for s in ours), what="the tenant's runs to see the kill", timeout_s=5)
        assert not theirs.killed
