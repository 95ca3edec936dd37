"""A process that starts or resumes one agent run for ``test_runs_snapshots`` and prints a JSON
report: the run pauses for an approval (``approval``) or is interrupted mid-command
(``interrupt``) after its first call defined a Python variable and wrote a file in /tmp.

    python kept_child.py start|resume approval|interrupt TIER WORK_DIR [each-call]

``WORK_DIR`` holds the policy, the audit and run store database, the approvals and the
snapshot store. The scripted model: define ``x`` (and /tmp/scratch.txt, notes.txt), a call that
stops the run, then ``x + 1`` and a ``cat`` of both files, then an answer.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from stockade.agent import AgentEvent, ToolCalled
from stockade.assembly import AgentConfig, AgentSession, build_agent
from stockade.models import ScriptedModel, tool_call
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
RUN_ID = "kept-run"

mode, scenario, tier, work = sys.argv[1:5]
each_call = sys.argv[5:] == ["each-call"]
WORK = Path(work)
(WORK / "policy.toml").write_text(POLICY)

stopper = (
    tool_call("shell", {"command": "rm -r scratch"})  # waits for a human's approval
    if scenario == "approval"
    else tool_call("shell", {"command": "sleep 30"})  # interrupted while it runs
)
model = ScriptedModel(
    [
        tool_call(
            "run_code",
            {
                "language": "python",
                "code": "import os\nx = 41\nos.makedirs('scratch', exist_ok=True)\n"
                "open('/tmp/scratch.txt', 'w').write('tmp kept')\nopen('notes.txt', 'w').write('notes kept')",
            },
        ),
        stopper,
        tool_call("run_code", {"language": "python", "code": "print(x + 1)"}),
        tool_call("shell", {"command": "cat /tmp/scratch.txt; echo; cat notes.txt"}),
        "done",
    ]
)
sessions: list[AgentSession] = []


def interrupt_the_sleep(event: AgentEvent) -> None:
    if (
        scenario == "interrupt"
        and isinstance(event, ToolCalled)
        and event.call.args.get("command") == "sleep 30"
    ):
        threading.Timer(1.0, sessions[0].interrupt, args=("the test interrupts it",)).start()


config = AgentConfig(
    model=model,
    policy=WORK / "policy.toml",
    tier=tier,
    audit=f"sqlite:///{WORK / 'audit.db'}",
    tools=default_toolset().including(shell),
    approval_dir=WORK / "approvals",
    kill_target=str(WORK / "kill"),
    sandbox_limits=Limits(memory_mb=256, timeout_s=60, pids=64),
    snapshot_store=SnapshotStore(WORK / "snapshots"),
    keep_sandbox_each_call=each_call,
    observers=[interrupt_the_sleep],
)
with build_agent(config) as agent, agent.session(run_id=RUN_ID) as session:
    sessions.append(session)
    result = session.run_sync("keep your sandbox") if mode == "start" else session.resume_sync()
    observations = [r.observation for s in result.steps for r in s.tool_calls]
    print(
        json.dumps(
            {
                "status": result.status.value,
                "snapshot": result.state.snapshot,
                "tier": result.tier,
                "observations": observations,
            }
        )
    )
