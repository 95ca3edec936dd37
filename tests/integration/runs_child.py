"""A process that runs an agent for ``test_runs_resume``: ``start`` appends a line to a host file
and dies by SIGKILL right after that call returned; ``resume`` continues the run.

    python runs_child.py start|resume STORE_URL NAMESPACE RUN_ID HOST_FILE

The host file stands for a side effect outside the sandbox (a payment, a pushed commit): it
survives the process and its sandbox, so it shows how many times the call really ran.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from stockade import Sandbox
from stockade.agent import Agent, AgentEvent, ToolReturned
from stockade.models.scripted import Turn
from stockade.runs import RunRecorder, open_run_store
from stockade.testing import ScriptedModel, tool_call
from stockade.tools import ToolContext, default_toolset, tool

mode, url, namespace, run_id, host_file = sys.argv[1:6]


@tool
def append_line(ctx: ToolContext, text: str) -> str:
    """Append a line to the ledger kept outside the sandbox.

    Args:
        text: the line.
    """
    with open(host_file, "a", encoding="utf-8") as ledger:
        ledger.write(text + "\n")
    return f"appended {text!r}"


TURNS: list[Turn] = [
    tool_call("append_line", {"text": "paid invoice 42"}),
    tool_call("write_file", {"path": "receipt.txt", "content": "paid\n"}),
    "invoice 42 is paid",
]


def die_after_the_side_effect(event: AgentEvent) -> None:
    if mode == "start" and isinstance(event, ToolReturned) and event.record.call.name == "append_line":
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no flush, no checkpoint


store = open_run_store(url, namespace=namespace)
agent = Agent(
    ScriptedModel(TURNS),
    tools=default_toolset().including(append_line),
    checkpointer=store,
    observers=[RunRecorder(store), die_after_the_side_effect],
)
with Sandbox.create("process") as sandbox:
    if mode == "start":
        agent.run_sync("pay invoice 42", sandbox=sandbox, run_id=run_id)
    else:
        result = agent.run_sync(resume=run_id, sandbox=sandbox)
        print(json.dumps({"status": result.status.value, "answer": result.answer, "diff": result.diff}))
