"""An ``AsyncSandbox``'s blocking calls run on stockade's own threads, one per call and ended
with it, never the event loop's default executor: that pool is the application's (six
threads on two cores), and calls waiting in all of it made every other call wait, the
application's own ``asyncio.to_thread`` too."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from stockade.sandbox.base import Backend, Instance, OpResult, OutputSink, SandboxSpec, ThreadedAsyncBackend
from stockade.sandbox.ops import Op, RunCommand
from stockade.types import Enforcement, TierReport


class Held(Instance):
    """A sandbox whose ``wait`` command waits until ``release`` is set."""

    def __init__(self) -> None:
        self.id, self.tier = "held", "held"
        self.enforcement = cast(Enforcement, None)  # never looked at here
        self.release = threading.Event()

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        if isinstance(op, RunCommand) and op.argv == ("wait",):
            self.release.wait(60)
        return None

    def close(self) -> None:
        self.release.set()

    @property
    def alive(self) -> bool:
        return True


class HeldBackend(Backend):
    tier = "held"

    def __init__(self) -> None:
        self.held = Held()

    def probe(self) -> TierReport:
        return TierReport(tier=self.tier, available=True, detail="")

    def start(self, spec: SandboxSpec) -> Instance:
        return self.held


async def test_calls_that_wait_hold_up_no_other_call_nor_the_applications_threads() -> None:
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2))
    backend = HeldBackend()
    sbx = await ThreadedAsyncBackend(backend).astart(SandboxSpec())
    waiting = [asyncio.create_task(sbx.aexecute(RunCommand(argv=("wait",)))) for _ in range(4)]
    await asyncio.sleep(0.1)
    await asyncio.wait_for(sbx.aexecute(RunCommand(argv=("quick",))), 10)
    assert await asyncio.wait_for(asyncio.to_thread(lambda: "own"), 10) == "own"
    assert not any(task.done() for task in waiting)  # answered while the four still waited
    backend.held.release.set()
    await asyncio.gather(*waiting)
    await sbx.aclose()
    for thread in threading.enumerate():
        if thread.name == "stockade-call":
            thread.join(10)
    assert [t for t in threading.enumerate() if t.name == "stockade-call"] == []  # none outlives its call
