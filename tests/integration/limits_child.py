"""One agent run in a process of its own, for ``test_runtime_redis``: a scripted model asks for
``ACTIONS`` shell commands; the limits are shared through Redis. Prints the result as JSON.

    python limits_child.py REDIS_URL TENANT SCOPE ON_LIMIT ACTIONS [PERIOD_S]

SCOPE "tenant" limits every run of TENANT to 3 actions a minute (``rate_per_minute``), "run"
each run alone (``run_rate_per_minute``). With PERIOD_S the limit is 2 actions per PERIOD_S
seconds, set on the runtime controls directly (an agent's windows are a minute long).
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import replace

from stockade.assembly import AgentConfig, build_agent
from stockade.audit import AuditLog, MemoryStore
from stockade.policy.schema import Policy, TrustRules
from stockade.runtime.limits import OnLimit, RateLimit, RedisWindow
from stockade.sandbox.ops import RunCommand
from stockade.testing import FakeBackend, MemoryWorkspace, ScriptedModel, tool_call
from stockade.tools import Toolset, shell
from stockade.types import Trust

url, tenant, scope, on_limit, actions = sys.argv[1:6]
period = float(sys.argv[6]) if len(sys.argv) > 6 else None

backend = FakeBackend(MemoryWorkspace(), tier="process")
config = AgentConfig(
    model=ScriptedModel([tool_call("shell", {"command": "echo hi"})] * int(actions) + ["done"]),
    policy=Policy(trust=TrustRules(level=Trust.TRUSTED)),
    backend=backend,
    audit=AuditLog(MemoryStore(), flush_interval_s=None),
    tools=Toolset([shell]),
    anomaly=False,
    tenant=tenant,
    limits_redis_url=url,
    on_rate_limit=OnLimit(on_limit),
)
if scope == "tenant":
    config = replace(config, rate_per_minute=3)
elif scope == "run":
    config = replace(config, run_rate_per_minute=3)
started = time.monotonic()
with build_agent(config) as agent, agent.session(run_id=f"child-{uuid.uuid4().hex}") as session:
    if period is not None:  # two actions per PERIOD_S, for every run of the tenant
        session.controls.rate = RateLimit(per_minute=2, window=RedisWindow(url), period_s=period)
    result = session.run_sync("echo")
ran = sum(1 for i in backend.instances for op in i.ops if isinstance(op, RunCommand))
print(json.dumps({"status": result.status.value, "commands": ran, "seconds": time.monotonic() - started}))
