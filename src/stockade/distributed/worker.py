"""``stockade worker``: a Celery worker that runs the service's runs."""

from __future__ import annotations

from stockade.distributed.tasks import configure, make_app, start_waker
from stockade.server.context import ServiceConfig

__all__ = ["run_worker"]


def run_worker(
    config: ServiceConfig, *, concurrency: int = 2, pool: str = "prefork", name: str | None = None,
    loglevel: str = "INFO",
) -> None:  # fmt: skip
    """Consume runs until SIGTERM (warm: runs in progress finish; their messages are acked
    then) or SIGKILL (cold: a live worker's or API process's waker sends them again once
    their leases have lapsed, ``server/wakes.py``)."""
    assert config.redis is not None
    configure(config)
    app = make_app(config.redis, visibility_timeout_s=config.visibility_timeout_s, queue=config.queue)
    argv = ["worker", f"--concurrency={concurrency}", f"--pool={pool}", f"--loglevel={loglevel}",
            "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
    if name:
        argv.append(f"--hostname={name}")
    waker = start_waker(app, config)  # a dead worker's runs are sent again by any live one
    try:
        app.worker_main(argv)
    finally:
        waker.close()
