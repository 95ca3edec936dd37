"""``stockade kill | policy check | approve | deny | approvals``: control runs from outside.

``kill`` writes the kill marker the run's ``KillSwitch`` polls: a file in the kill directory
(``--target DIR``, ``STOCKADE_KILL_DIR``, default ``~/.stockade/kill``) or a Redis key
(``--target redis://...``), only for a run that is live there (``--force`` otherwise), and
waits for it to stop. Approvals live in ``STOCKADE_APPROVAL_DIR`` (default
``~/.stockade/approvals``); a paused run resumes with
``agent.run(resume=RUN_ID, sandbox=...)`` once the decision is in.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from stockade import exceptions as exc
from stockade.cli._console import CliConsole

out = CliConsole()
err = CliConsole(stderr=True)

TargetOpt = Annotated[
    str | None,
    typer.Option("--target", envvar="STOCKADE_KILL_TARGET", help="kill directory, or redis://... URL"),
]
ApprovalDirOpt = Annotated[
    Path | None, typer.Option("--dir", envvar="STOCKADE_APPROVAL_DIR", help="the approvals directory")
]


def kill(
    run_id: Annotated[str, typer.Argument(help="the run to stop")],
    reason: Annotated[str, typer.Option("--reason", help="why, for the audit trail")] = "killed from the CLI",
    target: TargetOpt = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="pull the switch even if the run is not live (it dies when it starts or resumes)"
        ),
    ] = False,
    wait: Annotated[float, typer.Option("--wait", help="seconds to wait for the run to stop")] = 5.0,
) -> None:
    """Stop a live run now: its sandbox processes are killed and it ends as "killed".

    Exit codes: 0 the run stopped (or, with --force, the switch is set), 1 no live run has that
    id (nothing was pulled), 3 the switch is pulled but the run was still live after --wait."""
    from stockade.runtime.killswitch import KILL_TTL_S, kill_source_for

    try:
        source = kill_source_for(target)
        live = getattr(source, "live", lambda _: None)(run_id)
        if live is None and not force:
            err.print(
                f"no live run {escape(run_id)}: it finished, never started, or watches another kill "
                "target; nothing was pulled"
            )
            err.print(
                "[cyan]fix:[/] check the id (stockade runs list), or --force to stop a run of this id "
                f"when it starts or resumes (the switch expires after {KILL_TTL_S / 3600:g} h)"
            )
            raise typer.Exit(1)
        source.kill(run_id, reason)
    except exc.StockadeError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    if live is None:
        out.print(
            f"kill switch set for run {escape(run_id)}, which is not live: it stops when it starts or "
            f"resumes within {KILL_TTL_S / 3600:g} h"
        )
        return
    out.print(f"kill switch pulled for live run {escape(run_id)} ({escape(live)})")
    deadline = time.monotonic() + max(wait, 0.0)
    while source.live(run_id) is not None:  # type: ignore[attr-defined]
        if time.monotonic() >= deadline:
            err.print(f"run {escape(run_id)} is still live after {wait:g} s; it stops at its next step")
            raise typer.Exit(3)
        time.sleep(0.1)
    out.print(f"run {escape(run_id)} stopped")


def check(file: Annotated[Path, typer.Argument(help="a policy file (.toml, .yaml)")]) -> None:
    """Validate a policy file; every mistake is listed with its line."""
    from stockade.policy.load import load_policy

    try:
        policy = load_policy(file)
    except exc.PolicyFileError as e:
        for problem in e.problems:
            err.print(f"[red]error:[/red] {escape(problem)}")
        raise typer.Exit(1) from None
    except exc.ConfigurationError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(1) from None
    c = policy.commands
    out.print(
        f"{escape(file.name)}: valid — {len(c.allow)} allowed / {len(c.deny)} denied / "
        f"{len(c.approve)} approval command rules, {len(policy.roles)} role(s), "
        f"network {'on' if policy.network.enabled else 'off'}, trust {policy.trust.level.value}"
    )


def _decide(run_id: str, request_id: str, approved: bool, by: str, directory: Path | None) -> None:
    from stockade.policy.approval import ApprovalStore, Choice

    try:
        ApprovalStore(directory).decide(
            run_id, request_id, Choice.APPROVED if approved else Choice.DENIED, by=by
        )
    except exc.ConfigurationError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(1) from None
    verb = "approved" if approved else "denied"
    out.print(f"{verb} {escape(request_id)} of run {escape(run_id)}; the run continues when resumed")


ByOpt = Annotated[str, typer.Option("--by", help="who decides, for the audit trail")]


def approve(run_id: str, request_id: str, by: ByOpt = "cli", directory: ApprovalDirOpt = None) -> None:
    """Approve an action a paused run is waiting for."""
    _decide(run_id, request_id, True, by, directory)


def deny(run_id: str, request_id: str, by: ByOpt = "cli", directory: ApprovalDirOpt = None) -> None:
    """Deny an action a paused run is waiting for (the model is told)."""
    _decide(run_id, request_id, False, by, directory)


def approvals(
    run_id: Annotated[str | None, typer.Argument(help="only this run")] = None,
    directory: ApprovalDirOpt = None,
) -> None:
    """List the actions waiting for approval."""
    from stockade.policy.approval import ApprovalStore

    pending = ApprovalStore(directory).pending(run_id)
    if not pending:
        out.print("nothing is waiting for approval")
    for record in pending:
        out.print(
            f"{escape(record['run_id'])} {escape(record['id'])}  {escape(record['action'])}  "
            f"[dim]({escape(record['reason'])})[/dim]"
        )


def register(app: typer.Typer) -> None:
    app.command("kill")(kill)
    app.command("approve")(approve)
    app.command("deny")(deny)
    app.command("approvals")(approvals)
    policy = typer.Typer(help="Policy files.", no_args_is_help=True)
    policy.command("check")(check)
    app.add_typer(policy, name="policy")
