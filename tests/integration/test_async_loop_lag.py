"""An async agent run keeps the event loop free on the real process tier: starting the sandbox,
seeding it with a 48 MiB workspace (and the run store's copy of it), closing it and flushing the
trail all happen in worker threads. Before, a 1 ms ticker beside the run stalled for over a
second. The bound is half that: a tick is also late when the machine is busy (372 ms once on
three workers over two cores, CI run 131), so the test runs alone."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from stockade.agent import RunStatus
from stockade.assembly import AgentConfig, build_agent
from stockade.models import ScriptedModel, tool_call
from stockade.types import Trust
from tests.conftest import require_tier

pytestmark = pytest.mark.process


@pytest.mark.alone  # a late tick is the machine's as much as the loop's
def test_an_async_run_with_a_large_workspace_leaves_the_event_loop_free(tmp_path: Path) -> None:
    require_tier("process")
    seed = tmp_path / "project"
    seed.mkdir()
    for n in range(48):  # incompressible: the run store keeps all of it
        (seed / f"blob{n}.bin").write_bytes(os.urandom(1 << 20))
    (seed / "a.py").write_text("print(1)\n")
    cfg = AgentConfig(
        model=ScriptedModel([tool_call("read_file", {"path": "a.py"}), "done"]),
        tier="process",
        trust=Trust.TRUSTED,
        audit=f"sqlite:///{tmp_path / 'audit.db'}",
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
    )

    async def main() -> float:
        worst = 0.0

        async def ticker() -> None:
            nonlocal worst
            while True:
                started = time.monotonic()
                await asyncio.sleep(0.001)
                worst = max(worst, time.monotonic() - started - 0.001)

        with build_agent(cfg) as agent:
            ticking = asyncio.create_task(ticker())
            await asyncio.sleep(0.05)
            worst = 0.0
            result = await agent.run("read it", workspace=seed)
            ticking.cancel()
        assert result.status == RunStatus.SUCCESS, result.error
        return worst

    worst = asyncio.run(main())
    assert worst < 0.6, f"the event loop stalled {worst * 1000:.0f} ms during the run"
