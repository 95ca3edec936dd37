"""Guards: plain callables ``guard(ctx, op) -> op`` composed in a pipeline.

A guard may return the op (possibly rewritten) or raise ``PolicyDenied``; the first denial
stops the pipeline. ``GuardedInstance`` runs the pipeline before every op of a sandbox, so a
denied command never reaches the sandbox whatever layer above forgot to check.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from stockade._display import visible
from stockade.exceptions import PolicyDenied
from stockade.policy.approval import Approvals
from stockade.policy.approval_book import ApprovalRequest
from stockade.policy.engine import Decision, PolicyEngine
from stockade.policy.schema import Verdict
from stockade.runtime.anomaly import ANOMALY_RULE, AnomalyMonitor
from stockade.sandbox.base import (
    Backend,
    Instance,
    OpResult,
    OutputSink,
    SandboxSpec,
    WrapperBackend,
    WrapperInstance,
)
from stockade.sandbox.ops import Op, RunCode, RunCommand, as_inline

__all__ = [
    "GuardedBackend",
    "GuardedInstance",
    "OpContext",
    "OpGuard",
    "describe",
    "enforce",
    "op_policy_guard",
    "pipeline",
    "shown",
]


@dataclass(frozen=True, kw_only=True)
class OpContext:
    """What a guard of sandbox ops knows besides the op: the run, the role, the tool that issued
    it. (A guard of tool calls gets the loop's ``GuardContext``.)"""

    run_id: str = "adhoc"
    role: str | None = None
    tool: str = ""


OpGuard = Callable[[OpContext, Op[Any]], Op[Any]]


def pipeline(guards: Sequence[OpGuard]) -> OpGuard:
    def run(ctx: OpContext, op: Op[Any]) -> Op[Any]:
        for guard in guards:
            op = guard(ctx, op)
        return op

    return run


# What an approver is shown of an action at most; a longer one is cut in the middle, and says so.
SHOWN_CHARS = 4000


# Text that reads like one of ``visible``'s escapes: an action holding it is bound by its digest.
_LOOKS_ESCAPED = re.compile(r"\\(?:x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})", re.IGNORECASE)


def _digest(action: str) -> str:
    return hashlib.sha256(action.encode("utf-8", "surrogatepass")).hexdigest()


def shown(action: str, limit: int = SHOWN_CHARS) -> str:
    """``action`` as a human approving it sees it, and as every surface shows it (the terminal,
    the service's API, the run viewer): its controls, bidi and invisible characters as escapes
    (``stockade._display.visible``), whole or its head and tail around a note of what is cut.

    An approval's id is made from this text, so it stands for the exact action. Cut to its first
    500 characters, `git push origin main; echo AAAA...; git push --force origin HEAD:prod` was
    asked as its harmless head, and the same head with another tail was then let through under
    that approval: a cut text names the SHA-256 of the whole. Escaped, ``rm ./sr<ZWSP>c`` and a
    literal ``rm ./sr\\u200bc`` would read the same: a text with an escape, or with words that
    look like one, names the SHA-256 of the exact action too."""
    text = visible(action)
    if len(text) > limit:
        head, tail = text[: limit * 2 // 3], text[-(limit // 3) :]
        cut = len(text) - len(head) - len(tail)
        return f"{head} [... {cut:,} characters not shown; the whole is sha256 {_digest(action)} ...] {tail}"
    if text != action or _LOOKS_ESCAPED.search(action):
        return f"{text} [shown with escapes; the exact action is sha256 {_digest(action)}]"
    return action


def describe(op: Op[Any]) -> str:
    """The op in words, for humans approving it and for the model reading a denial."""
    match op:
        case RunCommand():
            return shown(f"run `{shlex.join(as_inline(op))}`")
        case RunCode():
            # the code itself: by its length alone, any code of that length shared an approval
            return shown(f"run Python code ({len(op.code)} chars):\n{op.code}")
    path = getattr(op, "path", "")
    return shown(f"{type(op).__name__} {path!r}")


def enforce(
    decision: Decision,
    ctx: OpContext,
    action: str,
    approvals: Approvals | None,
    monitor: AnomalyMonitor | None = None,
) -> None:
    """Turn a decision into nothing (allow), ``PolicyDenied``, or a wait for approval."""
    verdict, rule, reason = decision.verdict, decision.rule, decision.reason
    if verdict is Verdict.ALLOW and monitor is not None:
        flagged = monitor.hold(action)
        if flagged is not None:
            verdict, rule, reason = Verdict.APPROVE, ANOMALY_RULE, flagged
    if verdict is Verdict.ALLOW:
        return
    # a reason may quote what the call asked (a path, a word): escaped as the action is, since
    # the API, the book and the trail hand it on raw (a raw U+202E reordered it for a reader)
    reason = visible(reason)
    if verdict is Verdict.DENY:
        raise PolicyDenied(f"{action}: {reason}", rule=rule, action=action)
    request = ApprovalRequest(run_id=ctx.run_id, action=action, rule=rule, reason=reason)
    (approvals or Approvals()).require(request)


def op_policy_guard(
    engine: PolicyEngine, approvals: Approvals | None = None, monitor: AnomalyMonitor | None = None
) -> OpGuard:
    def guard(ctx: OpContext, op: Op[Any]) -> Op[Any]:
        enforce(engine.op(op, tool=ctx.tool), ctx, describe(op), approvals, monitor)
        return op

    return guard


class GuardedInstance(WrapperInstance):
    def __init__(self, wrapped: Instance, guard: OpGuard, ctx: OpContext) -> None:
        super().__init__(wrapped)
        self.guard = guard
        self.ctx = ctx

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        return self.wrapped.handle(self.guard(self.ctx, op), sink)


class GuardedBackend(WrapperBackend):
    def __init__(self, wrapped: Backend, guard: OpGuard, ctx: OpContext) -> None:
        super().__init__(wrapped)
        self.guard = guard
        self.ctx = ctx

    def start(self, spec: SandboxSpec) -> GuardedInstance:
        return GuardedInstance(self.wrapped.start(spec), self.guard, self.ctx)
