"""Warm pools, for every tier: sandboxes started ahead of demand.

    pool = SandboxPool(tier="process", size=4, max_uses=50, idle_timeout_s=300)
    with pool.acquire() as sbx:
        sbx.run_code("print(1)")
    pool.close()

A returned sandbox is never handed out dirty: it is reset in the background (every process
killed, every writable place emptied, the settings code can change put back, no socket left
that no process holds, and a fresh interpreter forked from a process that never saw any
user, so nothing of one user's memory reaches the next; its egress proxy's credentials are
read again from their sources) or, past ``max_uses``, when it broke or when the reset could
not make it as fresh as it started, closed and replaced. Members are recycled in parallel:
one slow reset never holds up the others. Members idle past ``idle_timeout_s`` are replaced
too, so nothing ages in the pool.

A pool filled from a snapshot (``snapshot=``) hands out sandboxes as the snapshot has them
(files, and memory where the tier keeps it); a returned one is replaced by a new one from
the snapshot, never reset (a reset would empty what the snapshot put there). On the microVM
every pool refills from the tier's boot image anyway; a pool without a snapshot first has the
tier build its members' ready image (``Backend.prepare_for``), so its first members start from
it too.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from stockade import exceptions as exc
from stockade._checks import MAX_TIMEOUT_S, check_number
from stockade.sandbox import _registry
from stockade.sandbox._approver import Approver
from stockade.sandbox._startup import choose_tier, from_snapshot, sandbox_spec, store_of
from stockade.sandbox.base import Backend, Instance, OpResult, OutputSink, WrapperInstance
from stockade.sandbox.facade import Sandbox
from stockade.sandbox.ops import Op, Reset, RunCode
from stockade.sandbox.snapshots import SnapshotStore
from stockade.types import Limits, NetworkPolicy, SandboxRules, Snapshot

__all__ = ["PoolStats", "SandboxPool"]


REFILL_RETRY_S = 0.5  # after a start failed (unless its error says when: ``retry_after``)
# ... doubled for each failure in a row, up to this: an acquirer meanwhile gets the last
# start's error, for up to this long after its cause ended
MAX_REFILL_RETRY_S = 4.0


def _backoff(err: exc.StockadeError, failures: int) -> float:
    """How long the refill waits after its ``failures``-th failed start in a row: a cause
    that lasts (a vault down, a tier's engine gone) is not asked twice a second for ever,
    and a pool's acquirers get its error meanwhile."""
    return err.retry_after or min(REFILL_RETRY_S * 2 ** min(failures - 1, 16), MAX_REFILL_RETRY_S)


@dataclass(frozen=True)
class PoolStats:
    ready: int
    in_use: int
    started: int
    recycled: int
    replaced: int
    last_replaced_why: str = ""  # the last member replaced instead of reset: why


@dataclass
class _Member:
    instance: Instance
    uses: int = 0
    idle_since: float = 0.0
    busy_at_return: bool = False  # a call of its last user still ran: replaced, not reset


class _Lease(WrapperInstance):
    """One user's hold on a member. It stops working when the member goes back, so a handle
    kept past its ``acquire`` block never reaches the next user's sandbox.

    Every way through to the member is here (``WrapperInstance`` forwards all of them): a
    call, a cut, a close, ``alive``, ``wrapped`` itself. Each checks the end under the lock,
    and a call or a cut counts as one in flight while it runs, so one racing the block's end
    has the member replaced, not reset for the next user (a kept watchdog's cut went through
    and killed user 2's code). At the end the lease lets go of the member: it keeps nothing,
    private attributes included, to reach it by."""

    def __init__(self, wrapped: Instance) -> None:
        self._lock = threading.Lock()
        self._calls = 0  # in flight
        super().__init__(wrapped)

    def _held(self) -> Instance:
        """The member, under the lock; ``SandboxClosed`` once it went back."""
        if self._member is None:
            raise _went_back()
        return self._member

    @property
    def wrapped(self) -> Instance:
        with self._lock:
            return self._held()

    @wrapped.setter
    def wrapped(self, member: Instance) -> None:
        self._member: Instance | None = member

    @contextlib.contextmanager
    def _reaching(self) -> Iterator[Instance]:
        """The member, for one call through this lease; ``SandboxClosed`` once it went back."""
        with self._lock:
            member = self._held()
            self._calls += 1
        try:
            yield member
        finally:
            with self._lock:
                self._calls -= 1

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        with self._reaching() as member:
            return member.handle(op, sink)

    def cut_running(self) -> None:
        # A cut is nothing to stop once the block ended: what runs then is the next user's.
        with contextlib.suppress(exc.SandboxClosed), self._reaching() as member:
            member.cut_running()

    def end(self) -> bool:
        """No more calls through this lease; whether one was still running (from another thread)."""
        with self._lock:
            self._member = None
            return self._calls > 0

    def close(self) -> None:
        # the user's own close: the member is replaced; after the block, nothing of the next user's
        with contextlib.suppress(exc.SandboxClosed), self._reaching() as member:
            member.close()

    @property
    def alive(self) -> bool:
        with self._lock:
            return self._member is not None and self._member.alive


def _went_back() -> exc.SandboxClosed:
    return exc.SandboxClosed(
        "this sandbox went back to its pool when its acquire() block ended: acquire another"
    )


class SandboxPool:
    def __init__(
        self,
        tier: str | None = None,
        *,
        size: int = 2,
        max_uses: int = 100,
        idle_timeout_s: float = 300.0,
        limits: Limits | None = None,
        network: NetworkPolicy | None = None,
        envs: Mapping[str, str] | None = None,
        allow_weaker: bool = False,
        backend: Backend | None = None,
        snapshot: Snapshot | str | None = None,
        store: SnapshotStore | None = None,
        rules: SandboxRules | None = None,
        approver: Approver | None = None,
    ) -> None:
        """``tier`` as ``Sandbox.create`` takes it: ``"process"`` by default, or the snapshot's
        tier with ``snapshot=`` (a tier given is the members' tier even then: a files snapshot
        taken on a weaker tier never fills a pool asked for a stronger one with weaker members).
        ``rules`` and ``approver`` as ``Sandbox.create`` takes them: every member is under
        the rules, and a reset keeps them (what one user's code ran or had approved is dropped
        with the rest of its state)."""
        # typed refusals, not a TypeError here or a NaN that killed the pool's thread later
        check_number(size, argument="size", integer=True, low=1, high=10_000)
        check_number(max_uses, argument="max_uses", integer=True, low=1, high=2**31)
        check_number(idle_timeout_s, argument="idle_timeout_s", integer=False, low=0, high=MAX_TIMEOUT_S,
                     unit="s", low_inclusive=False)  # fmt: skip
        self.size = size
        self.max_uses = max_uses
        self.idle_timeout_s = idle_timeout_s
        self._spec = sandbox_spec(limits, network, envs, allow_weaker, None, rules=rules, approver=approver)
        # the snapshot each member starts from, its objects kept while a member reads them
        self._source = (store_of(snapshot, store), snapshot) if snapshot is not None else None
        if snapshot is not None:
            given = {"limits": limits, "network": network, "envs": envs}
            tier, self._spec = from_snapshot(snapshot, store, tier, self._spec, given)
        self._backend = backend or _registry.backend(choose_tier(tier, None))
        self._ready: queue.Queue[_Member] = queue.Queue()
        # Wakes the worker: a member was taken or replaced (the pool may be short), or closing.
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        # A member is taken off the queue and counted in use in one step under the lock: taken
        # and not yet counted, it was in neither count, and a refill meanwhile started one too
        # many (an attack saw three live members in a pool of two).
        self._available = threading.Condition(self._lock)
        self._in_use = 0
        self._pending = 0  # starts under way, counted so the refill does not overshoot
        self._counts = {"started": 0, "recycled": 0, "replaced": 0}
        self._why = ""
        self._closed = threading.Event()
        self._error: exc.StockadeError | None = None
        # Its members and threads are this process's: a forked child's copy hands out, takes
        # back and closes none of them (the parent's to recycle and close).
        self._owner = os.getpid()
        from concurrent.futures import ThreadPoolExecutor  # lazily: importing stockade stays cheap

        self._recyclers = ThreadPoolExecutor(max_workers=size, thread_name_prefix="stockade-pool-reset")
        self._worker = threading.Thread(target=self._run, name="stockade-pool", daemon=True)
        self._worker.start()

    # -- public -------------------------------------------------------------------------

    @contextlib.contextmanager
    def acquire(self, timeout_s: float = 60.0) -> Iterator[Sandbox]:
        """A clean, started sandbox; returned to the pool (reset) when the block ends."""
        if self._owner != os.getpid():
            raise exc.SandboxClosed(
                f"this pool belongs to process {self._owner} (this one's parent before a fork): "
                "a forked child cannot use it; make a pool in the child"
            )
        member = self._take(timeout_s)
        lease: _Lease | None = None
        try:  # from here whatever ends the block (a Ctrl-C included) gives the member back
            lease = _Lease(member.instance)
            yield Sandbox(lease)
        finally:
            if self._owner == os.getpid():  # else the block ended in a forked child: the parent's
                member.uses += 1
                # a call still running would reach the reset's or the next user's session: the
                # member is closed (the call with it) and replaced instead
                member.busy_at_return = lease.end() if lease is not None else False
                self._release(member)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                ready=self._ready.qsize(), in_use=self._in_use, **self._counts, last_replaced_why=self._why
            )

    def close(self, wait_s: float = 30.0) -> None:
        """Close every member. Sandboxes still acquired are closed when they come back. A
        member still starting is waited for up to ``wait_s``, then closed by the pool's thread
        when its start ends (a start that outlived the wait was left running in the closed
        pool). In a forked child, nothing: the members are the parent's."""
        check_number(wait_s, argument="wait_s", integer=False, low=0, high=MAX_TIMEOUT_S, unit="s")
        if self._owner != os.getpid():
            return
        with self._lock:  # after this, no refill puts a member in the queue: it closes it
            self._closed.set()
        self._wake.put(None)
        self._worker.join(timeout=wait_s)
        self._recyclers.shutdown(wait=True)
        self._close_ready()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _close_ready(self) -> None:
        while True:
            try:
                self._ready.get_nowait().instance.close()
            except queue.Empty:
                break

    def _take(self, timeout_s: float) -> _Member:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                member = self._next_ready(deadline, timeout_s)
                self._in_use += 1
                missing = self.size - self._ready.qsize() - self._in_use - self._pending
            try:
                alive = member.instance.alive
            except BaseException:  # counted in use: dropped, or no close would ever reach it
                self._drop(member, "its liveness could not be read")
                raise
            if alive:
                if missing > 0:  # not when the member came from the pool's count (the usual case)
                    self._wake.put(None)  # let the worker top the pool up
                return member
            self._drop(member, "it broke while waiting")

    def _drop(self, member: _Member, why: str) -> None:
        """Close a member taken for a user who will not get it; the worker replaces it."""
        with self._lock:
            self._in_use -= 1
        member.instance.close()
        self._replaced(why)
        self._wake.put(None)

    def _next_ready(self, deadline: float, timeout_s: float) -> _Member:
        """The next ready member, waiting for one until ``deadline`` (the lock held)."""
        while True:
            if self._closed.is_set():
                raise exc.SandboxClosed("the pool is closed")
            try:
                return self._ready.get_nowait()
            except queue.Empty:
                pass
            if self._error is not None:
                raise self._error
            left = deadline - time.monotonic()
            if left <= 0:
                raise exc.ResourceContention(
                    f"no pooled sandbox became free within {timeout_s}s", retry_after=1.0
                )
            self._available.wait(min(0.5, left))

    def _put_ready(self, member: _Member) -> None:
        with self._lock:
            self._ready.put(member)
            self._available.notify()

    def _replaced(self, why: str) -> None:
        with self._lock:
            self._counts["replaced"] += 1
            self._why = why[:500]

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _release(self, member: _Member) -> None:
        """Straight to a recycling thread (still counted in use until it starts): no hop
        through the worker, whose wake-ups cost every program CPU."""
        try:
            self._recyclers.submit(self._recycle, member)
        except RuntimeError:  # closed meanwhile: the recyclers take no more work
            with self._lock:
                self._in_use -= 1
            member.instance.close()

    def _run(self) -> None:
        self._prepare()
        while not self._closed.is_set():
            self._refill()
            try:
                self._wake.get(timeout=min(self.idle_timeout_s / 4, 1.0))
            except queue.Empty:
                self._expire_idle()

    def _prepare(self) -> None:
        """Before the first fill: what the tier makes ahead for the pool's spec (the microVM's
        boot and ready images), so that no member's start pays for it, the first ones included."""
        if self._spec.snapshot is not None:
            return  # members start from the snapshot
        # An error here: the fill's start meets it again, and the pool reports it as for any start.
        with contextlib.suppress(exc.StockadeError):
            self._backend.prepare_for(self._spec)

    def _reading(self) -> contextlib.AbstractContextManager[object]:
        """While a member starts from the pool's snapshot: its objects kept, even if the
        snapshot is deleted meanwhile (``SnapshotStore.reading``; then no member after)."""
        if self._source is None:
            return contextlib.nullcontext()
        store, snapshot = self._source
        return store.reading(snapshot)

    def _refill(self) -> None:
        failures = 0  # starts failed in a row: the wait before the next one grows
        while not self._closed.is_set():
            with self._lock:
                missing = self.size - self._ready.qsize() - self._in_use - self._pending
                if missing <= 0:
                    return
                self._pending += 1
            try:
                with self._reading():
                    instance = self._backend.start(self._spec)
            except exc.StockadeError as err:
                self._error = err
                with self._lock:
                    self._pending -= 1
                if not err.retryable:
                    return
                failures += 1
                self._closed.wait(_backoff(err, failures))
                continue
            try:
                instance.execute(RunCode(code=""))  # start its interpreter ahead of demand
            except exc.StockadeError as err:
                # as a start that failed: uncounted, or two such failures left the pool
                # believing itself full, starting nothing and handing nothing out for good
                instance.close()
                self._error = err
                with self._lock:
                    self._pending -= 1
                failures += 1
                self._closed.wait(_backoff(err, failures))
                continue
            failures = 0
            self._error = None
            self._count("started")
            with self._lock:
                self._pending -= 1
                late = self._closed.is_set()  # the pool closed while it started: nobody takes it
                if not late:
                    self._ready.put(_Member(instance, idle_since=time.monotonic()))
                    self._available.notify()
            if late:
                instance.close()
                return

    def _recycle(self, member: _Member) -> None:
        # Counted as pending until it is back in the queue or closed: were it neither in use
        # nor pending while its reset runs, a refill meanwhile would start a sandbox too many
        # and the next user would get that one instead of the recycled member.
        with self._lock:
            self._in_use -= 1
            self._pending += 1
        back = False
        try:
            back = self._recycle_or_replace(member)
        finally:
            with self._lock:
                self._pending -= 1
            if not back:
                self._wake.put(None)  # a replaced member's successor starts now, not at the next tick

    def _recycle_or_replace(self, member: _Member) -> bool:
        """Whether the member is back in the pool (else it was closed)."""
        if self._closed.is_set():
            member.instance.close()
            return False
        if member.busy_at_return:
            member.instance.close()
            self._replaced("a call of its user still ran when it came back")
            return False
        alive = member.instance.alive  # (a closed member is not: asked after, every one "died")
        if member.uses >= self.max_uses or not alive:
            member.instance.close()
            self._replaced("max_uses reached" if alive else "it died")
            return False
        if self._spec.snapshot is not None:
            # A reset would empty what the snapshot holds: a new member starts from it instead.
            member.instance.close()
            self._replaced("fresh from its snapshot")
            return False
        try:
            # The interpreter it starts runs once by itself (copy-on-write faults paid off
            # the next user's path) before it reads a request.
            member.instance.execute(Reset(warm_interpreter=True))
        except Exception as err:  # a member we cannot vouch for is never handed out
            member.instance.close()
            self._replaced(f"its reset failed: {type(err).__name__}: {err}")
            return False
        member.idle_since = time.monotonic()
        self._count("recycled")
        self._put_ready(member)
        return True

    def _expire_idle(self) -> None:
        now = time.monotonic()
        keep: list[_Member] = []
        while True:
            try:
                member = self._ready.get_nowait()
            except queue.Empty:
                break
            if now - member.idle_since > self.idle_timeout_s or not member.instance.alive:
                member.instance.close()
                self._replaced("idle too long, or dead")
            else:
                keep.append(member)
        for member in keep:
            self._put_ready(member)
