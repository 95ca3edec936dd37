"""The Celery application and its one task, ``stockade.run``."""

from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Any

from celery import Celery, Task
from kombu.exceptions import KombuError

from stockade import exceptions as exc
from stockade.server.context import ServiceConfig
from stockade.server.executor import QUOTA_POLL_S
from stockade.server.runner import Runner
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore
from stockade.server.wakes import Waker, Wakes

__all__ = ["RUN_TASK", "configure", "make_app", "send_run", "start_waker"]

log = logging.getLogger("stockade.worker")
RUN_TASK = "stockade.run"
BROKER_RETRY_S = 5.0  # Retry-After of a request refused because the broker is away
# a send tries the broker for about a second, not kombu's default of three tries with growing
# pauses, while the request that sends waits
SEND_RETRY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 0.5}


class _Process:
    """This process's configuration and runner (one per pool child, made after the fork)."""

    config: ServiceConfig | None = None
    runner: Runner | None = None
    pid = 0
    lock = threading.Lock()


def make_app(broker: str, *, visibility_timeout_s: float = 3600.0, queue: str = "stockade") -> Celery:
    app = Celery("stockade", broker=broker, set_as_current=False)
    app.conf.update(
        task_acks_late=True,  # acknowledged when the run stops: a dead worker's run is given again
        task_reject_on_worker_lost=True,  # ... also when only the pool's child died
        worker_prefetch_multiplier=1,  # a worker holds no more runs than it runs
        task_default_queue=queue,
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,  # the state is in the database, not in a result backend
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": visibility_timeout_s,
            # look for abandoned messages often: a dead worker's run is back within a few seconds
            # of its visibility timeout, not up to 100 s later (kombu's defaults)
            "unacked_restore_interval": max(1, min(10, int(visibility_timeout_s / 4))),
            "unacked_restore_throttle": 1,
            "global_keyprefix": f"{queue}:",
        },
        worker_hijack_root_logger=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    app.task(name=RUN_TASK, bind=True, max_retries=None)(_run)
    return app


def send_run(app: Celery, run_id: str, reason: str = "submitted") -> None:
    """One message for the run; its id names the run and why it is sent: the same submission
    sent twice is one task id. A message runs the run only as far as the run store says it
    has not gone, so a copy starts nothing."""
    suffix = "" if reason == "submitted" else f":{uuid.uuid4().hex[:8]}"
    try:
        app.send_task(
            RUN_TASK, args=[run_id], task_id=f"run:{run_id}:{reason}{suffix}", retry_policy=SEND_RETRY
        )
    except (KombuError, OSError) as error:  # kombu's OperationalError, a refused connection
        raise exc.ServiceUnavailable(
            f"the broker cannot be reached ({type(error).__name__}: {error}); run {run_id} was not sent",
            retry_after=BROKER_RETRY_S,
        ) from None


def start_waker(app: Celery, config: ServiceConfig) -> Waker:
    """This process's waker: sends the service's runs whose wake has come (``server/wakes.py``),
    on a database connection of its own."""
    store = ServiceStore(open_database(config.database))  # makes the tables when they are new
    return Waker(Wakes(store.db), lambda run_id, reason: send_run(app, run_id, reason)).start()


def configure(config: ServiceConfig) -> None:
    """The configuration the worker's runs use (set before the pool forks)."""
    _Process.config = config


def _runner_here() -> Runner:
    """One runner per process, made after the fork (connections are not shared across it)."""
    with _Process.lock:
        if _Process.runner is None or _Process.pid != os.getpid():
            if _Process.config is None:
                raise exc.ConfigurationError("the worker is not configured: start it with `stockade worker`")
            _Process.runner = Runner(_Process.config, name=f"{os.uname().nodename}:{os.getpid()}")
            _Process.pid = os.getpid()
        return _Process.runner


def _run(task: Task, run_id: str, *_: Any) -> str:
    runner = _runner_here()
    assert _Process.config is not None
    row = runner.store.run_head(run_id)
    tenants = _Process.config.tenants.current()  # as the file is now
    tenant = tenants.tenants.get(row.tenant) if row is not None else None
    # Given again (the broker on a worker lost, a waker's "orphaned") while no process holds
    # it: the worker of its last attempt died. One that dies each time is capped.
    died = row is not None and row.status == "running" and not runner.runs.leased(run_id)
    if died and runner.failed_attempt(run_id, tenant, "its worker died while running it"):
        return "error"
    try:
        outcome = runner.execute(run_id, tenant)
    except exc.RunLeased as leased:  # another process runs it: its wake says if that one dies
        return _again(task, runner, run_id, (leased.retry_after or 5.0) + 1.0, "leased elsewhere")
    except exc.QuotaExceeded:  # the tenant's quota is full: wait queued, not on this worker
        return _again(task, runner, run_id, runner.quota_wait_s(tenant), "waiting for room in its quota")
    except exc.RunDeferred as deferred:  # its tenant's window is full: wait queued, not on this worker
        return _again(task, runner, run_id, max(deferred.retry_after or QUOTA_POLL_S, 0.5), "deferred")
    except exc.StockadeError as error:
        if not error.retryable:
            raise
        if runner.failed_attempt(run_id, tenant, str(error)):
            return "error"
        attempts = row.attempts if row is not None else 0
        delay = error.retry_after or min(60.0, 2.0 * 2 ** min(attempts, 5))
        log.warning("run %s: %s; again in %.0f s", run_id, error, delay)
        return _again(task, runner, run_id, delay, "transient")
    log.info("run %s: %s", run_id, outcome.status)
    return outcome.status


def _again(task: Task, runner: Runner, run_id: str, delay_s: float, why: str) -> str:
    """The run goes again in ``delay_s``: a wake in the database (``server/wakes.py``), which
    outlives this worker, and the message is done. With the database away, a countdown
    message this worker holds (lost with it until the broker's visibility timeout)."""
    try:
        runner.wakes.set(run_id, delay_s)
    except exc.StockadeError as error:
        log.warning("run %s: no wake written (%s): a countdown of %.0f s instead", run_id, error, delay_s)
        raise task.retry(countdown=delay_s) from None
    log.info("run %s: %s; again in %.1f s", run_id, why, delay_s)
    return why
