"""A process that starts one durable agent run for ``test_audit_in_flight`` and stays inside its
only tool call, its audit trail (keyed) written up to the call's start, until it is SIGKILLed.

    python inflight_child.py STORE_URL NAMESPACE RUN_ID READY_FILE

``READY_FILE`` appears once the call's ``tool_call_start`` is in the trail.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from stockade import Sandbox
from stockade.agent import Agent
from stockade.audit import AuditLog, open_store
from stockade.audit.agent import AuditObserver
from stockade.runs import RunRecorder, open_run_store
from stockade.testing import FakeBackend, MemoryWorkspace, ScriptedModel, tool_call
from stockade.tools import ToolContext, default_toolset, tool

KEY = b"k" * 32
url, namespace, run_id, ready = sys.argv[1:5]


@tool
def slow(ctx: ToolContext) -> str:
    """Take a long time."""
    log.flush()
    Path(ready).write_text("started")
    time.sleep(120)
    return "done"


store = open_run_store(url, namespace=namespace, key=KEY)
log = AuditLog(open_store(url, namespace=f"{namespace}_audit"), key=KEY, flush_interval_s=None)
agent = Agent(
    ScriptedModel([tool_call("slow"), "done"]),
    tools=default_toolset().including(slow),
    checkpointer=store,
    observers=[AuditObserver(log), RunRecorder(store)],
)
with Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sandbox:
    agent.run_sync("wait", sandbox=sandbox, run_id=run_id)
