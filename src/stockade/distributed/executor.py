"""``CeleryExecutor``: the service's runs go to ``stockade worker`` processes through Redis."""

from __future__ import annotations

from stockade.distributed.tasks import make_app, send_run, start_waker
from stockade.server.context import ServiceConfig

__all__ = ["CeleryExecutor"]


class CeleryExecutor:
    """Sends runs to the workers; its waker sends again the runs whose wake has come (those
    waiting for a window or a quota, and those whose worker died), as every worker's does."""

    def __init__(self, config: ServiceConfig) -> None:
        assert config.redis is not None
        self.app = make_app(
            config.redis, visibility_timeout_s=config.visibility_timeout_s, queue=config.queue
        )
        self._waker = start_waker(self.app, config)

    def submit(self, run_id: str, *, reason: str = "submitted") -> None:
        send_run(self.app, run_id, reason)

    def close(self) -> None:
        self._waker.close()
        self.app.close()
