"""The policy's guards as the assembly wires them, each denial recorded in the audit trail
(``record_denial``): at the tool call, at each sandbox op, at the prompt.

``call_guard`` opens a tool call's scope (the context variables of ``approvals``) before the
policy judges the call; ``op_guard`` lets through the ops of a call a human approved and
judges every other op again (defence in depth).
"""

from __future__ import annotations

from typing import Any

from stockade.agent.events import AgentEvent, RunStarted
from stockade.agent.events import Observer as AgentObserver
from stockade.agent.loop import Guard, GuardContext
from stockade.assembly.approvals import call_approved, call_at
from stockade.audit.events import EventKind
from stockade.audit.log import AuditLog
from stockade.audit.sandbox import current_call
from stockade.exceptions import PolicyDenied
from stockade.models.messages import ToolCall
from stockade.policy.agent import FlagSink, prompt_filter
from stockade.policy.approval import Approvals
from stockade.policy.engine import PolicyEngine
from stockade.policy.guards import OpContext, OpGuard, describe, enforce
from stockade.policy.schema import Verdict
from stockade.sandbox.ops import Op

__all__ = ["audited_prompt_filter", "call_guard", "op_guard", "record_denial"]


def record_denial(log: AuditLog, run_id: str, level: str, err: PolicyDenied, tool: str = "") -> None:
    attributes = {"decision": "deny", "level": level, "rule": err.rule, "reason": str(err), "tool": tool}
    if err.action:
        attributes["action"] = err.action
    step, call = (call_at.get() or (0, None)) if level == "sandbox" else (0, None)
    if call is not None:
        attributes["call_id"] = call
    log.record(EventKind.POLICY_DECISION, run_id=run_id, step=step, actor="policy", attributes=attributes)


def call_guard(inner: Guard) -> Guard:
    def guard(ctx: GuardContext, call: ToolCall) -> ToolCall:
        call_approved.set(False)  # a new call: no approval yet (the loop records its denials)
        current_call.set(call.id)  # what its code runs inside the sandbox is recorded under it
        call_at.set((ctx.step, call.id))
        return inner(ctx, call)

    return guard


def op_guard(engine: PolicyEngine, approvals: Approvals, log: AuditLog) -> OpGuard:
    def guard(ctx: OpContext, op: Op[Any]) -> Op[Any]:
        decision = engine.op(op, tool=ctx.tool)
        if decision.verdict is Verdict.APPROVE and call_approved.get():
            return op  # a human approved the tool call that issues this op
        try:
            enforce(decision, ctx, describe(op), approvals)
        except PolicyDenied as err:
            record_denial(log, ctx.run_id, "sandbox", err, ctx.tool)
            raise
        return op

    return guard


def audited_prompt_filter(engine: PolicyEngine, log: AuditLog, on_flag: FlagSink) -> AgentObserver:
    inner = prompt_filter(engine, on_flag=on_flag)

    def observe(event: AgentEvent) -> None:
        try:
            inner(event)
        except PolicyDenied as err:
            assert isinstance(event, RunStarted)
            record_denial(log, event.run_id, "prompt", err)
            raise

    return observe
