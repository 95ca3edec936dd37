"""``stockade agent`` (a task, a model, a workspace, a policy) and ``stockade demo`` (no API key).

``stockade agent`` assembles its agent with ``stockade.agent.build_agent``: the policy's guards,
the runtime controls, the audit trail (``--audit-db``) and the run store (``--runs-db``, by
default the same database) around a sandbox of the tier trust allows.
"""

from __future__ import annotations

import enum
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import BaseModel, ConfigDict
from rich.console import Console

from stockade import exceptions as exc
from stockade._config_file import audit_key
from stockade._private import private_dir, write_private
from stockade.agent import (
    AgentEvent,
    CheckFinished,
    ModelResponded,
    RunFinished,
    RunLimits,
    RunResult,
    RunStarted,
    RunStatus,
    ToolDenied,
    ToolRejected,
    ToolReturned,
)
from stockade.cli._console import CliConsole, escape, print_diff
from stockade.cli._signals import Interrupted, closed_whole, exit_code, interruptible, on_stop, signal_name
from stockade.policy.compliance import kill_target_reachable
from stockade.runtime.events import RetryScheduled, RuntimeEvent
from stockade.runtime.failures import DEFAULT_FAILURES
from stockade.sandbox import _registry
from stockade.tools import default_toolset, shell
from stockade.types import Trust

out = CliConsole()
err = CliConsole(stderr=True)

# The same default as ``stockade audit verify`` and ``stockade runs``: the trail is found without flags.
DEFAULT_DB = "sqlite:///.stockade/audit.db"
DEFAULT_DB_FILE = Path(DEFAULT_DB.removeprefix("sqlite:///"))


class Progress:
    """Prints each step, tool call, duration and retry as the run goes."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def __call__(self, event: AgentEvent) -> None:
        c = self.console
        if isinstance(event, RunStarted):
            c.print(f"[bold]run {escape(event.run_id[:12])}[/] with {escape(event.model_name)}")
        elif isinstance(event, ModelResponded):
            calls = ", ".join(call.name for call in event.response.tool_calls) or "final answer"
            c.print(f"[cyan]step {event.step}[/] model {event.duration_s * 1000:.0f} ms → {escape(calls)}")
        elif isinstance(event, ToolReturned):
            record = event.record
            mark = "[red]✗[/]" if record.is_error else "[green]✓[/]"
            args = ", ".join(f"{k}={_short(v)}" for k, v in record.call.args.items())
            summary = next((line for line in record.observation.splitlines() if line.strip()), "")
            if record.call.name == "run_tests" and "\n" in record.observation:
                summary = record.observation.splitlines()[1]  # the counts, after the command line
            c.print(
                f"    {mark} {escape(record.call.name)}({escape(args)}) {record.duration_s * 1000:.0f} ms  "
                f"[dim]{escape(summary[:100])}[/]"
            )
        elif isinstance(event, ToolRejected):
            record = event.record
            args = ", ".join(f"{k}={_short(v)}" for k, v in record.call.args.items())
            why = record.observation.removeprefix("error: ")
            name = escape(record.call.name)
            c.print(f"    [red]✗ invalid call[/] {name}({escape(args)})  [dim]{escape(why)}[/]")
        elif isinstance(event, ToolDenied):
            c.print(f"    [yellow]denied[/] {escape(event.call.name)}: {escape(event.reason)}")
        elif isinstance(event, CheckFinished):
            check = event.record
            mark = "[green]✓ check passed[/]" if check.passed else "[red]✗ check failed[/]"
            took = f"{check.duration_s * 1000:.0f} ms"
            c.print(f"    {mark} {escape(check.command)} {took}  [dim]{escape(check.summary)}[/]")
        elif isinstance(event, RunFinished):
            show_result(c, event.result)

    def retry(self, event: RuntimeEvent) -> None:
        if isinstance(event, RetryScheduled):
            self.console.print(
                f"    [yellow]↻ retry[/] {escape(event.subject)} attempt {event.attempt + 1} in "
                f"{event.delay_s * 1000:.0f} ms [dim]({escape(event.reason)})[/]"
            )


def _quiet_stamina() -> None:
    """Retries are shown by ``Progress.retry``; stamina's own log line would repeat them."""
    import stamina.instrumentation

    stamina.instrumentation.set_on_retry_hooks([])


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "...'"


def show_result(console: Console, result: RunResult) -> None:
    colour = "green" if result.ok else "red"
    where = f" on the {result.tier} tier" if result.tier else ""
    console.print(
        f"[bold {colour}]{result.status.value}[/] after {len(result.steps)} steps{where}, "
        f"{result.usage.total_tokens} tokens, ${result.cost_usd:.4f}"
    )
    if result.error:
        console.print(f"[red]{escape(result.error)}[/]")
    if result.answer:
        console.print(f"[bold]answer:[/] {escape(result.answer)}")
    if result.diff:
        print_diff(console, result.diff)
    else:
        console.print("[dim](the workspace is unchanged)[/]")


class Prefer(enum.StrEnum):
    CHEAPEST = "cheapest"
    STRONGEST = "strongest"


class SavedRun(BaseModel):
    """What ``stockade agent --resume RUN_ID`` needs from the invocation that paused."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    tier: str | None
    trust: Trust | None
    prefer: Prefer | None = None
    policy: str | None
    role: str | None
    audit_db: str
    runs_db: str
    max_steps: int
    budget_usd: float | None
    rate: int | None
    spend_per_hour: float | None
    kill_target: str | None
    allow_shell: bool
    check: str | None = None
    check_timeout: float | None = None
    max_failures: int | None = DEFAULT_FAILURES


def _absolute_model(spec: str) -> str:
    """``scripted:FILE`` names a file: keep it findable from wherever the run is resumed."""
    provider, _, name = spec.partition(":")
    return f"scripted:{Path(name).resolve()}" if provider == "scripted" and name else spec


STATE_DIR = Path(".stockade/paused")  # --state-dir: `runs erase` removes a run's folder in it


def _paused_dir(state_dir: Path, run_id: str) -> Path:
    if not run_id or "/" in run_id or run_id.startswith("."):
        raise exc.ConfigurationError(f"invalid run id {run_id!r}")
    return state_dir / run_id


def _tell_how_to_resume(result: RunResult, pending: list[dict[str, str]], saved: Path) -> None:
    out.print(
        f"\n[bold yellow]paused[/]: the run waits for a human (its workspace is kept in {escape(str(saved))})"
    )
    for request in pending:
        out.print(f"  {escape(request['action'])}  [dim]({escape(request['reason'])})[/]")
        out.print(f"    approve: stockade approve {escape(result.run_id)} {escape(request['id'])}")
        out.print(f"    deny:    stockade deny {escape(result.run_id)} {escape(request['id'])}")
    out.print(f"  then resume: stockade agent --resume {escape(result.run_id)}")


def agent(  # noqa: C901 - a typer command: its options become the run's configuration
    task: Annotated[str | None, typer.Argument(help="what the agent should do")] = None,
    workspace: Annotated[
        Path | None, typer.Option("--workspace", "-w", help="a folder copied into the sandbox")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", help="PROVIDER:NAME, e.g. openai:gpt-4.1, scripted:turns.json"),
    ] = None,
    tier: Annotated[
        str | None,
        typer.Option("--tier", "-t", help=f"{_registry.NAMES} (default: by trust)"),
    ] = None,
    trust: Annotated[
        Trust | None, typer.Option("--trust", help="tightens the policy's trust level (never loosens it)")
    ] = None,
    prefer: Annotated[
        Prefer | None,
        typer.Option("--prefer", help="of the tiers trust allows: the cheapest (default) or the strongest"),
    ] = None,
    policy: Annotated[
        Path | None, typer.Option("--policy", "-p", help="a policy file (.toml, .yaml)")
    ] = None,
    role: Annotated[str | None, typer.Option("--role", help="the policy role to run under")] = None,
    audit_db: Annotated[
        str, typer.Option("--audit-db", envvar="STOCKADE_AUDIT_DB", help="sqlite:///PATH or postgresql://...")
    ] = DEFAULT_DB,
    runs_db: Annotated[
        str | None,
        typer.Option(
            "--runs-db", envvar="STOCKADE_RUNS_DB", help="the run store (default: the audit database)"
        ),
    ] = None,
    max_steps: Annotated[int, typer.Option("--max-steps", help="model requests at most")] = 30,
    max_failures: Annotated[
        int,
        typer.Option("--max-failures", help='failed actions in a row that stop the run "broken" (0: never)'),
    ] = DEFAULT_FAILURES,
    budget_usd: Annotated[
        float | None, typer.Option("--budget-usd", help="dollars this run may spend")
    ] = None,
    rate: Annotated[
        int | None,
        typer.Option("--rate", help="tool actions per minute at most, over all runs; a refused action waits"),
    ] = None,
    spend_per_hour: Annotated[
        float | None, typer.Option("--spend-per-hour", help="model dollars per rolling hour at most")
    ] = None,
    kill_target: Annotated[
        str | None,
        typer.Option("--kill-target", envvar="STOCKADE_KILL_TARGET", help="kill directory or redis://..."),
    ] = None,
    allow_shell: Annotated[bool, typer.Option("--shell/--no-shell", help="offer the raw shell tool")] = False,
    check: Annotated[
        str | None,
        typer.Option(
            "--check",
            help="acceptance check: a command run in the sandbox when the model says it is done; "
            'the run succeeds only if it passes (e.g. "python3 -m pytest -q")',
        ),
    ] = None,
    check_timeout: Annotated[
        float | None,
        typer.Option("--check-timeout", help="seconds the check may take (default: the sandbox's)"),
    ] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="name the run (default: random)")] = None,
    resume: Annotated[
        str | None, typer.Option("--resume", help="continue a paused, interrupted or crashed run")
    ] = None,
    state_dir: Annotated[
        Path, typer.Option("--state-dir", help="where runs keep how they were started, to resume them")
    ] = STATE_DIR,
) -> None:
    """Let a model work on a copy of WORKSPACE in a sandbox, under a policy; show each step and
    the final diff. The host folder is never written.

    With --check, the run succeeds only when that command passes once the model says it is
    done; a failing check is shown to the model, which goes on within its budget.

    An action that needs approval is asked on the terminal; without one, the run pauses (exit
    code 3) and says how to approve it and resume. Ctrl-C, SIGTERM or SIGHUP stop the run within
    a second, its workspace and state kept: it ends "interrupted" (exit code 128 + the signal's
    number) and resumes with --resume; a second signal stops at once. A run whose process died
    (SIGKILL, a lost machine) shows as "interrupted" in `stockade runs list` and resumes the same
    way, from its last finished tool call and the workspace that call left. Exit codes: 0
    success, 1 the run ended otherwise (check_failed, max_steps, ...), 2 a configuration error
    (or the run is running elsewhere), 3 paused.
    """
    from stockade.assembly import AgentConfig, build_agent
    from stockade.policy import ApprovalStore, cli_approver

    try:
        if resume is not None:
            saved_dir = _paused_dir(state_dir, resume)
            try:
                options = SavedRun.model_validate_json((saved_dir / "run.json").read_text())
            except FileNotFoundError:
                raise exc.ConfigurationError(f"no run {resume!r} to resume in {state_dir}") from None
            # the run store restores the workspace of the last finished call; a folder saved
            # when the run paused is where the sandbox starts (a store without it needs it)
            kept = saved_dir / "workspace"
            workspace, run_id = (kept if kept.is_dir() else None), resume
        else:
            if task is None or workspace is None or model is None:
                raise exc.ConfigurationError("give a TASK, --workspace and --model (or --resume RUN_ID)")
            options = SavedRun(
                model=_absolute_model(model), tier=tier, trust=trust, prefer=prefer,
                policy=str(policy.resolve()) if policy is not None else None, role=role,
                audit_db=audit_db, runs_db=runs_db or audit_db, max_steps=max_steps, budget_usd=budget_usd,
                rate=rate, spend_per_hour=spend_per_hour, kill_target=kill_target, allow_shell=allow_shell,
                check=check, check_timeout=check_timeout, max_failures=max_failures or None,
            )  # fmt: skip
        progress = Progress(out)
        _quiet_stamina()
        if resume is None and (workspace is None or not workspace.is_dir()):
            raise exc.InvalidArgument(
                f"--workspace {str(workspace)!r} is not a folder",
                argument="--workspace",
                fix="give the folder the agent works on (a copy of it goes into the sandbox)",
            )
        config = AgentConfig(
            model=options.model,
            policy=options.policy,
            role=options.role,
            trust=options.trust,
            tier=options.tier,
            prefer=options.prefer.value if options.prefer is not None else None,
            audit=options.audit_db,
            audit_key=audit_key(),  # as `stockade audit`
            limits=RunLimits(max_steps=options.max_steps, max_cost_usd=options.budget_usd),
            rate_per_minute=options.rate,
            dollars_per_hour=options.spend_per_hour,
            kill_target=options.kill_target,
            approver=cli_approver,
            tools=default_toolset().including(shell) if options.allow_shell else default_toolset(),
            runs_url=options.runs_db,
            check=options.check,
            check_timeout_s=options.check_timeout,
            max_consecutive_failures=options.max_failures,
            observers=[progress],
            runtime_observers=[progress.retry],
        )
        # the run goes on without a reachable switch (it may come up later), but not unsaid: the
        # line below tells how to stop it, which would not work now
        reachable, where = kill_target_reachable(options.kill_target)
        if not reachable:
            err.print(f"[yellow]warning: the kill target cannot be reached now:[/] {escape(where)}")
        # a signal while the sandbox starts or the run is saved: stop, removing what was made
        # (a signal while it is removed waits for that)
        with (
            interruptible(),
            closed_whole(build_agent(config)) as built,
            closed_whole(built.session(workspace=workspace, run_id=run_id)) as session,
        ):
            run = escape(session.run_id)  # an id a caller chose may hold `[`: never markup
            out.print(
                f"[dim]run {run} on the {built.tier} tier ({escape(built.tier_reason)}), "
                f"audited in {escape(options.audit_db)}; stop it with: stockade kill {run}[/]"
            )
            saved = _paused_dir(state_dir, session.run_id)
            # how the run was started, kept until it ends: a crash leaves it for --resume (never
            # over another run's: a taken id is refused when the run starts)
            mine = resume is None and not (saved / "run.json").exists()
            if mine:
                private_dir(saved)  # its options, then its workspace
                write_private(saved / "run.json", options.model_dump_json(indent=2))

            def stop(signum: int) -> None:
                # keep the workspace as it is now, then stop the run where it is: it resumes from here
                err.print(f"\n[yellow]{signal_name(signum)}: stopping run {run}[/]")
                try:
                    shutil.rmtree(saved / "workspace", ignore_errors=True)
                    session.save_workspace(saved / "workspace")
                except exc.StockadeError as error:
                    err.print(f"[red]the workspace could not be saved:[/] {escape(str(error))}")
                session.interrupt(f"stopped by {signal_name(signum)}")

            with on_stop(stop) as stopped_by:
                try:
                    result = session.resume_sync() if resume is not None else session.run_sync(task or "")
                except exc.RunConflict:
                    if mine:
                        shutil.rmtree(saved, ignore_errors=True)
                    raise
            if result.status == RunStatus.PAUSED:
                shutil.rmtree(saved / "workspace", ignore_errors=True)
                session.save_workspace(saved / "workspace")
                write_private(saved / "run.json", options.model_dump_json(indent=2))
                _tell_how_to_resume(result, ApprovalStore().pending(session.run_id), saved)
            elif result.status == RunStatus.INTERRUPTED:
                out.print(
                    f"\n[bold yellow]interrupted[/]: run {run} stopped mid-step; its workspace is "
                    f"kept in {escape(str(saved))}\n  resume it: stockade agent --resume {run}"
                )
            elif result.status == RunStatus.BROKEN:
                shutil.rmtree(saved / "workspace", ignore_errors=True)
                session.save_workspace(saved / "workspace")
                out.print(
                    f"\n[bold red]broken[/]: run {run}'s actions kept failing; it is stopped, its "
                    f"workspace kept in {escape(str(saved))}\n  {escape(result.error or '')}\n"
                    f"  once the cause is fixed, resume it: stockade agent --resume {run}"
                )
            else:
                shutil.rmtree(saved, ignore_errors=True)
    except exc.StockadeError as error:
        err.print(f"[red]error:[/] {escape(str(error))}")
        raise typer.Exit(2) from None
    except Interrupted as again:  # outside the run, or a second signal: no waiting; `with` cleans up
        err.print(f"[red]stopped by {again}[/]")
        raise typer.Exit(exit_code(again.signum)) from None
    if result.status == RunStatus.INTERRUPTED and stopped_by:
        raise typer.Exit(exit_code(stopped_by[0]))
    raise typer.Exit(0 if result.ok else 3 if result.status == RunStatus.PAUSED else 1)


def demo(
    tier: Annotated[str, typer.Option("--tier", "-t", help=_registry.NAMES)] = "process",
    audit_db: Annotated[
        Path,
        typer.Option(
            "--audit-db",
            help="SQLite file for the demo's audit trail and run record (the default is where "
            "`stockade runs` and `stockade audit` look)",
        ),
    ] = DEFAULT_DB_FILE,
) -> None:
    """A scripted model fixes a real bug in a sample project, in a real sandbox, no API key needed;
    the run is recorded in an audit trail, which is verified at the end, and in the run store
    (`stockade runs list`)."""
    from stockade.audit import AuditLog, SQLiteStore, verify
    from stockade.demo import run_demo
    from stockade.runs import open_run_store

    db = audit_db
    out.print(
        "[bold]stockade demo[/]: a scripted model fixes the failing test of a sample project in a "
        f"{tier}-tier sandbox (one transient fault is injected and retried on the way)\n"
        f"[dim]audit trail and run record: {escape(str(db))}[/]\n"
    )
    progress = Progress(out)
    _quiet_stamina()
    try:
        # SIGTERM and SIGHUP too unwind the demo's `with` blocks: its sandbox is removed
        with interruptible(), SQLiteStore(db) as store, open_run_store(f"sqlite:///{db}") as runs:
            with AuditLog(store) as log:
                result = run_demo(
                    tier=tier, observers=[progress], on_retry=progress.retry, audit=log, checkpointer=runs
                )
            report = verify(store)
    except exc.StockadeError as error:
        err.print(f"[red]error:[/] {escape(str(error))}")
        raise typer.Exit(2) from None
    except Interrupted as stop:
        err.print(f"[yellow]stockade demo: stopped by {stop}; the sandbox was removed[/]")
        raise typer.Exit(exit_code(stop.signum)) from None
    out.print(f"\naudit run id: {escape(result.run_id)}")
    if not report.ok:
        err.print(f"[red]audit chain broken:[/] {escape(report.summary())}")
        raise typer.Exit(1)
    out.print(f"audit chain verified: {report.checked} events")
    where = "" if db == DEFAULT_DB_FILE else f" --db sqlite:///{escape(str(db))}"
    me = escape(_program())
    out.print(f"[dim]see the run: {me} runs show {escape(result.run_id)}{where}[/]")
    out.print(f"[dim]see its audit events: {me} audit tail{where} --run {escape(result.run_id)}[/]")
    raise typer.Exit(0 if result.ok else 1)


def register(app: typer.Typer) -> None:
    app.command("agent")(agent)
    app.command("demo")(demo)


def _program() -> str:
    """How to call this CLI again from the current folder: ``stockade`` where the shell finds
    it under that name (an activated virtualenv), else the script beside this Python
    (``./scripts/demo`` runs ``.venv/bin/stockade``, which a fresh shell has not on its PATH)."""
    beside = Path(sys.executable).parent / "stockade"
    if shutil.which("stockade") is not None or not beside.is_file():
        return "stockade"
    try:
        return str(beside.relative_to(Path.cwd()))
    except ValueError:
        return str(beside)
