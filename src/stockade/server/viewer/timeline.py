"""A run's audit events as the viewer's timeline: one ``Entry`` per event a reader follows
(model calls, tool calls joined to their ledger rows, denials, approvals, retries, kills,
anomalies, judged execs, limits, breakers, checks), grouped by step. A function of values
(events, ledger rows, the model's words), apart from the stores they are read from, so the
timeline is built and tested without one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime

from stockade.agent.state import ToolCallRecord
from stockade.audit.events import AuditEvent, EventKind
from stockade.server.viewer.values import Entry, Step

__all__ = ["cut", "timeline"]

OBSERVATION_CHARS = 20_000  # of one tool call's observation, on the page


def _ms(seconds: float | None) -> str | None:
    return None if seconds is None else f"{seconds * 1000:,.0f} ms"


def _when(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%H:%M:%S.%f")[:-3]


def _pretty(value: object) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


def cut(text: str, limit: int = OBSERVATION_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n… [{len(text) - limit} more characters]"


def _str(value: object) -> str:
    return "" if value is None else str(value)


def _tool_entry(event: AuditEvent, records: dict[str, ToolCallRecord]) -> Entry:
    a = event.attributes
    record = records.get(_str(a.get("idempotency_key"))) or records.get(_str(a.get("call_id")))
    facts = [f for f in (_ms(event.duration_s),) if f]
    code = record.exit_code if record is not None else None
    if code is not None:
        facts.insert(0, f"exit {code}")
    if a.get("error_type"):
        facts.append(_str(a.get("error_type")))
    if a.get("outcome") == "unknown":
        facts.append("outcome unknown (cut by a crash)")
    if a.get("reconciled"):
        facts.append("recorded on resume")
    observation = record.observation if record is not None else None
    if observation is None and a.get("observation_chars"):
        observation = f"({a.get('observation_chars')} characters, not in the run store)"
    return Entry(
        seq=event.seq,
        kind="tool",
        title=_str(a.get("tool")) or "tool call",
        when=_when(event.timestamp_ns),
        facts=tuple(facts),
        args=_pretty(a.get("args", {})),
        text=cut(observation) if observation else None,
        failed=bool(a.get("is_error")),
    )


def _entry(event: AuditEvent, records: dict[str, ToolCallRecord], texts: dict[int, str]) -> Entry | None:  # noqa: C901 - a branch per kind of event
    a, kind, when, seq = event.attributes, event.kind, _when(event.timestamp_ns), event.seq
    match kind:
        case EventKind.MODEL_CALL:
            calls = a.get("tool_calls")
            asked = ", ".join(str(c) for c in calls) if isinstance(calls, list) and calls else "final answer"
            facts: tuple[str, ...] = (
                _ms(event.duration_s) or "",
                f"{a.get('input_tokens', 0)} in / {a.get('output_tokens', 0)} out tokens",
                f"→ {asked}",
            )
            return Entry(
                seq=seq,
                kind="model",
                title=f"model call ({_str(a.get('model'))})",
                when=when,
                facts=facts,
                text=texts.get(event.step) or None,
            )
        case EventKind.TOOL_CALL:
            return _tool_entry(event, records)
        case EventKind.POLICY_DECISION:
            decision = _str(a.get("decision"))
            what = _str(a.get("tool") or a.get("action") or a.get("model") or a.get("level"))
            return Entry(
                seq=seq,
                kind="denial" if decision == "deny" else "note",
                when=when,
                title=f"{'denied' if decision == 'deny' else decision or 'policy'}: {what}",
                facts=tuple(
                    f
                    for f in (f"rule {_str(a.get('rule'))}" if a.get("rule") else "", _str(a.get("level")))
                    if f
                ),
                args=_pretty(a["args"]) if "args" in a else None,
                text=_str(a.get("reason")) or None,
                failed=decision == "deny",
            )
        case EventKind.APPROVAL:
            outcome = _str(a.get("outcome"))
            title = {"pending": "waits for approval", "approved": "approved", "denied": "denied"}.get(
                outcome, outcome
            )
            action = _str(a.get("action"))
            facts = tuple(
                f
                for f in (
                    f"by {event.actor}" if outcome != "pending" else "",
                    f"rule {a.get('rule')}" if a.get("rule") else "",
                    f"through {a.get('through')}" if a.get("through") else "",
                )
                if f
            )
            return Entry(
                seq=seq,
                kind="approval",
                title=f"{title}: {action}" if action else title,
                when=when,
                facts=facts,
                text=_str(a.get("reason")) or None,
                failed=outcome == "denied",
            )
        case EventKind.RETRY:
            if a.get("flaky"):
                text = f"exit {a.get('first_exit_code')} then {a.get('second_exit_code')}"
                return Entry(
                    seq=seq,
                    kind="retry",
                    title=f"flaky, run again: {_str(a.get('subject'))}",
                    when=when,
                    text=text,
                )
            return Entry(
                seq=seq,
                kind="retry",
                title=f"retry {a.get('attempt')}: {_str(a.get('subject'))}",
                when=when,
                facts=(f"after {float(str(a.get('delay_s') or 0)):.2f} s",),
                text=_str(a.get("reason")) or None,
            )
        case EventKind.KILL_SWITCH:
            verb = "interrupted" if a.get("interrupted") else "killed"
            return Entry(
                seq=seq,
                kind="kill",
                title=verb,
                when=when,
                text=_str(a.get("reason")) or None,
                facts=(f"by {event.actor}",),
                failed=True,
            )
        case EventKind.ANOMALY:
            return Entry(
                seq=seq,
                kind="anomaly",
                title=f"anomaly: {_str(a.get('rule'))}",
                when=when,
                facts=(f"action {_str(a.get('action'))}",),
                text=_str(a.get("detail")) or None,
                failed=True,
            )
        case EventKind.EXEC:
            argv = a.get("argv")
            words = " ".join(str(w) for w in argv) if isinstance(argv, list) else _str(argv)
            verdict = _str(a.get("verdict"))
            return Entry(
                seq=seq,
                kind="exec",
                title=f"exec {verdict}: {words}",
                when=when,
                facts=((f"rule {a.get('rule')}",) if a.get("rule") else ())
                + (("between calls: by what a call left running",) if a.get("between") else ()),
                failed=verdict in ("deny", "refuse"),
            )
        case EventKind.RATE_LIMITED | EventKind.BUDGET:
            # a limit either holds the action until its window allows it or stops the run
            waits = a.get("action") == "wait"
            then = ("waits for its window",) if waits else ("stops the run",) if a.get("action") else ()
            return Entry(
                seq=seq,
                kind="limit",
                title=f"{kind.value.replace('_', ' ')}: {_str(a.get('limit'))}",
                when=when,
                facts=then,
                text=_str(a.get("detail")) or None,
                failed=not waits,
            )
        case EventKind.BREAKER_CHANGE:
            failures = a.get("failures")
            return Entry(
                seq=seq,
                kind="breaker",
                title=f"breaker {_str(a.get('name'))}: {_str(a.get('old'))} → {_str(a.get('new'))}",
                when=when,
                facts=(f"{failures} failures in a row",) if isinstance(failures, int) and failures else (),
                text=_str(a.get("reason")) or None,
                failed=a.get("new") == "open",
            )
        case EventKind.CHECK:
            passed = a.get("passed") is True
            return Entry(
                seq=seq,
                kind="check",
                title=f"check {'passed' if passed else 'failed'}: {_str(a.get('command'))}",
                when=when,
                facts=(f"exit {a.get('exit_code')}", _ms(event.duration_s) or ""),
                text=_str(a.get("summary")) or None,
                failed=not passed,
            )
        case EventKind.RUN_START:
            return Entry(
                seq=seq,
                kind="run",
                title="run started" + (" (resumed)" if a.get("resumed") else ""),
                when=when,
                text=_str(a.get("task")) or None,
            )
        case EventKind.RUN_END:
            return Entry(
                seq=seq,
                kind="run",
                title=f"run ended: {_str(a.get('status'))}",
                when=when,
                text=_str(a.get("error")) or None,
                failed=a.get("status") != "success",
            )
        case EventKind.SANDBOX_START | EventKind.SANDBOX_STOP:
            verb = "started" if kind == EventKind.SANDBOX_START else "stopped"
            tier = _str(a.get("tier"))
            return Entry(
                seq=seq, kind="sandbox", title=f"sandbox {verb}" + (f" ({tier})" if tier else ""), when=when
            )
        case EventKind.RUN_CRASH | EventKind.ERROR | EventKind.NOTE:
            detail = _str(a.get("detail") or a.get("error") or a.get("message"))
            return Entry(
                seq=seq,
                kind="note",
                title=kind.value.replace("_", " "),
                when=when,
                text=detail or None,
                failed=kind != EventKind.NOTE,
            )
        case _:
            # commands, code, file writes: the sandbox ops under a tool call, which the call shows
            return None


def timeline(
    events: Iterable[AuditEvent],
    records: Sequence[ToolCallRecord] = (),
    texts: dict[int, str] | None = None,
    *,
    step: int = 0,
) -> tuple[tuple[Step, ...], int]:
    """The run's audit events as steps of entries (in the trail's order), and the last seq.
    ``records`` (the run store's ledger) give each call its observation and exit code;
    ``texts`` the model's words at each step; ``step``: the step of the events just before
    these (a window of the trail)."""
    by_key: dict[str, ToolCallRecord] = {}
    for record in records:
        by_key[record.idempotency_key] = record
        by_key.setdefault(record.call.id, record)
    steps: list[Step] = []
    last = 0
    for event in events:
        last = max(last, event.seq)
        entry = _entry(event, by_key, texts or {})
        if entry is None:
            continue
        # events outside any step (approvals, a pause, a resume, the end) go with the step they
        # happened in: the one before them
        index = event.step or (steps[-1].index if steps else step)
        if steps and steps[-1].index == index:
            steps[-1] = Step(index=index, entries=(*steps[-1].entries, entry))
        else:
            steps.append(Step(index=index, entries=(entry,)))
    return tuple(steps), last
