"""The embedded server's executor (``InProcessExecutor``) with a stand-in runner: a run another
thread or process holds is looked at again after its lease, holding no thread, for as long as
it is held; it is never given up as "error" while it runs on."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import cast

from stockade import exceptions as exc
from stockade.server.executor import InProcessExecutor
from stockade.server.runner import Runner, RunOutcome
from stockade.server.tenants import Tenants


@dataclass
class Row:
    tenant: str = "acme"


@dataclass
class Store:
    statuses: list[tuple[str, str]] = field(default_factory=list)

    def run_head(self, run_id: str) -> Row:
        return Row()

    def set_status(self, run_id: str, status: str, *, error: str | None = None) -> bool:
        self.statuses.append((run_id, status))
        return True


class HeldRunner:
    """Another process holds the run for its first ``held`` looks; then it has ended."""

    def __init__(self, held: int) -> None:
        self.store = Store()
        self.held = held
        self.looks = 0
        self.ended = threading.Event()

    def execute(self, run_id: str, tenant: object) -> RunOutcome:
        self.looks += 1
        if self.looks <= self.held:
            raise exc.RunLeased(f"run {run_id} runs elsewhere", retry_after=0.0)
        self.ended.set()
        return RunOutcome(run_id=run_id, status="success")

    def interrupt_all(self, reason: str) -> None:
        pass


def test_a_run_held_elsewhere_is_looked_at_again_until_it_ends_never_given_up() -> None:
    runner = HeldRunner(held=25)  # more looks than the executor's 20 attempts at a transient error
    executor = InProcessExecutor(cast(Runner, runner), Tenants(tenants={}, tokens={}), threads=1)
    try:
        executor.submit("r1")
        assert runner.ended.wait(timeout=60), runner.looks
    finally:
        executor.close()
    assert runner.looks == 26
    assert runner.store.statuses == []  # before: "error" ("gave up after 20 attempts") over a live run
