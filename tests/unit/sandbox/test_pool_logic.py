"""Pool logic over the shipped FakeBackend: no sandbox is started."""

from __future__ import annotations

import threading

import pytest

from stockade import InvalidArgument, ResourceContention, SandboxRules
from stockade.sandbox.ops import RunCode
from stockade.sandbox.pool import SandboxPool
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.types import Execution
from tests.conftest import wait_for


def test_a_pool_hands_out_reset_members_and_counts() -> None:
    backend = FakeBackend()
    with SandboxPool(backend=backend, size=1, max_uses=2) as pool:
        with pool.acquire() as sbx:
            sbx.files.write("a.txt", "x")
        with pool.acquire() as sbx:
            assert sbx.files.list() == []
        # the worker recycles returned members in the background
        wait_for(
            lambda: not pool.stats().in_use, what="the member to be recycled", timeout_s=5, interval_s=0.01
        )
        stats = pool.stats()
        assert stats.recycled >= 1 and stats.in_use == 0


def test_acquire_times_out_with_a_retryable_error() -> None:
    with SandboxPool(backend=FakeBackend(), size=1) as pool, pool.acquire():
        with pytest.raises(ResourceContention) as info, pool.acquire(timeout_s=0.2):
            pass
        assert info.value.retryable


def test_a_sandbox_acquired_when_the_pool_closes_is_closed_when_it_comes_back() -> None:
    pool = SandboxPool(backend=FakeBackend(), size=1)
    with pool.acquire() as sbx:
        pool.close()
        assert sbx.alive
    assert not sbx.alive and pool.stats().in_use == 0


def test_a_member_whose_user_left_a_call_running_is_replaced_not_reset() -> None:
    """The call would otherwise go on into the reset, or into the next user's session."""
    started, release = threading.Event(), threading.Event()

    def slow(op: RunCode) -> Execution:
        if op.code == "slow":  # not the pool's own warm-up
            started.set()
            release.wait(10)
        return Execution()

    backend = FakeBackend(handler_factory=lambda: MemoryWorkspace(code=slow))
    with SandboxPool(backend=backend, size=1) as pool:
        with pool.acquire() as sbx:
            caller = threading.Thread(target=lambda: sbx.run_code("slow"), daemon=True)
            caller.start()
            started.wait(5)
        release.set()  # it was running when the block ended: that is what counts
        wait_for(
            lambda: pool.stats().replaced == 1, what="the member to be replaced", timeout_s=5, interval_s=0.01
        )
        assert "still ran" in pool.stats().last_replaced_why and pool.stats().recycled == 0
        caller.join(5)


@pytest.mark.parametrize("envs", [{"A=B": "x"}, {"NUL": "a\x00b"}, {"": "x"}])
def test_a_pool_refuses_the_environments_create_refuses(envs: dict[str, str]) -> None:
    """A variable no process can receive: refused up front, as Sandbox.create refuses it."""
    with pytest.raises(InvalidArgument, match="envs"):
        SandboxPool(backend=FakeBackend(), size=1, envs=envs)


def test_a_pools_members_get_its_rules() -> None:
    backend = FakeBackend()
    rules = SandboxRules(deny=("curl",))
    with SandboxPool(backend=backend, size=1, rules=rules) as pool, pool.acquire():
        assert [spec.rules for spec in backend.specs] == [rules]
