"""The policy plugged into an ``Agent``:

    engine = PolicyEngine(load_policy("policy.toml"), role="developer")
    approvals = Approvals(cli_approver, ApprovalStore())
    agent = Agent(approved_model(engine, model), tools=filter_outputs(engine, tools),
                  guards=[policy_guard(engine, approvals)], observers=[prompt_filter(engine)])
    sbx = guarded_sandbox(engine, sbx, run_id=..., approvals=approvals)   # enforcement at the sandbox

``policy_guard`` decides on the tool call (role, decision boundaries, the tool's risk, the
command a shell or test tool would run, the paths a file tool or a patch would touch) so the
model hears a clear denial before anything happens;
``guarded_sandbox`` decides again on every sandbox op, whatever tool issued it.

A prompt rule whose action is "flag" does not stop anything: ``prompt_filter`` and
``filter_outputs`` hand a ``PromptFlagged`` to ``on_flag`` (``RuntimeControls.flag`` records,
logs and counts it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from pydantic import BaseModel

from stockade.agent.events import AgentEvent, RunStarted
from stockade.agent.settings import Guard, GuardContext
from stockade.exceptions import PatchRejected, PolicyDenied
from stockade.models.base import Model, WrapperModel
from stockade.models.messages import ModelRequest, ModelResponse, ToolCall
from stockade.policy.approval import Approvals
from stockade.policy.engine import Decision, PolicyEngine, strictest
from stockade.policy.guards import GuardedInstance, OpContext, enforce, op_policy_guard, shown
from stockade.runtime.anomaly import AnomalyMonitor
from stockade.runtime.events import PromptFlagged
from stockade.sandbox.facade import Sandbox
from stockade.sandbox.ops import ReadFile, RunCommand, WriteFile
from stockade.tools.base import CallNext, Tool, ToolContext, Toolset, render
from stockade.tools.patch import patch_ops

__all__ = [
    "ApprovedModel",
    "FlagSink",
    "filter_outputs",
    "guarded_sandbox",
    "policy_guard",
    "prompt_filter",
]

COMMAND_TOOLS = ("shell", "run_tests", "run_command")
FlagSink = Callable[[PromptFlagged], None]


def _call_decision(engine: PolicyEngine, call: ToolCall, risk: str | None = None) -> Decision:
    decisions = [engine.tool(call.name)]
    if risk is not None:
        decisions.append(engine.risk(risk, tool=call.name))
    command = call.args.get("command")
    if call.name in COMMAND_TOOLS and isinstance(command, str):
        decisions.append(engine.op(RunCommand(argv=("/bin/sh", "-c", command)), tool=call.name))
    path = call.args.get("path")
    if isinstance(path, str):
        if call.name in ("write_file",):
            decisions.append(engine.op(WriteFile(path=path, data=b""), tool=call.name))
        elif call.name in ("read_file",):
            decisions.append(engine.op(ReadFile(path=path), tool=call.name))
    diff = call.args.get("diff")
    if call.name == "apply_patch" and isinstance(diff, str):
        # every path the diff touches: old and new names, renames, deletions; a text that is not
        # a diff is the tool's to explain (it writes nothing)
        with contextlib.suppress(PatchRejected):
            decisions += [engine.op(op, tool=call.name) for op in patch_ops(diff)]
    return strictest(decisions)


def policy_guard(
    engine: PolicyEngine, approvals: Approvals | None = None, monitor: AnomalyMonitor | None = None
) -> Guard:
    """An agent guard: deny (back to the model), ask for approval (the run pauses), or allow."""

    def guard(ctx: GuardContext, call: ToolCall) -> ToolCall:
        action = f"{call.name}({', '.join(f'{k}={v!r}' for k, v in call.args.items())})"
        op_ctx = OpContext(run_id=ctx.run_id, role=engine.role_name, tool=call.name)
        decision = _call_decision(engine, call, ctx.tool.risk.value if ctx.tool.name == call.name else None)
        enforce(decision, op_ctx, shown(action), approvals, monitor)
        return call

    return guard


def guarded_sandbox(
    engine: PolicyEngine, sandbox: Sandbox, *, run_id: str, approvals: Approvals | None = None
) -> Sandbox:
    """The same sandbox, with every op checked against the policy before it reaches the tier."""
    ctx = OpContext(run_id=run_id, role=engine.role_name)
    return Sandbox(GuardedInstance(sandbox.instance, op_policy_guard(engine, approvals), ctx))


def filter_outputs(engine: PolicyEngine, tools: Toolset, *, on_flag: FlagSink | None = None) -> Toolset:
    """Tool outputs matching a ``deny`` prompt rule are withheld from the model; ``flag`` rules
    are reported to ``on_flag``."""

    async def wrapper(ctx: ToolContext, tool: Tool, args: BaseModel, call_next: CallNext) -> object:
        value = await call_next(ctx, tool, args)
        verdict = engine.prompt(render(value), "tool_output")
        if verdict.verdict == "flag" and on_flag is not None:
            on_flag(PromptFlagged(rules=verdict.rules, source="tool_output", tool=tool.name))
        if verdict.verdict == "deny":
            raise PolicyDenied(
                f"the output of {tool.name} was withheld: it matched {', '.join(verdict.rules)}",
                rule=f"prompts: {', '.join(verdict.rules)}",
                action=tool.name,
            )
        return value

    return tools.wrapped(wrapper)


def prompt_filter(engine: PolicyEngine, *, on_flag: FlagSink | None = None) -> Callable[[AgentEvent], None]:
    """An agent observer: a task prompt matching a ``deny`` rule ends the run as "denied"; one
    matching a ``flag`` rule is reported to ``on_flag``."""

    def observe(event: AgentEvent) -> None:
        if isinstance(event, RunStarted) and not event.resumed:
            verdict = engine.prompt(event.task, "task")
            if verdict.verdict == "flag" and on_flag is not None:
                on_flag(PromptFlagged(rules=verdict.rules, source="task"))
            if verdict.verdict == "deny":
                raise PolicyDenied(
                    f"the task was refused: it matched {', '.join(verdict.rules)}",
                    rule=f"prompts: {', '.join(verdict.rules)}",
                )

    return observe


class ApprovedModel(WrapperModel):
    """Only models in the policy's registry are invoked (checked on the name actually served)."""

    def __init__(self, wrapped: Model, engine: PolicyEngine) -> None:
        super().__init__(wrapped)
        self.engine = engine
        self._check(wrapped.name)

    def _check(self, name: str) -> None:
        decision = self.engine.model(name, self.provider)
        if not decision.allowed:
            raise PolicyDenied(decision.reason, rule=decision.rule, action=f"model {name}")

    async def request(self, request: ModelRequest) -> ModelResponse:
        response = await self.wrapped.request(request)
        if response.model_name and response.model_name != self.name:
            self._check(response.model_name)
        return response
