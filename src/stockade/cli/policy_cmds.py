"""``stockade kill | policy check | approve | deny | approvals``: control runs from outside.

``kill`` writes the kill marker the run's ``KillSwitch`` polls: a file in the kill directory
(``--target DIR``, ``STOCKADE_KILL_DIR``, default ``~/.stockade/kill``) or a Redis key
(``--target redis://...``). Approvals live in ``STOCKADE_APPROVAL_DIR`` (default
``~/.stockade/approvals``); a paused run resumes with
``agent.run(resume=RUN_ID, sandbox=...)`` once the decision is in.
"""

from __future__ import annotations

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
) -> None:
    """Stop a run now: it ends between steps and its sandbox processes are killed."""
    from stockade.runtime.killswitch import kill_source_for

    try:
        kill_source_for(target).kill(run_id, reason)
    except exc.StockadeError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    out.print(f"kill switch pulled for run {escape(run_id)}")


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
