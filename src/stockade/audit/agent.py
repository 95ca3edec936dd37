"""``AuditObserver``: the agent loop's events, recorded into the audit trail.

    agent = Agent(model, tools, observers=[AuditObserver(log)])

One event per moment that matters: ``run_start``, ``model_call`` (when the response
arrives, with usage and the tool calls asked for), ``policy_decision`` (a denied call),
``tool_call`` (when it returns: arguments, idempotency key, error, duration, sizes; also a
call rejected as invalid), ``check`` (the acceptance check: command, passed, exit code),
``step`` and ``run_end``. Arguments and text pass through the log's redactor like any event.

A crash loses nothing for good: events wait up to ``flush_interval_s`` in the log's buffer,
which dies with the process, so when a run resumes (``RunResumed``) this observer compares
the run's trail with what the run recorded (every step's model call, every call in its
ledger) and records what is missing, marked ``"reconciled": true`` (its time is the resume's;
``recorded_ns`` in the run store is the original). A run whose process died gets a
``run_crash`` event first; a call that started and did not return, and was not run again, is
a ``tool_call`` with ``"outcome": "unknown"``.
"""

from __future__ import annotations

from stockade.agent.events import (
    AgentEvent,
    CheckFinished,
    ModelDenied,
    ModelRequested,
    ModelResponded,
    RunFinished,
    RunResumed,
    RunStarted,
    StepFinished,
    ToolCalled,
    ToolDenied,
    ToolRejected,
    ToolReturned,
)
from stockade.agent.state import ToolCallRecord
from stockade.audit.events import EventKind, JSONValue
from stockade.audit.log import AuditLog

__all__ = ["AuditObserver"]

# Task text and answers are cut here; the run store keeps them whole.
TEXT_CAP = 4096


def _cap(text: str) -> str:
    return text if len(text) <= TEXT_CAP else text[:TEXT_CAP] + f"…[{len(text) - TEXT_CAP} more chars]"


class AuditObserver:
    """An agent observer (``observer(event) -> None``) that writes to ``log``."""

    def __init__(self, log: AuditLog, *, actor: str = "agent") -> None:
        self.log = log
        self.actor = actor

    def __call__(self, event: AgentEvent) -> None:
        record = self.log.record
        match event:
            case RunResumed():
                self._reconcile(event)
            case RunStarted():
                record(
                    EventKind.RUN_START,
                    run_id=event.run_id,
                    actor=self.actor,
                    attributes={
                        "task": _cap(event.task),
                        "model": event.model_name,
                        "resumed": event.resumed,
                    },
                )
            case ModelRequested():
                pass  # recorded once, with its outcome, as ModelResponded
            case ModelResponded():
                response = event.response
                record(
                    EventKind.MODEL_CALL,
                    run_id=event.run_id,
                    step=event.step,
                    actor="model",
                    duration_s=event.duration_s,
                    attributes={
                        "model": response.model_name,
                        "finish_reason": response.finish_reason,
                        "input_tokens": response.usage.input_tokens,
                        "output_tokens": response.usage.output_tokens,
                        "tool_calls": [call.name for call in response.tool_calls],
                        "text_chars": len(response.text),
                    },
                )
            case ModelDenied():
                record(
                    EventKind.POLICY_DECISION,
                    run_id=event.run_id,
                    step=event.step,
                    actor="policy",
                    attributes={
                        "decision": "deny",
                        "level": "model",
                        "rule": event.rule,
                        "reason": event.reason,
                        "model": event.model_name,
                    },
                )
            case ToolCalled():
                pass  # recorded once, with its outcome, as ToolReturned (or ToolDenied)
            case ToolDenied():
                record(
                    EventKind.POLICY_DECISION,
                    run_id=event.run_id,
                    step=event.step,
                    actor="policy",
                    attributes={
                        "decision": "deny",
                        "rule": event.rule,
                        "reason": event.reason,
                        "tool": event.call.name,
                        "call_id": event.call.id,
                        "args": dict(event.call.args),
                    },
                )
            case ToolReturned() | ToolRejected():
                self._tool_call(event.run_id, event.step, event.record)
            case CheckFinished():
                c = event.record
                record(
                    EventKind.CHECK,
                    run_id=event.run_id,
                    step=c.step,
                    actor="check",
                    duration_s=c.duration_s,
                    attributes={
                        "command": _cap(c.command),
                        "passed": c.passed,
                        "exit_code": c.exit_code,
                        "timed_out": c.timed_out,
                        "summary": _cap(c.summary),
                    },
                )
            case StepFinished():
                record(
                    EventKind.STEP,
                    run_id=event.run_id,
                    step=event.step.index,
                    actor=self.actor,
                    attributes={"tool_calls": len(event.step.tool_calls)},
                )
            case RunFinished():
                result = event.result
                record(
                    EventKind.RUN_END,
                    run_id=event.run_id,
                    actor=self.actor,
                    attributes={
                        "status": str(result.status),
                        "steps": len(result.steps),
                        "input_tokens": result.usage.input_tokens,
                        "output_tokens": result.usage.output_tokens,
                        "cost_usd": result.cost_usd,
                        "error": result.error,
                        "answer": _cap(result.answer),
                    },
                )
                self.log.flush()  # the end of a run is a natural durability point

    def _tool_call(self, run_id: str, step: int, r: ToolCallRecord, **extra: JSONValue) -> None:
        self.log.record(
            EventKind.TOOL_CALL,
            run_id=run_id,
            step=step,
            actor=self.actor,
            duration_s=r.duration_s,
            attributes={
                "tool": r.call.name,
                "call_id": r.call.id,
                "args": dict(r.call.args),
                "idempotency_key": r.idempotency_key,
                "is_error": r.is_error,
                "error_type": r.error_type,
                "denied": r.denied,
                "observation_chars": len(r.observation),
                "cut_chars": r.cut_chars,
                **extra,
            },
        )

    def _reconcile(self, event: RunResumed) -> None:
        """Record what the run did and its trail lost (the buffer of a process that died)."""
        log, run_id, state = self.log, event.run_id, event.state
        log.flush()
        if event.recovered:
            log.record(
                EventKind.RUN_CRASH,
                run_id=run_id,
                actor="runtime",
                attributes={
                    "detail": "the run's process stopped while running it (found on resume)",
                    "steps": len(state.steps),
                    "next": state.next.value,
                },
            )
        models: set[int] = set()
        calls: set[str] = set()
        for stored in log.store.events(run_id=run_id):
            if stored.kind == EventKind.MODEL_CALL:
                models.add(stored.step)
            elif stored.kind == EventKind.TOOL_CALL:
                calls.add(str(stored.attributes.get("idempotency_key", "")))
        steps = [*state.steps, *([state.current] if state.current is not None else [])]
        for step in steps:
            if step.index not in models:
                response = step.response
                log.record(
                    EventKind.MODEL_CALL,
                    run_id=run_id,
                    step=step.index,
                    actor="model",
                    duration_s=step.model_duration_s,
                    attributes={
                        "model": response.model_name,
                        "finish_reason": response.finish_reason,
                        "input_tokens": response.usage.input_tokens,
                        "output_tokens": response.usage.output_tokens,
                        "tool_calls": [call.name for call in response.tool_calls],
                        "text_chars": len(response.text),
                        "reconciled": True,
                    },
                )
            for r in step.tool_calls:
                if r.denied or r.idempotency_key in calls:
                    continue  # a denial is a policy decision, recorded when it was made
                if r.error_type == "OutcomeUnknown":
                    self._tool_call(run_id, step.index, r, outcome="unknown", reconciled=True)
                else:
                    self._tool_call(run_id, step.index, r, reconciled=True)
        log.flush()
