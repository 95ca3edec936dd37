"""What ``stockade runs list`` and ``stockade runs show`` print of recorded runs: a run's
summary, its trace as JSON (``--json``), and its steps as text (each tool call with its
retries and the execs the sandbox judged inside it, the acceptance check, approvals, the
diff). Apart from the commands: it reads values (``RunSummary``, ``RunTrace``) and never the
store, and ``stockade replay`` cuts its outputs the same way.
"""

from __future__ import annotations

import json
import re
import shlex
from datetime import UTC, datetime

from stockade.agent.state import RunState, RunStatus, StepRecord, ToolCallRecord
from stockade.cli._console import CliConsole, escape, print_diff
from stockade.runs.store import RetryEntry, RunSummary, RunTrace

out = CliConsole()

EXECS_SHOWN = 50  # per tool call
_EXIT_CODE = re.compile(r"exit code (-?\d+)")
SHOWN_CHARS = 400


def exit_code(record: ToolCallRecord) -> int | None:
    """The exit code a command or test tool reported (recorded, or in its observation), if any."""
    if record.exit_code is not None:
        return record.exit_code
    match = _EXIT_CODE.search(record.observation[:2000])
    return int(match.group(1)) if match else None


def when(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def summary_json(s: RunSummary) -> dict[str, object]:
    return {
        "run_id": s.run_id,
        "task": s.task,
        "model": s.model_name,
        "status": s.status.value,
        "forged": s.forged,
        "steps": s.steps,
        "input_tokens": s.usage.input_tokens,
        "output_tokens": s.usage.output_tokens,
        "requests": s.usage.requests,
        "cost_usd": s.cost_usd,
        "elapsed_s": s.elapsed_s,
        "error": s.error,
        "created": when(s.created_ns),
        "updated": when(s.updated_ns),
    }


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"… [{len(text) - limit} more chars]"


def _retry_json(r: RetryEntry) -> dict[str, object]:
    return {"subject": r.subject, "attempt": r.attempt, "delay_s": r.delay_s, "reason": r.reason}


def _call_json(trace: RunTrace, step: int, record: ToolCallRecord, limit: int) -> dict[str, object]:
    return {
        "tool": record.call.name,
        "call_id": record.call.id,
        "args": record.call.args,
        "idempotency_key": record.idempotency_key,
        "exit_code": exit_code(record),
        "duration_s": record.duration_s,
        "is_error": record.is_error,
        "error_type": record.error_type,
        "denied": record.denied,
        "observation": cut(record.observation, limit),
        "cut_chars": record.cut_chars,
        "retries": [_retry_json(r) for r in trace.retries_of(step, record.call.id)],
    }


def _steps(trace: RunTrace) -> list[StepRecord]:
    state = trace.state
    return [*state.steps, *([state.current] if state.current is not None else [])]


def trace_json(trace: RunTrace, *, limit: int = SHOWN_CHARS) -> dict[str, object]:
    state = trace.state
    return {
        **summary_json(trace.summary),
        "answer": state.answer,
        "steps": [
            {
                "index": step.index,
                "model_duration_s": step.model_duration_s,
                "input_tokens": step.response.usage.input_tokens,
                "output_tokens": step.response.usage.output_tokens,
                "text": step.response.text,
                "tool_calls": [_call_json(trace, step.index, r, limit) for r in step.tool_calls],
                "retries": [
                    _retry_json(r) for r in trace.retries if r.step == step.index and r.call_id is None
                ],
            }
            for step in _steps(trace)
        ],
        "checks": [
            {
                "step": c.step,
                "command": c.command,
                "passed": c.passed,
                "exit_code": c.exit_code,
                "summary": c.summary,
                "duration_s": c.duration_s,
            }
            for c in state.checks
        ],
        "approvals": [
            {
                "step": a.step,
                "request_id": a.request_id,
                "action": a.action,
                "rule": a.rule,
                "decision": a.decision,
            }
            for a in trace.approvals
        ],
        "diff": trace.diff,
    }


Execs = dict[str, list[dict[str, object]]]  # by tool call id


def _print_call(trace: RunTrace, step: int, record: ToolCallRecord, limit: int, execs: Execs) -> None:
    mark = "[yellow]denied[/]" if record.denied else "[red]✗[/]" if record.is_error else "[green]✓[/]"
    args = json.dumps(record.call.args, ensure_ascii=False)
    code = exit_code(record)
    facts = [f"{record.duration_s * 1000:.0f} ms"]
    if code is not None:
        facts.insert(0, f"exit {code}")
    if record.error_type:
        facts.append(record.error_type)
    # the tool name and call id are the model's: `[link=...]` drew a link, `[/x]` raised MarkupError
    out.print(f"  {mark} {escape(record.call.name)}({escape(cut(args, 160))})  {escape(', '.join(facts))}")
    for retry in trace.retries_of(step, record.call.id):
        out.print(
            f"      [yellow]↻ retry {retry.attempt}[/] {escape(retry.subject)} after "
            f"{retry.delay_s:.2f} s: {escape(retry.reason)}"
        )
    _print_execs(execs.get(record.call.id, []))
    shown = cut(record.observation, limit)
    out.print(
        "      " + escape(shown).replace("\n", "\n      "),
        style="dim",
        highlight=False,
        soft_wrap=True,
    )


def _print_execs(judged_all: list[dict[str, object]]) -> None:
    """What a call's code ran, judged inside, and what ran after it while no call did (what
    it left running: ``between``): every exec the rules stopped or asked about, and the first
    of those they let run (a loop of `true` must not push a `deny` out of sight)."""
    room = max(0, EXECS_SHOWN - sum(1 for j in judged_all if j.get("verdict") != "allow"))
    shown_execs = []
    for judged in judged_all:
        if judged.get("verdict") == "allow":
            if not room:
                continue
            room -= 1
        shown_execs.append(judged)
    for judged in shown_execs:
        if judged.get("verdict") == "omitted":
            count = escape(str(judged.get("count")))
            out.print(f"      [yellow]… {count} more execs, past what a report keeps[/]")
            continue
        argv = judged.get("argv")
        words = shlex.join(str(a) for a in argv) if isinstance(argv, list) else ""
        verdict = str(judged.get("verdict"))
        colour = {"allow": "dim", "approve": "green", "deny": "red", "refuse": "red"}.get(verdict, "")
        rule = f" ({judged.get('rule')})" if judged.get("rule") else ""
        words = escape(cut(words, 160), one_line=True)
        after = " [yellow](after the call, by what it left running)[/]" if judged.get("between") else ""
        out.print(f"      [{colour}]exec {escape(verdict)}[/] {words}{escape(rule, one_line=True)}{after}")
    if len(shown_execs) < len(judged_all):
        hidden = len(judged_all) - len(shown_execs)
        out.print(f"      [dim]… {hidden} more execs it let run (--json lists them)[/]")


def _print_checks(state: RunState, execs: Execs) -> None:
    """The execs no tool call ran, the acceptance check's runs, and the execs its command ran."""
    from stockade.audit.sandbox import CHECK_CALL

    if execs.get(""):  # judged while no call ran (before the first command or run_code)
        out.print("\n[bold]execs outside any tool call[/]")
        _print_execs(execs[""])
    for check in state.checks:
        verdict = "[green]passed[/]" if check.passed else "[red]failed[/]"
        out.print(
            f"\n[bold]check[/] after step {check.step}: {escape(check.command)} {verdict}  "
            f"[dim]{escape(check.summary)}[/]"
        )
    if execs.get(CHECK_CALL):  # what the acceptance check's command ran, every time it ran
        out.print("\n[bold]execs of the acceptance check[/]")
        _print_execs(execs[CHECK_CALL])


def print_trace(trace: RunTrace, limit: int, execs: Execs | None = None) -> None:
    s, state = trace.summary, trace.state
    colour = "green" if s.status == RunStatus.SUCCESS else "red"
    out.print(f"[bold]run {escape(s.run_id)}[/] with {escape(s.model_name)}  [{colour}]{s.status.value}[/]")
    out.print(f"[bold]task:[/] {escape(state.task)}")
    out.print(
        f"{s.steps} steps, {s.usage.input_tokens} in / {s.usage.output_tokens} out tokens, "
        f"${s.cost_usd:.4f}, {s.elapsed_s:.1f} s"
    )
    for step in _steps(trace):
        usage = step.response.usage
        out.print(
            f"\n[cyan]step {step.index}[/] model {step.model_duration_s * 1000:.0f} ms, "
            f"{usage.input_tokens}/{usage.output_tokens} tokens"
        )
        for retry in (r for r in trace.retries if r.step == step.index and r.call_id is None):
            out.print(
                f"  [yellow]↻ retry[/] {escape(retry.subject)} in {retry.delay_s:.2f} s: "
                f"{escape(retry.reason)}"
            )
        if step.response.text:
            out.print(f"  [dim]{escape(cut(step.response.text, limit))}[/]")
        for record in step.tool_calls:
            _print_call(trace, step.index, record, limit, execs or {})
    _print_checks(state, execs or {})
    for approval in trace.approvals:
        out.print(
            f"\n[magenta]approval[/] step {approval.step}: {escape(approval.action)} → "
            f"{escape(approval.decision)}"
        )
    if state.error:
        label = {RunStatus.KILLED: "killed", RunStatus.BROKEN: "broken"}.get(s.status, "")
        if "incident: anomaly rule" in state.error:
            label = "incident"
        out.print(f"\n[bold red]{label}[/]: " if label else "\n", end="")
        out.print(f"[red]{escape(state.error)}[/]")
    if state.answer:
        out.print(f"\n[bold]answer:[/] {escape(state.answer)}")
    if trace.diff:
        print_diff(out, trace.diff)
    elif trace.diff is not None:
        out.print("[dim](the workspace is unchanged)[/]")
