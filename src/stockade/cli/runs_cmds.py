"""``stockade runs list | show | workspace | erase`` and ``stockade replay``: read and re-run
recorded agent runs, take out the workspace a run left (a run an anomaly rule killed, for
review), and erase runs (a data subject's, or those older than the retention period).

The store is ``--db`` (or ``STOCKADE_RUNS_DB``, else ``STOCKADE_AUDIT_DB``): by default the
run tables live in the audit database file. A run id may be given by a unique prefix, in its
case, to the commands that read; ``erase`` takes whole ids (it never guesses).
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from stockade import exceptions as exc
from stockade._config_file import audit_key
from stockade._state import sqlite_path
from stockade.agent.state import RunState, RunStatus, StepRecord, ToolCallRecord
from stockade.cli._console import CliConsole, escape, print_diff, print_json
from stockade.cli._numbers import checked
from stockade.cli._signals import Interrupted, closed_whole, interruptible
from stockade.cli._signals import exit_code as signal_exit_code
from stockade.cli.agent_cmds import STATE_DIR
from stockade.policy.approval import ApprovalRequest, Choice
from stockade.runs.store import RetryEntry, RunSetup, RunStore, RunSummary, RunTrace, open_run_store
from stockade.sandbox import _registry
from stockade.tools.base import Toolset
from stockade.types import Trust

if TYPE_CHECKING:
    from stockade.runs.replay import ReplayReport

out = CliConsole()
err = CliConsole(stderr=True)

DEFAULT_DB = "sqlite:///.stockade/audit.db"
EXECS_SHOWN = 50  # per tool call

DbOpt = Annotated[
    str,
    typer.Option(
        "--db",
        envvar=["STOCKADE_RUNS_DB", "STOCKADE_AUDIT_DB"],
        help="sqlite:///PATH, a file path, or postgresql://...",
    ),
]
NamespaceOpt = Annotated[str, typer.Option("--namespace", help="table prefix of the run store")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]

_EXIT_CODE = re.compile(r"exit code (-?\d+)")
SHOWN_CHARS = 400


def _store(db: str, namespace: str, *, read_only: bool) -> RunStore:
    """The run store; ``read_only`` for the commands that only read it (they change nothing).
    With the audit key (``STOCKADE_AUDIT_KEY``, as `stockade audit`), rows edited outside
    stockade are told apart: shown ``forged`` in a list, refused when one run is read."""
    path = sqlite_path(db)
    if path is not None and not path.exists():
        err.print(f"[red]no run store at {escape(str(path))}[/] (set --db or STOCKADE_RUNS_DB)")
        raise typer.Exit(2)
    try:
        return open_run_store(db, namespace=namespace, key=_audit_key(), read_only=read_only)
    except exc.StockadeError as error:
        err.print(f"[red]{escape(str(error))}[/]")
        raise typer.Exit(2) from error


def _audit_key() -> bytes | None:
    return audit_key()  # as `stockade audit`


def _resolve(store: RunStore, run_id: str) -> str:
    matches = store.find(run_id)
    if run_id in matches:
        return run_id
    if len(matches) == 1:
        return matches[0]
    err.print(
        f"[red]no run {escape(run_id)!r}[/]"
        if not matches
        else f"[red]{escape(run_id)!r} names several runs:[/] {escape(', '.join(matches))}"
    )
    raise typer.Exit(2)


def exit_code(record: ToolCallRecord) -> int | None:
    """The exit code a command or test tool reported (recorded, or in its observation), if any."""
    if record.exit_code is not None:
        return record.exit_code
    match = _EXIT_CODE.search(record.observation[:2000])
    return int(match.group(1)) if match else None


def _when(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def _summary_json(s: RunSummary) -> dict[str, object]:
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
        "created": _when(s.created_ns),
        "updated": _when(s.updated_ns),
    }


def list_runs(
    *,
    db: DbOpt = DEFAULT_DB,
    namespace: NamespaceOpt = "runs",
    limit: Annotated[
        int, typer.Option("-n", "--limit", min=1, max=1_000_000, help="how many runs, newest first")
    ] = 20,
    status: Annotated[RunStatus | None, typer.Option("--status", help="only runs that ended so")] = None,
    as_json: JsonOpt = False,
) -> None:
    """The latest runs: id, status, steps, tokens, cost and task."""
    with _store(db, namespace, read_only=True) as store:
        runs = store.runs(limit=limit, status=status)
    if as_json:
        print_json([_summary_json(s) for s in runs])
        return
    table = Table("run", "updated", "status", "steps", "tokens", "cost", "task", box=None)
    for s in runs:
        colour = "green" if s.status == RunStatus.SUCCESS else "yellow" if not s.status.finished else "red"
        table.add_row(
            s.run_id[:12],
            _when(s.updated_ns),
            f"[{colour}]{s.status.value}[/]" if not s.forged else "[red]forged[/]",
            str(s.steps),
            str(s.usage.total_tokens),
            f"${s.cost_usd:.4f}",
            escape(s.task.splitlines()[0][:60] if s.task else ""),
        )
    out.print(table)


def _cut(text: str, limit: int) -> str:
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
        "observation": _cut(record.observation, limit),
        "cut_chars": record.cut_chars,
        "retries": [_retry_json(r) for r in trace.retries_of(step, record.call.id)],
    }


def _steps(trace: RunTrace) -> list[StepRecord]:
    state = trace.state
    return [*state.steps, *([state.current] if state.current is not None else [])]


def trace_json(trace: RunTrace, *, limit: int = SHOWN_CHARS) -> dict[str, object]:
    state = trace.state
    return {
        **_summary_json(trace.summary),
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
    out.print(f"  {mark} {escape(record.call.name)}({escape(_cut(args, 160))})  {escape(', '.join(facts))}")
    for retry in trace.retries_of(step, record.call.id):
        out.print(
            f"      [yellow]↻ retry {retry.attempt}[/] {escape(retry.subject)} after "
            f"{retry.delay_s:.2f} s: {escape(retry.reason)}"
        )
    _print_execs(execs.get(record.call.id, []))
    shown = _cut(record.observation, limit)
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
        words = escape(_cut(words, 160), one_line=True)
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


def _print_trace(trace: RunTrace, limit: int, execs: Execs | None = None) -> None:
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
            out.print(f"  [dim]{escape(_cut(step.response.text, limit))}[/]")
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


def show(
    run_id: Annotated[str, typer.Argument(help="a run id, or a unique prefix of one (in its case)")],
    *,
    db: DbOpt = DEFAULT_DB,
    namespace: NamespaceOpt = "runs",
    chars: Annotated[int, typer.Option("--chars", help="characters of each output shown")] = SHOWN_CHARS,
    as_json: JsonOpt = False,
) -> None:
    """Each step of a run: tool, arguments, exit code, duration, retries and output; then the diff."""
    with _store(db, namespace, read_only=True) as store:
        try:
            trace = store.trace(_resolve(store, run_id))
        except exc.StockadeError as error:  # a row edited outside stockade (with the key)
            err.print(f"[red]{escape(str(error))}[/]")
            raise typer.Exit(2) from error
    if trace is None:
        err.print(f"[red]run {escape(run_id)} has no checkpoint[/]")
        raise typer.Exit(2)
    execs = _execs_by_call(db, trace.summary.run_id)
    if as_json:
        shown = trace_json(trace, limit=chars)
        shown["execs"] = execs  # by tool call id: what the sandbox's rules judged inside
        print_json(shown)
    else:
        _print_trace(trace, chars, execs)


def _execs_by_call(db: str, run_id: str) -> Execs:
    """The execs the sandbox judged during the run (audit ``exec`` events, when the audit trail
    shares the run store's database), by the tool call whose code started them."""
    from stockade.audit.events import EventKind
    from stockade.audit.stores import open_store

    found: Execs = {}
    try:
        store = open_store(db, read_only=True)  # a reader: never create the tables it lacks
    except Exception:  # no audit trail there: nothing to show
        return found
    try:
        for event in store.events(run_id=run_id):
            if event.kind == EventKind.EXEC:
                call = str(event.attributes.get("call_id") or "")
                found.setdefault(call, []).append(dict(event.attributes))
    except Exception:  # a database without audit tables
        return {}
    finally:
        store.close()
    return found


def replay(
    run_id: Annotated[str, typer.Argument(help="a run id, or a unique prefix of one (in its case)")],
    *,
    workspace: Annotated[
        Path | None,
        typer.Option(
            "--workspace", "-w", help="the folder to start from (default: the one the run store kept)"
        ),
    ] = None,
    tier: Annotated[
        str | None,
        typer.Option("--tier", "-t", help=f"{_registry.NAMES} (default: the run's; never a weaker one)"),
    ] = None,
    policy: Annotated[
        Path | None,
        typer.Option(
            "--policy",
            "-p",
            help="for a run the store kept no policy of: the policy to replay it under (default: the "
            "defaults, trust untrusted)",
        ),
    ] = None,
    role: Annotated[
        str | None, typer.Option("--role", help="with --policy: the policy role to replay under")
    ] = None,
    trust: Annotated[
        Trust | None, typer.Option("--trust", help="tightens the run's trust level (never loosens it)")
    ] = None,
    tools: Annotated[
        list[str] | None,
        typer.Option(
            "--tools",
            help="MODULE:ATTR, the run's own tools (a Tool, a list of them or a Toolset), added to the "
            "built-in ones; repeat it for several",
        ),
    ] = None,
    db: DbOpt = DEFAULT_DB,
    audit_db: Annotated[
        str | None,
        typer.Option(
            "--audit-db", envvar="STOCKADE_AUDIT_DB", help="where the replay is audited (default: --db)"
        ),
    ] = None,
    namespace: NamespaceOpt = "runs",
    as_json: JsonOpt = False,
) -> None:
    """Run a recorded run again with its recorded model responses in a fresh sandbox, under the
    policy, role and tier the run had (kept by the run store), audited under a replay id of its
    own, its acceptance check run again; exit 1 when an observation (of a call or of the check)
    differs from the recorded one (flaky tests, time-dependent commands), or the replay ends
    otherwise than the run did. An action that needs approval is asked on the terminal, and
    refused without one."""
    from stockade.assembly import build_agent
    from stockade.runs.replay import check_unkept, policy_file_changed, replay_config
    from stockade.runs.replay import replay as replay_run

    audit = audit_db or db
    with (
        tempfile.TemporaryDirectory(prefix="stockade-replay-") as scratch,
        _store(db, namespace, read_only=True) as store,  # only read: a replay records no run
    ):
        try:
            toolset = load_tools(tools) if tools else None
            state = store.load(_resolve(store, run_id))
            if state is None:
                err.print(f"[red]run {escape(run_id)} has no checkpoint[/]")
                raise typer.Exit(2)
            setup = store.setup(state.run_id)
            if setup is None:
                setup = _unkept_setup(state.run_id, policy, role, trust)
            elif policy is not None or role is not None:
                raise exc.InvalidArgument(
                    f"run {state.run_id} keeps the policy and role it ran under, and is replayed under them",
                    argument="--policy" if policy is not None else "--role",
                    fix="leave out --policy and --role (--trust can still tighten the run's trust)",
                )
            for note in (policy_file_changed(setup), check_unkept(state, setup)):
                if note is not None:
                    err.print(f"[yellow]{escape(note)}[/]")
            if workspace is None:
                seed = Path(scratch) / "seed"
                if store.restore_seed(state.run_id, seed):
                    workspace = seed
                else:
                    err.print(
                        "[yellow]the run store kept no starting workspace for this run: replaying in an "
                        "empty one (give the folder with --workspace)[/]"
                    )
            config = replay_config(
                state,
                setup,
                tier=tier,
                trust=trust,
                tools=toolset,
                audit=audit if "://" in audit else f"sqlite:///{audit}",
                audit_key=_audit_key(),
                approver=_ask_or_deny,
                approval_dir=Path(scratch) / "approvals",  # the decisions are in the audit trail
            )
            with interruptible(), closed_whole(build_agent(config)) as agent:
                err.print(
                    f"[dim]replaying run {escape(state.run_id)} on the {agent.tier} tier "
                    f"({escape(agent.tier_reason)}), audited in {escape(audit)}[/]"
                )
                report = asyncio.run(replay_run(state, agent=agent, workspace=workspace))
        except exc.StockadeError as error:
            err.print(f"[red]error:[/] {escape(str(error))}")
            raise typer.Exit(2) from None
        except Interrupted as stop:
            err.print(f"[yellow]stopped by {stop}; the sandbox was removed[/]")
            raise typer.Exit(signal_exit_code(stop.signum)) from None
    if as_json:
        print_json(
            {
                "run_id": report.run_id,
                "replay_id": report.replay_id,
                "tier": report.tier,
                "ok": report.ok,
                "recorded_status": report.recorded_status.value,
                "replayed_status": report.replayed_status.value,
                "status_differs": report.status_differs,
                "compared": report.compared,
                "differences": [
                    {
                        "step": d.step,
                        "call_id": d.call_id,
                        "tool": d.tool,
                        "what": d.what,
                        "recorded": d.recorded,
                        "replayed": d.replayed,
                    }
                    for d in report.differences
                ],
            },
        )
    else:
        _print_replay(report)
    raise typer.Exit(0 if report.ok else 1)


def _print_replay(report: ReplayReport) -> None:
    out.print(
        f"replayed {report.compared} tool calls of run {escape(report.run_id)} as "
        f"{escape(report.replay_id)} on the {report.tier} tier: "
        f"recorded {report.recorded_status.value}, replayed {report.replayed_status.value}"
    )
    if report.ok:
        out.print("[green]every observation matches the record[/]")
    if report.status_differs:
        out.print(
            f"[red]the run ended {report.recorded_status.value}, the replay {report.replayed_status.value}[/]"
        )
    for d in report.differences:
        out.print(f"\n[red]step {d.step} {escape(d.tool)} ({escape(d.call_id)}): {escape(d.what)} differs[/]")
        out.print(f"  [dim]recorded:[/] {escape(_cut(d.recorded, SHOWN_CHARS))}", highlight=False)
        out.print(f"  [dim]replayed:[/] {escape(_cut(d.replayed, SHOWN_CHARS))}", highlight=False)


def _ask_or_deny(request: ApprovalRequest) -> Choice:
    """A replay's approver: the terminal's answer, and no when there is no terminal (a replay
    never pauses: there is no one to resume it)."""
    from stockade.policy.approval import cli_approver

    return cli_approver(request) or Choice.DENIED


def _unkept_setup(run_id: str, policy: Path | None, role: str | None, trust: Trust | None) -> RunSetup:
    """What a run the store kept no setup of (recorded by a bare ``Agent``, or by an older
    stockade) is replayed under: ``--policy``, else the defaults (trust untrusted, unless
    ``--trust`` says otherwise); its tier is then chosen by that trust."""
    from stockade.policy.load import load_policy
    from stockade.policy.schema import Policy, TrustRules

    if policy is None and role is not None:
        raise exc.InvalidArgument(
            "--role names a role of --policy", argument="--role", fix="give --policy too, or leave out --role"
        )
    if policy is not None:
        kept, shown = load_policy(policy), f"the policy {policy}"
    else:
        kept = Policy(trust=TrustRules(level=trust or Trust.UNTRUSTED))
        shown = f"the default policy (trust {kept.trust.level.value})"
    err.print(
        f"[yellow]the run store kept no policy for run {escape(run_id)} (recorded without one, or before "
        f"runs kept theirs): replaying under {escape(shown)}[/]"
    )
    return RunSetup(policy=kept, role=role, tier=None, check_kept=False)


def load_tools(specs: list[str]) -> Toolset:
    """The built-in tools (with ``shell``) and those named ``MODULE:ATTR``: a ``Tool``, an
    iterable of them, or a ``Toolset`` (its tools; its wrappers are not replayed)."""
    import importlib

    from stockade.tools import Tool, Toolset, default_toolset, shell

    found: dict[str, Tool] = {t.name: t for t in default_toolset().including(shell)}
    for spec in specs:
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise exc.InvalidArgument(
                f"--tools {spec!r} is not MODULE:ATTR",
                argument="--tools",
                fix="e.g. --tools myproject.tools:TOOLS",
            )
        try:
            value: object = importlib.import_module(module_name)
            for part in attr.split("."):
                value = getattr(value, part)
        except (ImportError, AttributeError) as error:
            raise exc.InvalidArgument(
                f"--tools {spec!r}: {error}",
                argument="--tools",
                fix="name an importable module (on PYTHONPATH) and an attribute of it",
            ) from None
        items = list(value) if isinstance(value, Toolset) else [value] if isinstance(value, Tool) else None
        if items is None and isinstance(value, list | tuple):
            items = list(value)
        if items is None or not all(isinstance(t, Tool) for t in items):
            raise exc.InvalidArgument(
                f"--tools {spec!r} is a {type(value).__name__}, not a Tool, a list of Tools or a Toolset",
                argument="--tools",
                fix="point at what @tool made (or a list or Toolset of them)",
            )
        found.update({t.name: t for t in items if isinstance(t, Tool)})
    return Toolset(found.values())


def workspace(
    run_id: Annotated[str, typer.Argument(help="a run id, or a unique prefix of one (in its case)")],
    dest: Annotated[Path, typer.Argument(help="a new folder to write the workspace into")],
    *,
    db: DbOpt = DEFAULT_DB,
    namespace: NamespaceOpt = "runs",
) -> None:
    """Write the workspace a run left (as its last tool call left it) into a new folder: to
    review a run that was stopped (killed by an anomaly rule, broken), or to start again from it."""
    with _store(db, namespace, read_only=True) as store:
        resolved = _resolve(store, run_id)
        try:
            files = store.export_workspace(resolved, dest)
            unnamed = store.workspace_unnamed(resolved)
        except exc.StockadeError as error:
            err.print(f"[red]{escape(str(error))}[/]")
            raise typer.Exit(2) from error
    out.print(f"{files} files of run {escape(resolved)} written to {escape(str(dest))}")
    if unnamed:
        shown = ", ".join(repr(p) for p in unnamed[:20]) + (
            f" ... ({len(unnamed)} in all)" if len(unnamed) > 20 else ""
        )
        err.print(f"[yellow]left out (names not UTF-8, shown with U+FFFD; not kept):[/] {escape(shown)}")


MAX_AGE_DAYS = 1_000_000  # --older-than: past it the cut-off leaves what a timestamp holds


def erase(
    run_ids: Annotated[list[str] | None, typer.Argument(help="whole run ids (never a prefix)")] = None,
    *,
    subject: Annotated[
        str | None, typer.Option("--subject", help="every run of this data subject (GDPR Art. 17)")
    ] = None,
    older_than: Annotated[
        float | None, typer.Option("--older-than", help="every run last updated this many days ago or more")
    ] = None,
    db: DbOpt = DEFAULT_DB,
    namespace: NamespaceOpt = "runs",
    audit_db: Annotated[
        str | None, typer.Option("--audit-db", help="the audit store of these runs (default: --db)")
    ] = None,
    snapshot_dir: Annotated[
        Path | None,
        typer.Option(
            "--snapshot-dir",
            help="where the runs kept their paused sandboxes (default: $STOCKADE_SNAPSHOT_DIR, "
            "else the host's snapshot store)",
        ),
    ] = None,
    approval_dir: Annotated[
        Path | None,
        typer.Option(
            "--approval-dir",
            help="where the runs' approval requests were kept (default: $STOCKADE_APPROVAL_DIR, else the "
            "user's)",
        ),
    ] = None,
    state_dir: Annotated[
        Path,
        typer.Option(
            "--state-dir", help="where `stockade agent` kept the runs' paused state (as its --state-dir)"
        ),
    ] = STATE_DIR,
) -> None:
    """Erase runs, named by their whole ids (a prefix or another case names no run): from the
    run store, their steps, calls, outputs, workspaces and seeds (what no other run shares);
    the snapshots of their sandboxes a paused run kept; the state `stockade agent` kept to
    resume a paused run (``--state-dir``: its options and its copy of the workspace); their
    approval requests and decisions (which name the calls' arguments); in the audit store,
    the keys their events were sealed with (runs about a data subject), so that what those
    events said can never be read again. The audit chain keeps every event and verifies as
    before; it gains one ``run_erased`` event per sealed run (so verify tells an erasure from a
    key deleted outside stockade) and a ``note`` (``action: delete``) per other run erased (so
    verify tells it from rows deleted outside stockade), which needs the chain's key
    (``STOCKADE_AUDIT_KEY``). The trail records each erasure before the rows go: an erasure cut
    in between is finished by erasing the run again, as is one whose trail never recorded it."""
    import time

    from stockade.audit.events import Chain, Draft, EventKind
    from stockade.audit.stores import check_chain, open_store
    from stockade.audit.verify import unrecorded_erasures
    from stockade.policy.approval import ApprovalStore
    from stockade.runs.snapshots import erase_run_snapshots
    from stockade.sandbox.snapshots import SnapshotStore

    if older_than is not None:  # a negative age reached runs updated "in the future": every run
        checked(older_than, "--older-than", zero=True, most=MAX_AGE_DAYS)
    named = list(dict.fromkeys(run_ids or []))
    if "" in named:  # a prefix of every run id, once
        err.print("[red]an empty run id names no run[/]")
        raise typer.Exit(2)
    with _store(db, namespace, read_only=False) as store:
        chosen = list(named)
        if subject is not None or older_than is not None:
            before = time.time_ns() - round(older_than * 86400e9) if older_than is not None else None
            chosen += [r for r in store.runs_of(subject=subject, before_ns=before) if r not in named]
        if not chosen and subject is None:
            err.print("nothing to erase: give run ids, --subject or --older-than (or none matched)")
            raise typer.Exit(1 if older_than is not None else 2)
        try:
            with open_store(audit_db or db) as audit:
                present = store.stored_runs(chosen)
                gone = [r for r in named if r not in present]
                # gone from the store with no erasure in the trail (an erasure cut before it
                # was recorded, rows deleted by hand): recording it is what is left to do
                unrecorded = unrecorded_erasures(audit, gone)
                known = unrecorded | store.erased_runs(gone)
                unknown = [r for r in gone if r not in known]
                if unknown:
                    err.print(
                        f"[red]no run {escape(unknown[0])!r} in {escape(db)}[/] (erase takes whole run "
                        "ids: `stockade runs list` shows them)"
                    )
                    raise typer.Exit(2)
                store.check_erasable(sorted(present))  # a running run: nothing recorded, nothing erased
                chain = Chain(_audit_key())
                if present or unrecorded:  # their erasure is recorded below: no row goes unless it can be
                    check_chain(audit.head(), chain, audit.ns)
                # the keys first: one the chain's key cannot record the erasure of stops it all
                sealed = audit.erase_keys(chain, run_ids=chosen, subject=subject)
                # the others' erasure in their trail too, before their rows go: verify tells it
                # from rows deleted behind the store's back (a sealed run's run_erased says it),
                # and an erasure cut after it is finished by erasing again
                now = time.time_ns()
                deleted = [
                    Draft(run_id=run, kind=EventKind.NOTE, actor="stockade", timestamp_ns=now,
                          attributes={"action": "delete"})
                    for run in sorted((present | unrecorded) - set(sealed))
                ]  # fmt: skip
                if deleted:
                    audit.append(deleted, chain)
                erased = store.erase(chosen)
            snapshots = SnapshotStore(snapshot_dir) if snapshot_dir is not None else SnapshotStore.default()
            kept = erase_run_snapshots(snapshots, chosen)
            approvals = ApprovalStore(approval_dir)
            for run_id in chosen:
                approvals.erase(run_id)
            paused = sum(_erase_paused_state(state_dir, run_id) for run_id in chosen)
        except exc.StockadeError as error:
            err.print(f"[red]{escape(str(error))}[/]")
            raise typer.Exit(2) from error
    if not erased and not sealed and not unrecorded and not kept and not paused:
        err.print(
            f"nothing to erase: no run of {escape(repr(subject))} in {escape(db)}"
            if not named
            else f"nothing to erase: {escape(', '.join(named))} erased already"
        )
        raise typer.Exit(1)
    out.print(
        f"erased {erased} run(s) from {escape(db)}"
        + (f", with the {kept} sandbox snapshot(s) they kept" if kept else "")
        + (f", the paused state of {paused}" if paused else "")
        + (
            f"; recorded the erasure of {len(unrecorded)} run(s) the store no longer had"
            if unrecorded
            else ""
        )
        + f"; the audit events of {len(sealed)} sealed run(s) "
        "can no longer be read (the chain keeps them, records the erasure and still verifies)"
    )


def _erase_paused_state(state_dir: Path, run_id: str) -> int:
    """Remove what `stockade agent` kept to resume the run (``<state-dir>/<run-id>``: its
    ``run.json`` and its copy of the workspace); 1 when there was one. A folder without
    ``run.json`` is not one, and stays: a --state-dir given wrong deletes nothing else."""
    if not run_id or "/" in run_id or run_id.startswith("."):  # never a folder `agent` made
        return 0
    folder = state_dir / run_id
    if folder.is_symlink() or not (folder / "run.json").is_file():
        return 0
    shutil.rmtree(folder)
    return 1


def register(app: typer.Typer) -> None:
    group = typer.Typer(name="runs", help="List and inspect recorded agent runs.", no_args_is_help=True)
    group.command("list")(list_runs)
    group.command("show")(show)
    group.command("workspace")(workspace)
    group.command("erase")(erase)
    app.add_typer(group)
    app.command("replay")(replay)
