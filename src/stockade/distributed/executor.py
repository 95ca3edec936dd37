"""``CeleryExecutor``: the service's runs go to ``stockade worker`` processes through Redis."""

from __future__ import annotations

import uuid

from stockade.distributed.tasks import RUN_TASK, make_app
from stockade.server.context import ServiceConfig

__all__ = ["CeleryExecutor"]


class CeleryExecutor:
    def __init__(self, config: ServiceConfig) -> None:
        assert config.redis is not None
        self.app = make_app(
            config.redis, visibility_timeout_s=config.visibility_timeout_s, queue=config.queue
        )

    def submit(self, run_id: str, *, reason: str = "submitted") -> None:
        # the id names the run and why it is sent: the same submission sent twice is one task id;
        # every message runs the run only as far as the run store says it has not gone
        suffix = "" if reason == "submitted" else f":{uuid.uuid4().hex[:8]}"
        self.app.send_task(RUN_TASK, args=[run_id], task_id=f"run:{run_id}:{reason}{suffix}")

    def close(self) -> None:
        self.app.close()
