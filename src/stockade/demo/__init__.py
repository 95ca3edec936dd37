"""``stockade demo``: the main job on the embedded default, with no API key.

A scripted model fixes a real bug in the sample project shipped here (``sample_project/``),
inside a real process-tier sandbox, assembled by ``build_agent`` (policy, runtime controls,
audit trail): the tests fail, it reads the code, patches it with a
unified diff, reruns the tests, and they pass; the run's acceptance check (the same test
command) confirms it before the run counts as a success. On the way, one workspace read fails with an
injected transient error (``ResourceContention``) and the retry layer
(``stockade.runtime.retry``) runs it again.

The sandbox sees the host's ``/usr``: the tests run under pytest when the sandbox's
``python3`` has it (Debian's ``python3-pytest``), else under ``python3 -m unittest``, which
needs nothing beyond the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from stockade.agent import AgentEvent, Checkpointer, Observer, RunLimits, RunResult, RunStarted
from stockade.assembly import AgentConfig, build_agent
from stockade.audit.log import AuditLog
from stockade.models import ScriptedModel, tool_call
from stockade.policy.schema import CommandRules, Policy, TrustRules
from stockade.runtime.events import Observer as RuntimeObserver
from stockade.runtime.events import RuntimeEvent
from stockade.runtime.retry import RetryPolicy
from stockade.sandbox import _registry
from stockade.sandbox.base import Backend
from stockade.sandbox.facade import Sandbox
from stockade.testing import FaultInjectingBackend
from stockade.types import Trust

__all__ = ["DEMO_POLICY", "SAMPLE_PROJECT", "demo_model", "run_demo", "test_command"]

SAMPLE_PROJECT = Path(__file__).parent / "sample_project"
# The code the demo runs is ours (a scripted model replaying known steps): trusted, so the
# embedded default tier is allowed; network tools are denied all the same.
DEMO_POLICY = Policy(
    trust=TrustRules(level=Trust.TRUSTED),
    commands=CommandRules(deny=("curl", "wget", "ssh", "sudo"), approve=("rm -r", "git push")),
)
TASK = "The test suite of this project fails. Find the bug, fix it, and make the tests pass."

FIX = """\
--- a/inventory.py
+++ b/inventory.py
@@ -11,4 +11,4 @@
 def restock_needed(stock: dict[str, int], threshold: int) -> list[str]:
     \"\"\"The items to reorder: those with ``threshold`` units or fewer, sorted by name.\"\"\"
-    return sorted(name for name, count in stock.items() if count < threshold)
+    return sorted(name for name, count in stock.items() if count <= threshold)
"""


def test_command(sandbox: Sandbox) -> str:
    """pytest when the sandbox's python3 has it, else the standard library's unittest."""
    probe = sandbox.commands.run(["python3", "-c", "import pytest"], timeout_s=30)
    return "python3 -m pytest -q -p no:cacheprovider" if probe.ok else "python3 -m unittest -v"


test_command.__test__ = False  # type: ignore[attr-defined]  # a helper, not a pytest test


def demo_model(command: str) -> ScriptedModel:
    """What a good model does with this project, turn by turn."""
    return ScriptedModel(
        [
            tool_call("run_tests", {"command": command}),
            tool_call("read_file", {"path": "inventory.py"}),
            tool_call("apply_patch", {"diff": FIX}),
            tool_call("run_tests", {"command": command}),
            "Fixed restock_needed: items with exactly `threshold` units must be reordered too "
            "(`count <= threshold`, as its docstring says). All tests pass.",
        ],
        name="scripted-demo",
    )


def run_demo(
    *,
    tier: str = "process",
    observers: Sequence[Observer] = (),
    on_retry: RuntimeObserver | None = None,
    backend: Backend | None = None,
    audit: str | AuditLog = "memory:",
    run_id: str | None = None,
    checkpointer: Checkpointer | None = None,
) -> RunResult:
    """Run the whole demo, recorded in ``audit`` (a store URL or a log) and, when given, in a run
    store (``checkpointer``); ``backend`` replaces the tier (tests pass a fake)."""
    inner = backend or _registry.backend(tier)
    with Sandbox.create(backend=inner) as probe:  # which test runner the sandbox has
        command = test_command(probe)
    faults = FaultInjectingBackend(inner, path="inventory.py", armed=False)

    def arm_on_start(event: AgentEvent) -> None:
        if isinstance(event, RunStarted):
            faults.arm()  # fail during the run, not while the baseline is recorded

    config = AgentConfig(
        model=demo_model(command),
        policy=DEMO_POLICY,
        backend=faults,
        audit=audit,
        checkpointer=checkpointer,
        limits=RunLimits(max_steps=10),
        check=command,  # "success" means the tests pass, not only that the model said so
        retry=RetryPolicy(wait_initial=0.05, wait_jitter=0.05),
        observers=(arm_on_start, *observers),
        runtime_observers=(on_retry,) if on_retry is not None else (),
        anomaly=False,  # a short scripted run: nothing to watch for, and nothing to flag
    )
    with build_agent(config) as agent:
        return agent.run_sync(TASK, workspace=SAMPLE_PROJECT, run_id=run_id)


def _ignore(event: RuntimeEvent) -> None:
    """Retries are not shown unless asked."""
