"""``stockade replay``: run a recorded run again, with its recorded model responses, in a
fresh sandbox under what the run ran under, and report where its observations differ. Apart
from ``runs``: it assembles a guarded agent and starts a sandbox, and loads the run's own
tools (``--tools``).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from stockade import exceptions as exc
from stockade._config_file import audit_key
from stockade.cli._console import CliConsole, escape, print_json
from stockade.cli._run_views import SHOWN_CHARS, cut
from stockade.cli._runs_store import DEFAULT_DB, DbOpt, JsonOpt, NamespaceOpt, resolve_run, run_store
from stockade.cli._signals import Interrupted, closed_whole, interruptible
from stockade.cli._signals import exit_code as signal_exit_code
from stockade.policy.approval_book import ApprovalRequest, Choice
from stockade.runs.store import RunSetup
from stockade.sandbox import _registry
from stockade.tools.base import Toolset
from stockade.types import Trust

if TYPE_CHECKING:
    from stockade.runs.replay import ReplayReport

out = CliConsole()
err = CliConsole(stderr=True)


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
        run_store(db, namespace, read_only=True) as store,  # only read: a replay records no run
    ):
        try:
            toolset = load_tools(tools) if tools else None
            state = store.load(resolve_run(store, run_id))
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
                audit_key=audit_key(),
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
        out.print(f"  [dim]recorded:[/] {escape(cut(d.recorded, SHOWN_CHARS))}", highlight=False)
        out.print(f"  [dim]replayed:[/] {escape(cut(d.replayed, SHOWN_CHARS))}", highlight=False)


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


def register(app: typer.Typer) -> None:
    app.command("replay")(replay)
