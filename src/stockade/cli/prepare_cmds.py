"""``stockade prepare``: build ahead what a tier's sandboxes start from, at deploy time.

On the microVM: the boot image of the sandboxes' machine and the ready image of their
configuration (with ``--policy``, one per role of the policy), so that no sandbox's first
start boots. Other tiers have nothing to build. Run again after an install or an upgrade
(a new kernel, QEMU or stockade makes new images); it is quick when nothing changed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stockade import exceptions as exc
from stockade.cli._console import CliConsole, escape
from stockade.cli.sandbox_cmds import CpusOpt, MemoryOpt, PidsOpt, TierOpt, WeakerOpt, _fail
from stockade.types import Limits

out = CliConsole()
err = CliConsole(stderr=True)


def prepare(
    tier: TierOpt = "microvm",
    policy: Annotated[
        Path | None, typer.Option("--policy", help="a policy file: its rules, one image per role")
    ] = None,
    memory: MemoryOpt = 512,
    cpus: CpusOpt = 1.0,
    pids: PidsOpt = 128,
    allow_weaker: WeakerOpt = False,
) -> None:
    """Build what sandboxes of TIER with these limits (and POLICY's rules) start from, now.

    Exit 1 if a start would still not come from a ready image where the tier makes them."""
    from stockade.policy.load import load_policy
    from stockade.policy.prepare import prepare_policy
    from stockade.sandbox import _registry

    try:
        loaded = load_policy(policy) if policy is not None else None
        limits = Limits(memory_mb=memory, cpus=cpus, pids=pids)
        done = prepare_policy(_registry.backend(tier), loaded, limits=limits, allow_weaker=allow_weaker)
    except exc.StockadeError as error:
        _fail(error)
    short = False
    for role, started_from in done.items():
        who = f" (role {escape(role)})" if role else ""
        if not started_from:
            out.print(f"{tier}{who}: nothing to build on this tier")
        elif started_from == "ready image":
            out.print(f"{tier}{who}: sandboxes start from a ready image")
        else:
            short = True
            err.print(f"[yellow]{tier}{who}: sandboxes start from: {escape(started_from)}[/]")
    if short:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("prepare")(prepare)
