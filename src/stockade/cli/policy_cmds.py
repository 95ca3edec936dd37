"""``stockade kill | policy check | policy explain | approve | deny | approvals``: control runs
from outside, and ask a policy what it would decide (and why) before any run does.

``kill`` writes the kill marker the run's ``KillSwitch`` polls: a file in the kill directory
(``--target DIR``, ``STOCKADE_KILL_DIR``, default ``~/.stockade/kill``), a Redis key
(``--target redis://...``) or a row of a service's database (``--target`` the URL ``stockade
serve --db`` was given: ``sqlite:///PATH``, ``postgresql://...``), only for a run that is live
there (``--force`` otherwise), and waits for it to stop; ``kill --all`` does so for every live
run (``--tenant``: of one tenant).
Approvals live in ``STOCKADE_APPROVAL_DIR`` (default ``~/.stockade/approvals``); a paused run
resumes with ``agent.run(resume=RUN_ID, sandbox=...)`` once the decision is in.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from stockade import exceptions as exc
from stockade.cli._console import CliConsole, escape, print_json
from stockade.policy.schema import Policy, Verdict
from stockade.sandbox import _registry
from stockade.types import Trust

if TYPE_CHECKING:
    from stockade.policy.compliance import ComplianceReport
    from stockade.policy.engine import Decision, PolicyEngine
    from stockade.sandbox.ops import Op

out = CliConsole()
err = CliConsole(stderr=True)

TargetOpt = Annotated[
    str | None,
    typer.Option(
        "--target",
        envvar="STOCKADE_KILL_TARGET",
        help="kill directory, redis://... URL, or a service's database (sqlite:///PATH, postgresql://...)",
    ),
]
ApprovalDirOpt = Annotated[
    Path | None, typer.Option("--dir", envvar="STOCKADE_APPROVAL_DIR", help="the approvals directory")
]


def kill(
    run_id: Annotated[str | None, typer.Argument(help="the run to stop")] = None,
    reason: Annotated[str, typer.Option("--reason", help="why, for the audit trail")] = "killed from the CLI",
    target: TargetOpt = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="pull the switch even if the run is not live (it dies when it starts or resumes)"
        ),
    ] = False,
    wait: Annotated[float, typer.Option("--wait", help="seconds to wait for the run to stop")] = 5.0,
    every: Annotated[bool, typer.Option("--all", help="stop every run live at the target now")] = False,
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="with --all: only the runs of this tenant")
    ] = None,
) -> None:
    """Stop a live run now: its sandbox processes are killed and it ends as "killed". With --all,
    every live run (of --tenant only, when given): for the operator who needs it all stopped.

    Exit codes: 0 the run stopped (or, with --force, the switch is set), 1 no live run has that
    id (nothing was pulled), 3 the switch is pulled but the run was still live after --wait."""
    from stockade.runtime.kill_sources import KILL_TTL_S, kill_source_for

    if every or tenant is not None:
        if run_id is not None or not every:
            err.print("[red]error:[/red] give a RUN_ID, or --all (with --tenant to stop one tenant's runs)")
            raise typer.Exit(2)
        _kill_all(target, reason, tenant, wait)
        return
    if run_id is None:
        err.print("[red]error:[/red] give the RUN_ID to stop, or --all")
        raise typer.Exit(2)
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


def _kill_all(target: str | None, reason: str, tenant: str | None, wait: float) -> None:
    from stockade.runtime.kill_sources import kill_all, kill_source_for

    try:
        source = kill_source_for(target)
        # a service's database also holds the runs waiting for a worker or an approval: they
        # end where they are, or a worker would start them next
        end_waiting = getattr(source, "end_waiting", None)
        ended = end_waiting(reason, tenant=tenant) if end_waiting is not None else []
        pulled = [
            r for r in kill_all(source, reason, tenant=tenant) if r.run_id not in {e.run_id for e in ended}
        ]
    except exc.StockadeError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    whose = f" of tenant {escape(tenant)}" if tenant is not None else ""
    if not pulled and not ended:
        what = "live run" if end_waiting is None else "live or waiting run"
        err.print(f"no {what}{whose}: nothing was pulled")
        raise typer.Exit(1)
    for run in ended:
        out.print(f"run {escape(run.run_id)} ended ({escape(str(run))})")
    for run in pulled:
        out.print(f"kill switch pulled for live run {escape(run.run_id)} ({escape(str(run))})")
    deadline = time.monotonic() + max(wait, 0.0)
    live = [r.run_id for r in pulled]
    while live := [r for r in live if source.live(r) is not None]:  # type: ignore[attr-defined]
        if time.monotonic() >= deadline:
            err.print(f"{len(live)} run(s) still live after {wait:g} s: {escape(', '.join(live))}")
            raise typer.Exit(3)
        time.sleep(0.1)
    out.print(f"{len(pulled) + len(ended)} run(s){whose} stopped")


def check(
    file: Annotated[Path, typer.Argument(help="a policy file (.toml, .yaml)")],
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
    compliance: Annotated[
        list[str] | None,
        typer.Option(
            "--compliance",
            help="check a compliance profile's requirements (soc2, hipaa, gdpr; repeat it, or "
            '"declared" for the policy\'s own): every one, met or not, and how to fix it',
        ),
    ] = None,
    role: Annotated[str | None, typer.Option("--role", help="the role runs start under")] = None,
    audit_db: Annotated[
        str, typer.Option("--audit-db", envvar="STOCKADE_AUDIT_DB", help="where the audit trail goes")
    ] = "sqlite:///.stockade/audit.db",
    kill_target: Annotated[
        str | None,
        typer.Option("--kill-target", envvar="STOCKADE_KILL_TARGET", help="kill directory, or redis://..."),
    ] = None,
    host: Annotated[
        bool,
        typer.Option(
            "--host/--no-host",
            help="probe this host's microVM tier (starts one; --no-host reports it unchecked, not met)",
        ),
    ] = True,
) -> None:
    """Validate a policy file; every mistake is listed with its line. Exit 1 if it is invalid.

    With --compliance, also check each requirement of the profiles against the policy, the
    configuration `stockade agent` would start with (the audit database and STOCKADE_AUDIT_KEY,
    the kill target) and this host. Checkpoints, not certifications. Exit 1 if one is not met."""
    from stockade.policy.load import load_policy

    try:
        policy = load_policy(file)
    except exc.PolicyFileError as e:
        problems = list(e.problems) or [str(e)]
    except exc.ConfigurationError as e:
        problems = [str(e)]
    else:
        problems = []
    if problems:
        if as_json:
            print_json({"file": str(file), "valid": False, "problems": problems})
        else:
            for problem in problems:
                err.print(f"[red]error:[/red] {escape(problem)}")
        raise typer.Exit(1)
    if compliance:
        _check_compliance(policy, compliance, role, audit_db, kill_target, host, as_json)
        return
    c = policy.commands
    if as_json:
        summary = {
            "file": str(file),
            "valid": True,
            "problems": [],
            "commands": {"allow": list(c.allow), "deny": list(c.deny), "approve": list(c.approve)},
            "roles": list(policy.roles),
            "network": policy.network.enabled,
            "trust": policy.trust.level.value,
            "compliance": list(policy.compliance.profiles),
            "allowed_tiers": [
                tier
                for tier in _registry.allowed_tiers(
                    policy.trust.level, allow_gvisor_for_untrusted=policy.trust.allow_gvisor_for_untrusted
                )
                if tier == "microvm" or not policy.compliance.profiles
            ],
        }
        print_json(summary)
        return
    out.print(
        f"{escape(file.name)}: valid — {len(c.allow)} allowed / {len(c.deny)} denied / "
        f"{len(c.approve)} approval command rules, {len(policy.roles)} role(s), "
        f"network {'on' if policy.network.enabled else 'off'}, trust {policy.trust.level.value}"
    )
    if policy.compliance.profiles:
        declared = escape(", ".join(policy.compliance.profiles))
        out.print(
            f"declares compliance profiles {declared} (the microvm tier only); "
            "check their requirements with --compliance declared"
        )


def _check_compliance(
    policy: Policy,
    asked: list[str],
    role: str | None,
    audit_db: str,
    kill_target: str | None,
    host: bool,
    as_json: bool,
) -> None:
    import os

    from stockade.policy.compliance import (
        PROFILES,
        Setup,
        check_compliance,
        kill_target_reachable,
        microvm_on_host,
    )

    profiles = [p for a in asked for p in (policy.compliance.profiles if a == "declared" else a.split(","))]
    unknown = sorted({p for p in profiles if p not in PROFILES})
    if unknown or not profiles:
        err.print(f"[red]error:[/red] no profile {escape(', '.join(unknown)) or '(none declared)'}; "
                  f"the profiles are: {', '.join(PROFILES)}")  # fmt: skip
        raise typer.Exit(2)
    setup = Setup(  # what `stockade agent` would start with
        audit_url=audit_db,
        audit_keyed=bool(os.environ.get("STOCKADE_AUDIT_KEY")),
        audit_redacts_personal_data="gdpr" in policy.compliance.profiles,
        runs_erasable=audit_db != "memory:",
        kill_switch=kill_target_reachable(kill_target),
        anomaly_monitor=True,
        failure_breaker=5,
        microvm=microvm_on_host() if host else (False, "not checked (--no-host)"),
    )
    try:
        report = check_compliance(policy, setup, role=role, profiles=profiles)
    except exc.ConfigurationError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    if as_json:
        print_json(_report_json(report))
        raise typer.Exit(0 if report.ok else 1)
    out.print("[dim]compliance checkpoints, not certifications: they check what stockade can see[/]")
    for profile in report.profiles:
        findings = [f for f in report.findings if f.requirement.profile == profile]
        met = sum(f.met for f in findings)
        colour = "green" if met == len(findings) else "red"
        out.print(f"\n[bold]{escape(profile)}[/]: [{colour}]{met} of {len(findings)} requirements met[/]")
        for f in findings:
            mark = "[green]met[/]    " if f.met else "[red]not met[/]"
            out.print(f"  {mark} {escape(f.requirement.control)}: {escape(f.requirement.text)}")
            out.print(f"          [dim]{escape(f.detail)}[/]")
            if not f.met:
                out.print(f"          [cyan]fix:[/] {escape(f.requirement.fix)}")
    raise typer.Exit(0 if report.ok else 1)


def _report_json(report: ComplianceReport) -> dict[str, object]:
    return {
        "checkpoints_not_certifications": True,
        "ok": report.ok,
        "requirements": [
            {
                "id": f.requirement.id,
                "profile": f.requirement.profile,
                "control": f.requirement.control,
                "requirement": f.requirement.text,
                "met": f.met,
                "detail": f.detail,
                "fix": None if f.met else f.requirement.fix,
            }
            for f in report.findings
        ],
    }


_EXPLAIN_EXIT = {"allow": 0, "deny": 1, "approve": 3}


def _tool_checks(engine: PolicyEngine, tool: str) -> list[tuple[str, Decision]]:
    """The rules about using a tool: the role's, and its risk when it is a built-in tool."""
    from stockade.tools import default_toolset, shell

    checks = [("tool rules", engine.tool(tool))]
    known = default_toolset().including(shell).get(tool)
    if known is not None:  # a built-in tool: its declared risk is known
        checks.append((f"risk ({known.risk.value})", engine.risk(known.risk.value, tool=tool)))
    return checks


def explain(
    file: Annotated[Path, typer.Argument(help="a policy file (.toml, .yaml)")],
    command: Annotated[
        str | None, typer.Option("--command", "-c", help="a shell command line the agent would run")
    ] = None,
    read: Annotated[str | None, typer.Option("--read", help="a workspace path the agent would read")] = None,
    write: Annotated[
        str | None, typer.Option("--write", help="a workspace path the agent would write")
    ] = None,
    delete: Annotated[str | None, typer.Option("--delete", help="a workspace path it would delete")] = None,
    tool: Annotated[
        str | None, typer.Option("--tool", help="the tool that acts (e.g. shell, run_tests)")
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="a model name the run would call")] = None,
    prompt: Annotated[str | None, typer.Option("--prompt", help="a task text")] = None,
    role: Annotated[str | None, typer.Option("--role", help="the role the run has")] = None,
    trust: Annotated[Trust | None, typer.Option("--trust", help="tighten the policy's trust level")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the decisions as JSON")] = False,
) -> None:
    """What the policy would decide about an action, and why: each rule that applies, its verdict
    and its reason, and the outcome (the strictest). Exit codes: 0 allowed, 1 denied, 3 needs a
    human's approval, 2 a mistake in the question."""
    from stockade.assembly import effective_trust
    from stockade.policy.engine import Decision, PolicyEngine, strictest
    from stockade.policy.load import load_policy

    try:
        policy = load_policy(file)
        if trust is not None:
            level = effective_trust(policy, trust)
            policy = policy.model_copy(update={"trust": policy.trust.model_copy(update={"level": level})})
        engine = PolicyEngine(policy, role=role)
    except exc.ConfigurationError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    actions: list[tuple[str, list[tuple[str, Decision]]]] = []
    if tool is not None:
        actions.append((f"use the tool {tool!r}", _tool_checks(engine, tool)))
    for what, op in _asked_ops(command, read, write, delete):
        actions.append((what, list(engine.explain(op, tool=tool or ""))))
    if model is not None:
        provider, _, name = model.rpartition(":")  # PROVIDER:NAME, or a bare name
        actions.append((f"call the model {model!r}", [("models.approved", engine.model(name, provider))]))
    prompted = engine.prompt(prompt, "task") if prompt is not None else None
    if not actions and prompted is None:
        err.print("[red]error:[/red] ask about something: --command, --read, --write, --delete, --tool, "
                  "--model or --prompt")  # fmt: skip
        raise typer.Exit(2)
    outcomes = [strictest(d for _, d in parts) for _, parts in actions]
    if prompted is not None and prompted.verdict == "deny":
        outcomes.append(
            Decision(verdict=Verdict.DENY, rule=f"prompts: {', '.join(prompted.rules)}", reason="")
        )
    overall = strictest(outcomes).verdict.value
    if as_json:
        body: dict[str, object] = {
            "policy": str(file),
            "role": role,
            "trust": policy.trust.level.value,
            "verdict": overall,
            "actions": [
                _action_json(what, parts, outcome)
                for (what, parts), outcome in zip(actions, outcomes, strict=False)
            ],
        }
        if prompted is not None:
            body["prompt"] = {"verdict": prompted.verdict, "rules": list(prompted.rules)}
        print_json(body)
        raise typer.Exit(_EXPLAIN_EXIT[overall])
    out.print(f"[bold]{escape(file.name)}[/], role {escape(role or '-')}, trust {policy.trust.level.value}")
    colours = {"allow": "green", "approve": "yellow", "deny": "red"}
    for (what, parts), outcome in zip(actions, outcomes, strict=False):
        verdict = outcome.verdict.value
        why = f": {escape(outcome.reason)} [dim]({escape(outcome.rule)})[/]" if verdict != "allow" else ""
        out.print(f"{escape(what)} → [{colours[verdict]}]{verdict}[/]{why}")
        for name, d in parts:
            rule = f" [dim]({escape(d.rule)})[/]" if d.rule else ""
            out.print(f"    {escape(name)}: {d.verdict.value}{rule} {escape(d.reason)}")
    if prompted is not None:
        fired = f" (rules: {escape(', '.join(prompted.rules))})" if prompted.rules else ""
        out.print(f"the task text → [{colours.get(prompted.verdict, 'yellow')}]{prompted.verdict}[/]{fired}")
    raise typer.Exit(_EXPLAIN_EXIT[overall])


def _asked_ops(
    command: str | None, read: str | None, write: str | None, delete: str | None
) -> list[tuple[str, Op[Any]]]:
    """The sandbox ops ``policy explain`` was asked about, each with how to say it."""
    from stockade.sandbox.ops import ReadFile, Remove, RunCommand, WriteFile

    ops: list[tuple[str, Op[Any]]] = []
    if command is not None:
        ops.append((f"run `{command}`", RunCommand(argv=("/bin/sh", "-c", command))))
    if read is not None:
        ops.append((f"read {read!r}", ReadFile(path=read)))
    if write is not None:
        ops.append((f"write {write!r}", WriteFile(path=write, data=b"")))
    if delete is not None:
        ops.append((f"delete {delete!r}", Remove(path=delete)))
    return ops


def _action_json(what: str, parts: list[tuple[str, Decision]], outcome: Decision) -> dict[str, object]:
    return {
        "action": what,
        "verdict": outcome.verdict.value,
        "rule": outcome.rule,
        "reason": outcome.reason,
        "checks": [
            {"check": name, "verdict": d.verdict.value, "rule": d.rule, "reason": d.reason}
            for name, d in parts
        ],
    }


def _decide(run_id: str, request_id: str, approved: bool, by: str, directory: Path | None) -> None:
    from stockade.policy.approval_book import Choice
    from stockade.policy.approval_store import ApprovalStore

    try:
        ApprovalStore(directory).decide(
            run_id, request_id, Choice.APPROVED if approved else Choice.DENIED, by=by
        )
    except exc.ApprovalDecided as e:  # what it was given answers nothing: exit 2, with the fix
        err.print(f"[red]error:[/red] {escape(str(e))}")
        err.print("[cyan]fix:[/] `stockade approvals` lists the requests still waiting for a decision")
        raise typer.Exit(2) from None
    except exc.InvalidArgument as e:  # an unknown run or request (its message holds the fix)
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    except exc.ConfigurationError as e:  # the request's file is damaged: the message says to remove it
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(1) from None
    verb = "approved" if approved else "denied"
    out.print(f"{verb} {escape(request_id)} of run {escape(run_id)}; the run continues when resumed")


ByOpt = Annotated[str, typer.Option("--by", help="who decides, for the audit trail")]


def approve(run_id: str, request_id: str, by: ByOpt = "cli", directory: ApprovalDirOpt = None) -> None:
    """Approve an action a paused run is waiting for. Exit codes: 0 decided; 2 no such run or
    request, or one that waits for no decision (decided already, or its yes spent); 1 its
    request's file is damaged."""
    _decide(run_id, request_id, True, by, directory)


def deny(run_id: str, request_id: str, by: ByOpt = "cli", directory: ApprovalDirOpt = None) -> None:
    """Deny an action a paused run is waiting for (the model is told). Exit codes: 0 decided; 2
    no such run or request, or one that waits for no decision; 1 its request's file is damaged."""
    _decide(run_id, request_id, False, by, directory)


def approvals(
    run_id: Annotated[str | None, typer.Argument(help="only this run")] = None,
    directory: ApprovalDirOpt = None,
) -> None:
    """List the actions waiting for approval."""
    from stockade.policy.approval_store import ApprovalStore

    store = ApprovalStore(directory)
    pending = store.pending(run_id)
    if not pending:
        out.print("nothing is waiting for approval")
    for record in pending:
        run, request, action, reason = (str(record.get(k, "?")) for k in ("run_id", "id", "action", "reason"))
        out.print(f"{escape(run)} {escape(request)}  {escape(action)}  [dim]({escape(reason)})[/dim]")
    damaged = store.damaged(run_id)
    for problem in damaged:  # said, and the rest listed: one of them failed the whole listing
        err.print(f"[red]error:[/] {escape(problem)}")
    if damaged:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("kill")(kill)
    app.command("approve")(approve)
    app.command("deny")(deny)
    app.command("approvals")(approvals)
    policy = typer.Typer(help="Policy files: check one, or ask what it would decide.", no_args_is_help=True)
    policy.command("check")(check)
    policy.command("explain")(explain)
    app.add_typer(policy, name="policy")
