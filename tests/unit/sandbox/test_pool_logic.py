"""Pool logic over the shipped FakeBackend: no sandbox is started."""

from __future__ import annotations

import threading
import time

import pytest

from stockade import (
    InvalidArgument,
    ResourceContention,
    SandboxClosed,
    SandboxCrashed,
    SandboxRules,
    SandboxStartError,
)
from stockade.sandbox.base import Instance, SandboxSpec, WrapperBackend, WrapperInstance
from stockade.sandbox.ops import RunCode
from stockade.sandbox.pool import SandboxPool
from stockade.testing import FakeBackend, FakeInstance, MemoryWorkspace
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


def test_a_member_still_starting_when_close_returns_is_closed_when_its_start_ends() -> None:
    """A start longer than close's wait (33 s against 30 s) left its member running in the
    closed pool's queue, which nobody would ever take or close."""
    starting, go = threading.Event(), threading.Event()

    class Slow(FakeBackend):
        def start(self, spec: SandboxSpec) -> FakeInstance:
            starting.set()
            go.wait(10)
            return super().start(spec)

    backend = Slow()
    pool = SandboxPool(backend=backend, size=1)
    assert starting.wait(5)
    pool.close(wait_s=0.01)  # returns with the start under way
    go.set()
    wait_for(lambda: backend.instances and backend.instances[0].closed, what="the late member to be closed")
    assert pool.stats().ready == 0


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


def test_a_handle_kept_past_its_block_neither_cuts_nor_closes_the_next_users_sandbox() -> None:
    """A watchdog that kept ``sbx.instance`` to cut a call at its deadline: once the block
    ended, its cut reached the member, now the next user's, and killed that user's code. Nor
    does the handle keep the member (``kept._member`` reached it after the block)."""
    backend = FakeBackend()
    with SandboxPool(backend=backend, size=1) as pool:
        with pool.acquire() as mine:
            kept = mine.instance
            kept.cut_running()  # within the block: it reaches the member
        with pool.acquire() as theirs:
            member = backend.instances[0]
            assert theirs.id == member.id and member.cuts == 1
            with pytest.raises(SandboxClosed, match="went back to its pool"):
                kept.execute(RunCode(code="x"))
            with pytest.raises(SandboxClosed):
                assert isinstance(kept, WrapperInstance) and kept.wrapped  # nor what it wraps
            kept.cut_running()
            kept.close()
            assert member.cuts == 1 and theirs.alive and not kept.alive
            assert theirs.run_code("1").error is None
            # nor by its private attributes: the lease let go of the member
            assert not [value for value in vars(kept).values() if isinstance(value, Instance)]


class CutTakesAMoment(WrapperInstance):
    """A sandbox whose cut is under way until ``done`` is set (a real one asks its supervisor)."""

    def __init__(self, wrapped: Instance, cutting: threading.Event, done: threading.Event) -> None:
        super().__init__(wrapped)
        self.cutting, self.done = cutting, done

    def cut_running(self) -> None:
        self.cutting.set()
        self.done.wait(10)
        self.wrapped.cut_running()


def test_a_cut_under_way_when_the_block_ends_has_the_member_replaced_not_reset() -> None:
    """The cut lands after the block: reset and handed on, the member would take it in the
    next user's session."""
    cutting, done = threading.Event(), threading.Event()

    class Backend(WrapperBackend):
        def start(self, spec: SandboxSpec) -> Instance:
            return CutTakesAMoment(self.wrapped.start(spec), cutting, done)

    with SandboxPool(backend=Backend(FakeBackend()), size=1) as pool:
        with pool.acquire() as sbx:
            watchdog = threading.Thread(target=sbx.instance.cut_running, daemon=True)
            watchdog.start()
            assert cutting.wait(5)
        done.set()
        watchdog.join(5)
        wait_for(
            lambda: pool.stats().replaced == 1, what="the member to be replaced", timeout_s=5, interval_s=0.01
        )
        assert "still ran" in pool.stats().last_replaced_why and pool.stats().recycled == 0


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


def test_members_whose_warm_up_failed_are_replaced_and_the_pool_goes_on() -> None:
    """A failed warm-up was uncounted: two of them left a pool of two believing itself full,
    starting nothing and handing nothing out for good (an attack's finding)."""
    failed: list[int] = []

    def warm_up_fails_twice(op: RunCode) -> Execution:
        if op.code == "" and len(failed) < 2:
            failed.append(1)
            raise SandboxCrashed("the interpreter did not start")
        return Execution()

    backend = FakeBackend(handler_factory=lambda: MemoryWorkspace(code=warm_up_fails_twice))
    with SandboxPool(backend=backend, size=2) as pool:
        wait_for(
            lambda: pool.stats().started == 2, what="two members to start", timeout_s=10, interval_s=0.01
        )
        with pool.acquire(timeout_s=10) as sbx:
            assert sbx.alive and len(failed) == 2
        assert sum(i.alive for i in backend.instances) == 2  # the two that failed were closed


def test_a_pool_whose_starts_keep_failing_retries_ever_less_often_and_fills_once_they_do_not() -> None:
    """The refill retried a failed start every half second for as long as its cause lasted
    (a vault down: two reads of it a second, for ever). The wait now doubles with each
    failure in a row (0.5, 1, 2 s, then 4 s); the acquirer gets the error meanwhile, and
    a close does not wait for the refill's next try."""
    down = threading.Event()
    down.set()
    tries: list[float] = []

    class Failing(FakeBackend):
        def start(self, spec: SandboxSpec) -> FakeInstance:
            tries.append(time.monotonic())
            if down.is_set():
                raise SandboxStartError("credential 'api': its source could not be read (ConnectionError)")
            return super().start(spec)

    pool = SandboxPool(backend=Failing(), size=1)
    try:
        with pytest.raises(SandboxStartError, match="credential 'api'"), pool.acquire(timeout_s=5):
            pass
        time.sleep(2.5)
        assert len(tries) <= 3, "retried every half second"  # at 0, 0.5 and 1.5 s
        down.clear()
        wait_for(lambda: pool.stats().ready == 1, what="the next try, 2 s after the last", timeout_s=10)
        assert len(tries) == 4
        with pool.acquire(timeout_s=1) as sbx:
            assert sbx.alive
    finally:
        closing = time.monotonic()
        pool.close()
        assert time.monotonic() - closing < 2


class SlowToAnswerAlive(WrapperInstance):
    """A sandbox whose liveness takes a moment to ask (a real one asks its supervisor)."""

    @property
    def alive(self) -> bool:
        time.sleep(0.002)
        return self.wrapped.alive


class SlowAliveBackend(WrapperBackend):
    def start(self, spec: SandboxSpec) -> Instance:
        return SlowToAnswerAlive(self.wrapped.start(spec))


def test_a_pool_never_holds_more_members_than_its_size() -> None:
    """A member taken off the queue was counted nowhere until it was counted in use (after a
    look at its liveness): a refill at that moment started one too many (three live members
    in a pool of two, seen thrice in an attack)."""
    fake = FakeBackend()
    backend = SlowAliveBackend(fake)
    most = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal most
        while not stop.is_set():
            most = max(most, sum(i.alive for i in list(fake.instances)))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with SandboxPool(backend=backend, size=2, max_uses=3) as pool:

        def user() -> None:
            for _ in range(150):
                with pool.acquire(timeout_s=10) as sbx:
                    sbx.files.write("a.txt", "x")

        users = [threading.Thread(target=user) for _ in range(3)]
        for thread in users:
            thread.start()
        for thread in users:
            thread.join(60)
        stop.set()
        watcher.join(5)
        stats = pool.stats()
    assert most <= 2, (most, stats)
    assert stats.replaced >= 100 and stats.last_replaced_why == "max_uses reached"  # not "it died"


@pytest.mark.parametrize(
    "bad",
    [{"size": 0}, {"size": None}, {"max_uses": 0}, {"idle_timeout_s": 0}, {"idle_timeout_s": float("nan")},
     {"idle_timeout_s": None}, {"size": True}],
)  # fmt: skip
def test_a_pool_refuses_sizes_and_times_it_cannot_keep(bad: dict[str, object]) -> None:
    """A NaN idle time was taken, then killed the pool's thread (it never refilled)."""
    with pytest.raises(InvalidArgument):
        SandboxPool(backend=FakeBackend(MemoryWorkspace()), **bad)  # type: ignore[arg-type]


def test_a_member_whose_liveness_check_raises_is_dropped_not_counted_in_use_for_ever() -> None:
    """A Ctrl-C (or a backend's error) between the member's count and its hand-out left it
    counted in use and open: no user had it, and ``close`` never reached it."""

    class Flaky(FakeInstance):
        raised = False

        @property
        def alive(self) -> bool:
            if not Flaky.raised and not self.closed:
                Flaky.raised = True
                raise KeyboardInterrupt
            return not self.closed

    class FlakyBackend(FakeBackend):
        def start(self, spec: SandboxSpec) -> FakeInstance:
            instance = Flaky(MemoryWorkspace(), self.tier, len(self.instances) + 1, spec=spec)
            self.instances.append(instance)
            return instance

    backend = FlakyBackend()
    with SandboxPool(backend=backend, size=1) as pool:
        wait_for(lambda: pool.stats().ready == 1, what="the first member", timeout_s=5, interval_s=0.01)
        with pytest.raises(KeyboardInterrupt), pool.acquire():
            pass
        assert pool.stats().in_use == 0 and backend.instances[0].closed
        with pool.acquire() as sbx:  # the worker replaced it
            sbx.files.write("a.txt", "x")
    assert all(instance.closed for instance in backend.instances)
