"""What keeping a run's sandbox costs: an agent run of tool calls with
``keep_sandbox_each_call`` off (the default: a snapshot only when the run pauses) and on (a
snapshot after every call), per tier, and the pause itself.

    python bench/run_snapshots.py [--tiers process,microvm] [--runs N] [--calls N]

Side by side in one run, interleaved (drift hits both alike): a run of ``--calls`` ``run_code``
calls then an answer, through ``build_agent`` with a SQLite run store, each way; then a run
that pauses for an approval after one call (the snapshot at the pause included). Prints a
markdown table (medians, per call) and the machine's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from stockade.agent import RunStatus
from stockade.assembly import AgentConfig, build_agent
from stockade.models import ScriptedModel, tool_call
from stockade.models.scripted import Turn
from stockade.sandbox.snapshots import SnapshotStore
from stockade.tools import default_toolset, shell
from stockade.types import Limits

POLICY = """\
version = 1
[trust]
level = "trusted"
[models]
approved = ["scripted*"]
[commands]
approve = ["rm -r"]
"""


def one_run(
    tier: str, work: Path, turns: list[Turn], *, each_call: bool, run_id: str
) -> tuple[float, RunStatus]:
    config = AgentConfig(
        model=ScriptedModel(turns),
        policy=work / "policy.toml",
        tier=tier,
        audit=f"sqlite:///{work / 'audit.db'}",
        tools=default_toolset().including(shell),
        approval_dir=work / "approvals",
        kill_target=str(work / "kill"),
        sandbox_limits=Limits(memory_mb=256, timeout_s=60, pids=64),
        snapshot_store=SnapshotStore(work / "snapshots"),
        keep_sandbox_each_call=each_call,
    )
    with build_agent(config) as agent, agent.session(run_id=run_id) as session:
        started = time.perf_counter()
        result = session.run_sync("bench")
        return time.perf_counter() - started, result.status


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiers", default="process,microvm")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    calls: list[Turn] = [
        tool_call("run_code", {"language": "python", "code": f"x{i} = list(range(10000))"})
        for i in range(args.calls)
    ]
    pausing: list[Turn] = [*calls[:1], tool_call("shell", {"command": "rm -r scratch"}), "done"]
    rows = []
    for tier in args.tiers.split(","):
        with tempfile.TemporaryDirectory() as folder:
            work = Path(folder)
            (work / "policy.toml").write_text(POLICY)
            one_run(tier, work, [*calls[:1], "done"], each_call=False, run_id="warm")  # images, caches
            off, on, paused = [], [], []
            for n in range(args.runs):
                off.append(one_run(tier, work, [*calls, "done"], each_call=False, run_id=f"off-{n}")[0])
                on.append(one_run(tier, work, [*calls, "done"], each_call=True, run_id=f"on-{n}")[0])
                seconds, status = one_run(tier, work, pausing, each_call=False, run_id=f"pause-{n}")
                assert status == RunStatus.PAUSED, status
                paused.append(seconds)
        off_ms, on_ms = (statistics.median(xs) / args.calls * 1000 for xs in (off, on))
        rows.append(f"| {tier} | {off_ms:.0f} ms | {on_ms:.0f} ms | {statistics.median(paused):.2f} s |")
    print(f"{args.runs} runs of {args.calls} run_code calls each way, interleaved; medians\n")
    print("| tier | per call, kept when paused | per call, kept after each call | a run that pauses |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nload average: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
