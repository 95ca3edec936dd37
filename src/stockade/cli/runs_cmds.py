"""``stockade runs list | show | workspace | erase``: read recorded agent runs, take out the
workspace a run left (a run an anomaly rule killed, for review), and erase runs (a data
subject's, or those older than the retention period; ``runs_erase``). ``stockade replay``
re-runs one (``replay_cmds``).

The store is ``--db`` (or ``STOCKADE_RUNS_DB``, else ``STOCKADE_AUDIT_DB``): by default the
run tables live in the audit database file. A run id may be given by a unique prefix, in its
case, to the commands that read; ``erase`` takes whole ids (it never guesses).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from stockade import exceptions as exc
from stockade.agent.state import RunStatus
from stockade.cli._console import CliConsole, escape, print_json
from stockade.cli._run_views import SHOWN_CHARS, Execs, print_trace, summary_json, trace_json, when
from stockade.cli._runs_store import DEFAULT_DB, DbOpt, JsonOpt, NamespaceOpt, resolve_run, run_store
from stockade.cli.runs_erase import erase

out = CliConsole()
err = CliConsole(stderr=True)


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
    with run_store(db, namespace, read_only=True) as store:
        runs = store.runs(limit=limit, status=status)
    if as_json:
        print_json([summary_json(s) for s in runs])
        return
    table = Table("run", "updated", "status", "steps", "tokens", "cost", "task", box=None)
    for s in runs:
        colour = "green" if s.status == RunStatus.SUCCESS else "yellow" if not s.status.finished else "red"
        table.add_row(
            s.run_id[:12],
            when(s.updated_ns),
            f"[{colour}]{s.status.value}[/]" if not s.forged else "[red]forged[/]",
            str(s.steps),
            str(s.usage.total_tokens),
            f"${s.cost_usd:.4f}",
            escape(s.task.splitlines()[0][:60] if s.task else ""),
        )
    out.print(table)


def show(
    run_id: Annotated[str, typer.Argument(help="a run id, or a unique prefix of one (in its case)")],
    *,
    db: DbOpt = DEFAULT_DB,
    namespace: NamespaceOpt = "runs",
    chars: Annotated[int, typer.Option("--chars", help="characters of each output shown")] = SHOWN_CHARS,
    as_json: JsonOpt = False,
) -> None:
    """Each step of a run: tool, arguments, exit code, duration, retries and output; then the diff."""
    with run_store(db, namespace, read_only=True) as store:
        try:
            trace = store.trace(resolve_run(store, run_id))
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
        print_trace(trace, chars, execs)


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


def workspace(
    run_id: Annotated[str, typer.Argument(help="a run id, or a unique prefix of one (in its case)")],
    dest: Annotated[Path, typer.Argument(help="a new folder to write the workspace into")],
    *,
    db: DbOpt = DEFAULT_DB,
    namespace: NamespaceOpt = "runs",
) -> None:
    """Write the workspace a run left (as its last tool call left it) into a new folder: to
    review a run that was stopped (killed by an anomaly rule, broken), or to start again from it."""
    with run_store(db, namespace, read_only=True) as store:
        resolved = resolve_run(store, run_id)
        try:
            exported = store.export_workspace(resolved, dest)
        except exc.StockadeError as error:
            err.print(f"[red]{escape(str(error))}[/]")
            raise typer.Exit(2) from error
    out.print(f"{exported.files} files of run {escape(resolved)} written to {escape(str(dest))}")
    if exported.unnamed:
        unnamed = exported.unnamed
        shown = ", ".join(repr(p) for p in unnamed[:20]) + (
            f" ... ({len(unnamed)} in all)" if len(unnamed) > 20 else ""
        )
        err.print(f"[yellow]left out (names not UTF-8, shown with U+FFFD; not kept):[/] {escape(shown)}")
    for line in exported.withheld.lines():
        err.print(f"[yellow]{escape(line)}[/]")


def register(app: typer.Typer) -> None:
    group = typer.Typer(name="runs", help="List and inspect recorded agent runs.", no_args_is_help=True)
    group.command("list")(list_runs)
    group.command("show")(show)
    group.command("workspace")(workspace)
    group.command("erase")(erase)
    app.add_typer(group)
