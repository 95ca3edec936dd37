"""``RuntimeAuditor``: the runtime controls' events, recorded into the audit trail.

    auditor = RuntimeAuditor(log)
    agent = Agent(model, observers=[AuditObserver(log), auditor.track])
    backend = RetryingBackend(backend, Retrier(observer=auditor))
    breakers = Breakers(observer=auditor)

Runtime events do not know which run or step they belong to; ``track`` (an agent observer)
follows the run, so each event is filed under the step and tool call in progress. One audit
event per runtime event:

    RetryScheduled -> retry (subject, attempt, delay_s, reason)
    FlakyRerun     -> retry (flaky: true, both exit codes)
    BreakerChanged -> breaker_change (name, old, new, failures, reason)
    LimitHit       -> rate_limited (kind "rate") or budget (spend, budget), decision "deny", or
                      "wait" when the run waits for the window (``action``: refuse, wait, stop)
    AnomalyFlagged -> anomaly (rule, detail, action)
    PromptFlagged  -> policy_decision (decision "flag", level "prompt", rules, source, tool)
    KillRequested  -> kill_switch (reason, killed instances), under the killed run's id

Runtime observers must not raise (a control never fails because its reporting did): a
failed write is raised at the next agent event instead, which ends the run.
"""

from __future__ import annotations

from stockade import exceptions as exc
from stockade.agent.events import AgentEvent, ModelRequested, RunStarted, ToolCalled, ToolReturned
from stockade.audit.events import EventKind
from stockade.audit.log import AuditLog
from stockade.runtime.events import (
    AnomalyFlagged,
    BreakerChanged,
    FlakyRerun,
    KillRequested,
    LimitHit,
    PromptFlagged,
    RetryScheduled,
    RuntimeEvent,
)

__all__ = ["RuntimeAuditor"]


class RuntimeAuditor:
    """A runtime observer (``auditor(event)``) that writes to ``log``; ``track`` follows the run."""

    def __init__(self, log: AuditLog, *, run_id: str = "", actor: str = "runtime") -> None:
        self.log = log
        self.run_id = run_id
        self.actor = actor
        self.step = 0
        self.call_id: str | None = None
        self._failure: exc.StockadeError | None = None

    def track(self, event: AgentEvent) -> None:
        """An agent observer: remembers the run, step and tool call that runtime events belong to."""
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        match event:
            case RunStarted():
                self.run_id = event.run_id
            case ModelRequested():
                self.step, self.call_id = event.step, None
            case ToolCalled():
                self.step, self.call_id = event.step, event.call.id
            case ToolReturned():
                self.call_id = None
            case _:
                pass

    def __call__(self, event: RuntimeEvent) -> None:
        kind, attributes, run_id = self._translate(event)
        where: dict[str, object] = {"call_id": self.call_id} if self.call_id is not None else {}
        try:
            self.log.record(
                kind, run_id=run_id, step=self.step, actor=self.actor, attributes={**attributes, **where}
            )
        except exc.StockadeError as error:
            self._failure = error

    def _translate(self, event: RuntimeEvent) -> tuple[EventKind, dict[str, object], str]:
        match event:
            case RetryScheduled():
                return (
                    EventKind.RETRY,
                    {
                        "subject": event.subject,
                        "attempt": event.attempt,
                        "delay_s": event.delay_s,
                        "reason": event.reason,
                    },
                    self.run_id,
                )
            case FlakyRerun():
                return (
                    EventKind.RETRY,
                    {
                        "subject": event.subject,
                        "flaky": True,
                        "first_exit_code": event.first_exit_code,
                        "second_exit_code": event.second_exit_code,
                    },
                    self.run_id,
                )
            case BreakerChanged():
                return (
                    EventKind.BREAKER_CHANGE,
                    {
                        "name": event.name,
                        "old": event.old.value,
                        "new": event.new.value,
                        "failures": event.failures,
                        "reason": event.reason,
                    },
                    self.run_id,
                )
            case LimitHit():
                kind = EventKind.RATE_LIMITED if event.kind == "rate" else EventKind.BUDGET
                return (
                    kind,
                    {
                        "decision": "wait" if event.action in ("wait", "defer") else "deny",
                        "action": event.action,
                        "limit": event.kind,
                        "key": event.key,
                        "detail": event.detail,
                        "retry_after": event.retry_after,
                    },
                    self.run_id,
                )
            case AnomalyFlagged():
                return (
                    EventKind.ANOMALY,
                    {
                        "rule": event.rule,
                        "detail": event.detail,
                        "action": event.action.value,
                        "subject": event.subject,
                    },
                    self.run_id,
                )
            case PromptFlagged():
                return (
                    EventKind.POLICY_DECISION,
                    {
                        "decision": "flag",
                        "level": "prompt",
                        "rules": list(event.rules),
                        "source": event.source,
                        "tool": event.tool,
                    },
                    self.run_id,
                )
            case KillRequested():
                return (
                    EventKind.KILL_SWITCH,
                    {
                        "reason": event.reason,
                        "killed_instances": event.killed_instances,
                        "interrupted": event.interrupted,
                    },
                    event.run_id,
                )
