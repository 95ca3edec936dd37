"""Limits and the kill switch shared through a real Redis (``scripts/start-services.sh redis``)."""

from __future__ import annotations

import os
import uuid
from typing import cast

import pytest

from stockade import exceptions as exc
from stockade.runtime.killswitch import KillSwitch, RedisKillSource
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
