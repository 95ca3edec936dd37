"""Where submitted runs go: ``Executor.submit(run_id)``.

``InProcessExecutor`` (the embedded default) runs them on threads of the server's process;
``stockade.distributed.CeleryExecutor`` sends them to Celery workers. Either may be asked to
run the same run twice (a client retries, an approval arrives): the runner makes that safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from stockade import exceptions as exc
from stockade.server.context import MAX_ATTEMPTS
from stockade.server.run_waits import QUOTA_POLL_S
from stockade.server.runner import Runner, RunOutcome
from stockade.server.tenants import Tenants, TenantsFile

__all__ = ["QUOTA_POLL_S", "Executor", "InProcessExecutor"]

log = logging.getLogger("stockade.executor")


class Executor(Protocol):
    def submit(self, run_id: str, *, reason: str = "submitted") -> None:
        """Have ``run_id`` run (start it, or resume it from its last step)."""

    def close(self) -> None: ...


class InProcessExecutor:
    """Runs on ``threads`` threads of this process, retrying what is transient."""

    def __init__(
        self, runner: Runner, tenants: Tenants | TenantsFile, *, threads: int = 2,
        max_attempts: int = MAX_ATTEMPTS,
    ) -> None:  # fmt: skip
        self.runner = runner
        self.tenants = tenants
        self.max_attempts = max_attempts
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="stockade-run")
        self._closed = threading.Event()
        self._futures: set[Future[RunOutcome | None]] = set()
        self._timers: dict[str, threading.Timer] = {}  # runs waiting for room in their quota or window
        self._lock = threading.Lock()

    def submit(self, run_id: str, *, reason: str = "submitted") -> None:
        future = self._pool.submit(self._run, run_id)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._forget)

    def _forget(self, future: Future[RunOutcome | None]) -> None:
        with self._lock:
            self._futures.discard(future)

    def _run(self, run_id: str) -> RunOutcome | None:
        row = self.runner.store.run_head(run_id)
        tenant = self.tenants.current().tenants.get(row.tenant) if row is not None else None
        last = "no attempt"
        for attempt in range(1, self.max_attempts + 1):
            if self._closed.is_set():
                return None
            try:
                return self.runner.execute(run_id, tenant)
            except exc.QuotaExceeded:  # the tenant's quota is full: ask again later, off the pool
                self._later(run_id, self.runner.quota_wait_s(tenant))
                return None
            except exc.RunDeferred as deferred:  # its tenant's window is full: again once it frees
                self._later(run_id, deferred.retry_after or QUOTA_POLL_S, reason="limit")
                return None
            except exc.RunLeased as leased:
                # another thread (or process) runs it: look again after its lease, holding no
                # thread and counting no attempt (a long run's copy gave up after 20 and wrote
                # "error" over the run that ran on)
                wait = leased.retry_after if leased.retry_after is not None else 5.0
                self._later(run_id, wait + 0.1, reason="leased")
                return None
            except exc.StockadeError as error:  # transient
                last = str(error)
                delay = error.retry_after if error.retry_after is not None else min(30.0, 0.5 * 2**attempt)
                log.info("run %s: %s; again in %.1f s", run_id, error, delay)
                self._closed.wait(min(delay, 30.0) + 0.1)
            except Exception:
                log.exception("run %s failed", run_id)
                self.runner.store.set_status(run_id, "error", error="internal error (see the server's log)")
                return None
        self.runner.give_up(run_id, tenant, self.max_attempts, last)
        return None

    def _later(self, run_id: str, delay_s: float = QUOTA_POLL_S, *, reason: str = "quota") -> None:
        timer = threading.Timer(delay_s, self._again, args=(run_id, reason))
        timer.daemon = True
        with self._lock:
            self._timers[run_id] = timer
        timer.start()

    def _again(self, run_id: str, reason: str) -> None:
        with self._lock:
            self._timers.pop(run_id, None)
        if not self._closed.is_set():
            self.submit(run_id, reason=reason)

    def wait(self, timeout_s: float) -> bool:
        """Tests and benchmarks: wait until no run is in progress."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._futures:
                    return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        """Stop: runs in progress end "interrupted" at once (the next start resumes them)."""
        self._closed.set()
        with self._lock:
            timers, self._timers = list(self._timers.values()), {}
        for timer in timers:
            timer.cancel()
        self.runner.interrupt_all("the server is stopping")
        self._pool.shutdown(wait=True, cancel_futures=True)


ExecutorFactory = Callable[[Runner, Tenants], Executor]
