"""``AuditObserver``: the agent loop's events, recorded into the audit trail.

    agent = Agent(model, tools, observers=[AuditObserver(log)])

One event per moment that matters: ``run_start``, ``model_call`` (when the response
arrives, with usage and the tool calls asked for), ``policy_decision`` (a denied call),
``tool_call_start`` (before a call runs, one per attempt: tool, call id, idempotency key,
the arguments' size and SHA-256), ``tool_call`` (when it returns: arguments, idempotency key,
error, duration, sizes; also a call rejected as invalid), ``check`` (the acceptance check:
command, passed, exit code), ``step`` and ``run_end``. Arguments and text pass through the
log's redactor like any event.

A crash loses no call for good: events wait up to ``flush_interval_s`` in the log's buffer,
which dies with the process, so when a run resumes (``RunResumed``) this observer compares
the run's trail with what the run recorded (every step's model call, every call in its
ledger) and records what is missing, marked ``"reconciled": true`` (its time is the resume's;
``recorded_ns`` in the run store is the original). A run whose process died gets a
``run_crash`` event first; a call that started and did not return, and was not run again, is
a ``tool_call`` with ``"outcome": "unknown"``. What no resume brings back is what the sandbox
did during a call cut by the death (its ``run_code`` or ``command`` event, the execs judged
inside): the ``tool_call_start`` and ``op_start`` written before it say what was in flight.

What a resumed run's trail holds once. The trail can be ahead of the run's checkpoints: a
batch written, then the process killed before the checkpoint after it. The resume then does
again what the trail already has, so this observer keeps the run's keys that it read from
the trail on resume, and:

- a ``tool_call`` is recorded once per idempotency key (a call rejected as invalid again, or
  put back by the reconciliation, is not recorded a second time);
- the ``run_end`` that ends a run for good is recorded once: a resumed end that says what the
  trail's says (status, steps, answer) is left out; one that says otherwise (the repeated
  final request answered differently) is recorded with ``"repeat": true``, the later one
  being the run's end (a paused, interrupted or broken run's ``run_end`` is one per stop);
- a model request the resume sent again (the trail has that step's ``model_call``) was sent
  twice, and cost twice: its ``model_call`` and ``step`` are recorded with ``"repeat": true``.

``verify(..., ledger=)`` reports a second ``tool_call`` of a key, or a second final
``run_end`` not marked as a repeat, as ``duplicate_in_trail``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import JsonValue

from stockade._cuts import plain
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
from stockade.agent.state import RunStatus, ToolCallRecord, args_measure
from stockade.audit.events import STORED, EventKind, JSONValue
from stockade.audit.log import AuditLog
from stockade.audit.redact import Redactor, ShellText
from stockade.audit.sandbox_texts import program_text
from stockade.policy.agent import COMMAND_TOOLS

__all__ = ["AuditObserver"]

# Task text and answers are cut here (after redaction); the run store keeps them whole.
TEXT_CAP = 4096


# A call's arguments are kept whole up to this many characters (as JSON); past it each of the
# first ARGS_KEYS arguments is cut to its share and the event adds their size and SHA-256
# (``args_bytes``, ``args_digest``, over ``args_json``), which prove what was asked. The run
# store keeps them whole (a resumed run sends the conversation again), up to the loop's
# MAX_CALL_ARGS_BYTES: a larger call is refused and its arguments are kept nowhere.
ARGS_CAP = 4096
ARGS_KEYS = 16


def _plain(value: JsonValue) -> JsonValue:
    """An argument with each cut mark typed into its text made plain (``plain``): what the model
    asked, which nobody cut, is never redacted as a cut text (the word after a mark hidden)."""
    if isinstance(value, str):
        return plain(value)
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {plain(key): _plain(item) for key, item in value.items()}
    return value


def _args(tool: str, asked: Mapping[str, JsonValue], redactor: Redactor) -> dict[str, JSONValue]:
    """The attributes that record a call's arguments: ``args``, cut past ``ARGS_CAP`` (what is
    cut is redacted first; the size and digest are of the arguments as asked). A command
    tool's ``command`` is a shell's script (``ShellText``): redacted word by word; run_code's
    ``code`` is its language's (``program_text``)."""
    size, digest = args_measure(asked)
    args = {plain(key): _plain(value) for key, value in asked.items()}
    command, code, language = args.get("command"), args.get("code"), args.get("language")
    if tool in COMMAND_TOOLS and isinstance(command, str):
        args["command"] = ShellText(command)
    if tool == "run_code" and isinstance(code, str):
        args["code"] = program_text(language if isinstance(language, str) else "python", code)
    if size <= ARGS_CAP:
        return {"args": args}
    share = ARGS_CAP // max(min(len(args), ARGS_KEYS), 1)
    kept: dict[str, JSONValue] = {}
    for key, value in list(redactor.attributes(args).items())[:ARGS_KEYS]:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        kept[redactor.cut(key, 128)] = value if len(text) <= share else redactor.cut(text, share)
    if len(args) > ARGS_KEYS:
        kept["…"] = f"{len(args) - ARGS_KEYS} more arguments"
    return {"args": kept, "args_bytes": size, "args_digest": digest, "args_cut": True}


@dataclass
class _InTrail:
    """What a resumed run's trail already holds: its keys, read on resume."""

    calls: set[str] = field(default_factory=set)  # idempotency keys of its tool_call events
    models: set[int] = field(default_factory=set)  # steps with a model_call
    steps: set[int] = field(default_factory=set)  # steps with a step event
    end: tuple[JSONValue, ...] | None = None  # what its run_end says, if it has one


def _end_says(attributes: dict[str, JSONValue]) -> tuple[JSONValue, ...]:
    return attributes.get("status"), attributes.get("steps"), attributes.get("answer")


def _ended(status: JSONValue) -> bool:
    """Whether a ``run_end`` says the run ended for good (a paused run's says it stopped for now:
    each time it stops is an event of its own)."""
    return isinstance(status, str) and status in _FINISHED


_FINISHED = frozenset(s.value for s in RunStatus if s.finished)


class AuditObserver:
    """An agent observer (``observer(event) -> None``) that writes to ``log``."""

    def __init__(self, log: AuditLog, *, actor: str = "agent", stored: bool = False) -> None:
        self.log = log
        self.actor = actor
        self.stored = stored  # a run store records the runs: their run_start says so
        self._in_trail: dict[str, _InTrail] = {}  # resumed runs in progress

    def _cap(self, text: str) -> str:
        return self.log.redactor.cut(text, TEXT_CAP)

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
                        "task": self._cap(event.task),
                        "model": event.model_name,
                        "resumed": event.resumed,
                        **({STORED: True} if self.stored else {}),
                    },
                )
            case ModelRequested():
                self.log.check()  # recorded once, with its outcome; not asked while it cannot be
            case ModelResponded():
                response = event.response
                seen = self._in_trail.get(event.run_id)
                repeat: dict[str, JSONValue] = (
                    {"repeat": True} if seen is not None and event.step in seen.models else {}
                )
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
                        **repeat,
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
                self.log.check()  # not made while the trail cannot be written
                self._started(event)
            case ToolDenied():
                record(
                    EventKind.POLICY_DECISION,
                    run_id=event.run_id,
                    step=event.step,
                    actor="policy",
                    attributes={
                        "decision": "deny",
                        "rule": event.rule,
                        "reason": self._cap(event.reason),
                        "tool": event.call.name,
                        "call_id": event.call.id,
                        **_args(event.call.name, event.call.args, self.log.redactor),
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
                        "command": self._cap(ShellText(c.command)),  # what the shell ran
                        "passed": c.passed,
                        "exit_code": c.exit_code,
                        "timed_out": c.timed_out,
                        "summary": self._cap(c.summary),
                    },
                )
            case StepFinished():
                seen = self._in_trail.get(event.run_id)
                again = seen is not None and event.step.index in seen.steps
                record(
                    EventKind.STEP,
                    run_id=event.run_id,
                    step=event.step.index,
                    actor=self.actor,
                    attributes={
                        "tool_calls": len(event.step.tool_calls),
                        **({"repeat": True} if again else {}),
                    },
                )
            case RunFinished():
                self._run_end(event)

    def _started(self, event: ToolCalled) -> None:
        """Before the call runs: a process killed during it leaves this in the trail (once the
        log's next batch is written), where its ``tool_call`` never comes. The arguments by
        size and SHA-256: their text is in the run store's checkpoint and comes with the
        ``tool_call`` (or a resume's reconciled one); the log redacts every text it records,
        about half a microsecond a character, and this is paid on every call."""
        size, digest = args_measure(event.call.args)
        self.log.record(
            EventKind.TOOL_CALL_START,
            run_id=event.run_id,
            step=event.step,
            actor=self.actor,
            attributes={
                "tool": event.call.name,
                "call_id": event.call.id,
                "idempotency_key": event.idempotency_key,
                "idempotent": event.tool.idempotent,
                "args_bytes": size,
                "args_digest": digest,
            },
        )

    def _run_end(self, event: RunFinished) -> None:
        result, seen = event.result, self._in_trail.pop(event.run_id, None)
        attributes: dict[str, JSONValue] = {
            "status": str(result.status),
            "steps": len(result.steps),
            "input_tokens": result.usage.input_tokens,
            "output_tokens": result.usage.output_tokens,
            "cost_usd": result.cost_usd,
            "error": None if result.error is None else self._cap(result.error),
            "answer": self._cap(result.answer),
        }
        if seen is not None and seen.end is not None and result.status.finished:
            # The previous process wrote this end and died before the checkpoint saying so.
            if seen.end == _end_says(attributes):
                self.log.flush()
                return
            attributes["repeat"] = True  # the repeated final request ended it otherwise
        self.log.record(EventKind.RUN_END, run_id=event.run_id, actor=self.actor, attributes=attributes)
        self.log.flush()  # the end of a run is a natural durability point

    def _tool_call(self, run_id: str, step: int, r: ToolCallRecord, **extra: JSONValue) -> None:
        seen = self._in_trail.get(run_id)
        if seen is not None:
            if r.idempotency_key in seen.calls:
                return  # done again on resume (a rejection, say): the trail has it already
            seen.calls.add(r.idempotency_key)
        self.log.record(
            EventKind.TOOL_CALL,
            run_id=run_id,
            step=step,
            actor=self.actor,
            duration_s=r.duration_s,
            attributes={
                "tool": r.call.name,
                "call_id": r.call.id,
                **_args(r.call.name, r.call.args, self.log.redactor),
                **({} if r.call.malformed is None else {"malformed": self._cap(r.call.malformed)}),
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
        seen = _InTrail()
        for stored in log.store.events(run_id=run_id):
            if stored.kind == EventKind.MODEL_CALL:
                seen.models.add(stored.step)
            elif stored.kind == EventKind.STEP:
                seen.steps.add(stored.step)
            elif stored.kind == EventKind.TOOL_CALL:
                seen.calls.add(str(stored.attributes.get("idempotency_key", "")))
            elif stored.kind == EventKind.RUN_END and _ended(stored.attributes.get("status")):
                seen.end = _end_says(dict(stored.attributes))
        self._in_trail[run_id] = seen
        steps = [*state.steps, *([state.current] if state.current is not None else [])]
        for step in steps:
            if step.index not in seen.models:
                seen.models.add(step.index)
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
                if r.denied:
                    continue  # a denial is a policy decision, recorded when it was made
                if r.error_type == "OutcomeUnknown":
                    self._tool_call(run_id, step.index, r, outcome="unknown", reconciled=True)
                else:
                    self._tool_call(run_id, step.index, r, reconciled=True)
        log.flush()
