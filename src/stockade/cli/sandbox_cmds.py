"""``stockade doctor``, ``stockade exec``, ``stockade run-code``, ``stockade gc``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.markup import escape

from stockade import exceptions as exc
from stockade.cli._console import CliConsole
from stockade.sandbox import _registry
from stockade.sandbox.facade import Sandbox
from stockade.types import Limits, NetworkPolicy

out = CliConsole()
err = CliConsole(stderr=True)

TierOpt = Annotated[str, typer.Option("--tier", "-t", help="process, docker, gvisor or microvm")]
MemoryOpt = Annotated[int, typer.Option("--memory", help="memory limit in MiB")]
CpusOpt = Annotated[float, typer.Option("--cpus", help="CPU limit (cores)")]
PidsOpt = Annotated[int, typer.Option("--pids", help="process-count limit")]
TimeoutOpt = Annotated[float, typer.Option("--timeout", help="wall-clock limit in seconds")]
WeakerOpt = Annotated[
    bool, typer.Option("--allow-weaker", help="accept weaker enforcement where this host cannot do better")
]
NetworkOpt = Annotated[bool, typer.Option("--network/--no-network", help="allow network access")]


def doctor() -> None:
    """Which tiers work on this host, how each limit is enforced, and how to fix the rest."""
    for tier in _registry.TIERS:
        report = _registry.probe(tier)
        state = "[green]works[/]" if report.available else "[red]unavailable[/]"
        out.print(f"[bold]{tier:8}[/] {state}  {escape(report.detail)}")
        e = report.enforcement
        if e is not None:
            how = ", ".join(
                f"{name}={getattr(e, name)}"
                for name in ("memory", "cpus", "pids", "disk", "network", "timeout")
            )
            out.print(f"         enforced by: {how}")
            for weaker in e.weakened:
                out.print(f"         [yellow]weaker here:[/] {escape(weaker)}")
        for fix in report.fixes:
            out.print(f"         [cyan]fix:[/] {escape(fix)}")


def _fail(error: exc.StockadeError) -> NoReturn:
    """Say what went wrong and, when the error knows it, how to fix it; exit 2."""
    err.print(f"[red]stockade:[/] {escape(str(error))}")
    fix = getattr(error, "fix", "")
    if fix and fix not in str(error):
        err.print(f"[cyan]fix:[/] {escape(fix)}")
    raise typer.Exit(2)


def _limits(memory: int, cpus: float, pids: int, timeout: float) -> Limits:
    return Limits(memory_mb=memory, cpus=cpus, pids=pids, timeout_s=timeout)


def exec_(
    command: Annotated[list[str], typer.Argument(help="the command and its arguments (after --)")],
    tier: TierOpt = "process",
    memory: MemoryOpt = 512,
    cpus: CpusOpt = 1.0,
    pids: PidsOpt = 128,
    timeout: TimeoutOpt = 30.0,
    network: NetworkOpt = False,
    allow_weaker: WeakerOpt = False,
    workspace: Annotated[
        Path | None, typer.Option("--workspace", "-w", help="seed the workspace with a copy of DIR")
    ] = None,
) -> None:
    """Run one command in a fresh sandbox; its exit code becomes ours."""
    try:
        with Sandbox.create(
            tier,
            limits=_limits(memory, cpus, pids, timeout),
            network=NetworkPolicy(enabled=network),
            allow_weaker=allow_weaker,
            workspace=workspace,
        ) as sbx:
            result = sbx.commands.run(
                command,
                on_stdout=lambda s: out.file.write(s),
                on_stderr=lambda s: err.file.write(s),
                stdin=None if sys.stdin.isatty() else sys.stdin.buffer.read(),
            )
    except exc.StockadeError as error:
        _fail(error)
    if result.timed_out:
        err.print(f"[yellow]stockade: timed out after {timeout}s; every process was killed[/]")
    if result.oom_killed:
        err.print(f"[yellow]stockade: killed by the memory limit ({memory} MiB)[/]")
    raise typer.Exit(result.exit_code)


def run_code(
    file: Annotated[str, typer.Argument(help="a Python file, or - for standard input")],
    tier: TierOpt = "process",
    memory: MemoryOpt = 512,
    timeout: TimeoutOpt = 30.0,
    language: Annotated[str, typer.Option("--language", "-l")] = "python",
    allow_weaker: WeakerOpt = False,
) -> None:
    """Run code in a fresh sandbox; print its output and the value of its last expression."""
    try:
        code = sys.stdin.read() if file == "-" else _read_source(Path(file))
        with Sandbox.create(
            tier, limits=Limits(memory_mb=memory, timeout_s=timeout), allow_weaker=allow_weaker
        ) as sbx:
            execution = sbx.run_code(
                code, language, on_stdout=lambda s: out.file.write(s), on_stderr=lambda s: err.file.write(s)
            )
    except exc.StockadeError as error:
        _fail(error)
    for result in execution.results:
        if result.text is not None:
            out.print(result.text, markup=False, highlight=False)
    if execution.error is not None:
        err.print(
            execution.error.traceback or f"{execution.error.name}: {execution.error.value}", markup=False
        )
        raise typer.Exit(1)


def _read_source(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise exc.InvalidArgument(
            f"cannot read FILE {str(path)!r}: {reason}",
            argument="FILE",
            fix="give a readable text file, or - to read the code from standard input",
        ) from None


def gc() -> None:
    """Remove what crashed processes left behind: cgroups, mounts, run folders, containers."""
    from stockade.sandbox import _gc

    removed = _gc.collect()
    for line in removed:
        out.print(f"removed {line}")
    out.print(f"{len(removed)} leftover(s) removed")


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
    app.command("exec", context_settings={"allow_interspersed_args": False})(exec_)
    app.command("run-code")(run_code)
    app.command("gc")(gc)
