"""``stockade doctor``, ``stockade exec``, ``stockade run-code``, ``stockade gc``."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from stockade import exceptions as exc
from stockade._checks import check_envs
from stockade._config_file import read_config_text
from stockade.cli._console import CliConsole, escape, print_json
from stockade.cli._signals import Interrupted, closed_whole, exit_code, interruptible
from stockade.sandbox import _filetable, _registry, _rules
from stockade.sandbox.facade import Sandbox
from stockade.types import CommandResult, Limits, NetworkPolicy, TierReport

out = CliConsole()
err = CliConsole(stderr=True)

TierOpt = Annotated[str, typer.Option("--tier", "-t", help=_registry.NAMES)]
MemoryOpt = Annotated[int, typer.Option("--memory", help="memory limit in MiB")]
CpusOpt = Annotated[float, typer.Option("--cpus", help="CPU limit (cores)")]
PidsOpt = Annotated[int, typer.Option("--pids", help="process-count limit")]
TimeoutOpt = Annotated[float, typer.Option("--timeout", help="wall-clock limit in seconds")]
WeakerOpt = Annotated[
    bool, typer.Option("--allow-weaker", help="accept weaker enforcement where this host cannot do better")
]
NetworkOpt = Annotated[bool, typer.Option("--network/--no-network", help="allow network access")]


_ENFORCED = ("memory", "cpus", "pids", "disk", "files", "ptys", "network", "timeout")


def _report_json(report: TierReport) -> dict[str, object]:
    e = report.enforcement
    return {
        "tier": report.tier,
        "available": report.available,
        "detail": report.detail,
        "enforcement": None if e is None else {name: str(getattr(e, name)) for name in _ENFORCED},
        # At the default limits: the most one sandbox can take from the host.
        "host": None if e is None or e.host is None else dataclasses.asdict(e.host),
        "policy": {name: str(how) for name, how in _rules.TIER_SUPPORT.get(report.tier, {}).items()},
        "weakened": list(e.weakened) if e is not None else [],
        # A call past its timeout is stopped within this much more, however busy the host.
        "timeout_margin_s": None if e is None else e.timeout_margin_s,
        "fixes": list(report.fixes),
    }


def file_table_fix(limit: int, memory: int) -> str:
    """The fix when the host's ``fs.file-max`` is below the open files its memory could hold
    through sandboxes' mappings (``_filetable``); empty when it is not."""
    short = _filetable.short_by(limit, memory)
    if not short:
        return ""
    return (
        f"fs.file-max is {limit:,}, {short:,} fewer open files than sandboxes can hold within "
        "this host's memory (through mappings, outside open_files): past it, every other "
        "process of the host gets ENFILE. Raise it as systemd does: run scripts/setup-host.sh "
        f"as root (sysctl -w fs.file-max={_filetable.UNBOUNDED})"
    )


def _with_host_fix(report: TierReport, fix: str) -> TierReport:
    """``report`` with ``fix`` added where its sandboxes hold mapped files in the host's table."""
    host = report.enforcement.host if report.enforcement is not None else None
    if not fix or host is None or not host.mapped_files:
        return report
    return dataclasses.replace(report, fixes=(*report.fixes, fix))


def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="print the tiers as JSON")] = False,
) -> None:
    """Which tiers work on this host, how each limit is enforced, and how to fix the rest."""
    files_fix = file_table_fix(_filetable.file_max(), _filetable.host_memory())
    reports = [_with_host_fix(_registry.probe(tier), files_fix) for tier in _registry.TIERS]
    if as_json:
        print_json([_report_json(r) for r in reports])
        return
    for report in reports:
        tier = report.tier
        state = "[green]works[/]" if report.available else "[red]unavailable[/]"
        out.print(f"[bold]{tier:8}[/] {state}  {escape(report.detail)}")
        e = report.enforcement
        if e is not None:
            how = ", ".join(f"{name}={getattr(e, name)}" for name in _ENFORCED)
            out.print(f"         enforced by: {how}")
            policy = _rules.TIER_SUPPORT.get(tier, {})
            inside = ", ".join(f"{name}={how}" for name, how in policy.items())
            out.print(f"         a policy, inside the sandbox: {inside}")
            out.print(f"         a call past its timeout is stopped within {e.timeout_margin_s:g} s more")
            if e.host is not None:
                out.print(
                    f"         one sandbox at the default limits takes at most {e.host.memory_mb} MiB, "
                    f"{e.host.tasks} tasks and {e.host.open_files} open files of the host"
                    + (
                        f", and {e.host.mapped_files} more files held open by mappings (memory_mb / 384 B)"
                        if e.host.mapped_files
                        else ""
                    )
                )
            else:
                out.print("         [yellow]what one sandbox can take from the host is not bounded here[/]")
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


def _sizes(text: str) -> int:
    """``1048576``, ``512K``, ``64M``, ``1G`` (binary units) -> bytes."""
    units = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (raw[:-1], raw[-1]) if raw[-1:] in units and raw[-1:] else (raw, "")
    try:
        value = float(number) * units[unit]
    except ValueError:
        value = -1
    if not (value >= 1 and math.isfinite(value)):
        raise exc.InvalidArgument(
            f"--max-output is {text!r}",
            argument="--max-output",
            fix="give a size such as 1048576, 512K, 64M or 1G",
        )
    return int(value)


def _envs(pairs: list[str]) -> dict[str, str]:
    """``NAME=value``, or ``NAME`` for the host's value of it (as ``docker run -e`` does)."""
    envs: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            host = os.environ.get(name)
            if host is None:
                raise exc.InvalidArgument(
                    f"--env {name!r} has no value and is not set here",
                    argument="--env",
                    fix="give NAME=VALUE, or NAME of a variable set in this shell",
                )
            value = host
        envs[name] = value
    return check_envs(envs, argument="--env")


def _human(size: int) -> str:
    return (
        f"{size / 1024**2:.1f} MiB"
        if size >= 1024**2
        else f"{size / 1024:.1f} KiB"
        if size >= 1024
        else f"{size} B"
    )


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
    env: Annotated[
        list[str] | None,
        typer.Option(
            "--env", "-e", help="NAME=VALUE (or NAME: this shell's value) for the command; repeatable"
        ),
    ] = None,
    max_output: Annotated[
        str, typer.Option("--max-output", help="keep this much of stdout and of stderr each (e.g. 64M)")
    ] = "1M",
    as_json: Annotated[
        bool,
        typer.Option("--json", help="print the result (exit code, output, sizes, tier) as JSON at the end"),
    ] = False,
) -> None:
    """Run one command in a fresh sandbox; its exit code becomes ours.

    Output beyond --max-output (stdout and stderr each) is cut, and stderr says so. Ctrl-C,
    SIGTERM and SIGHUP stop the command and remove the sandbox; the exit code is then 128 + the
    signal's number."""
    try:
        with interruptible():
            limits = Limits(
                memory_mb=memory, cpus=cpus, pids=pids, timeout_s=timeout, output_bytes=_sizes(max_output)
            )
            with closed_whole(
                Sandbox.create(
                    tier,
                    limits=limits,
                    network=NetworkPolicy(enabled=network),
                    envs=_envs(env or []),
                    allow_weaker=allow_weaker,
                    workspace=workspace,
                )
            ) as sbx:
                result = sbx.commands.run(
                    command,
                    on_stdout=None if as_json else lambda s: out.file.write(s),
                    on_stderr=None if as_json else lambda s: err.file.write(s),
                    stdin=None if sys.stdin.isatty() else sys.stdin.buffer.read(),
                )
                used = sbx.tier
    except exc.StockadeError as error:
        _fail(error)
    except Interrupted as stop:
        err.print(f"[yellow]stockade: stopped by {stop}; the sandbox and everything in it were removed[/]")
        raise typer.Exit(exit_code(stop.signum)) from None
    if as_json:
        print_json({**_result_json(result), "tier": used})
    if result.truncated:
        cap = limits.output_bytes
        for name, size in (("stdout", result.stdout_bytes), ("stderr", result.stderr_bytes)):
            if size > cap:
                err.print(
                    f"[yellow]stockade: {name} was cut: {_human(cap)} of {_human(size)} kept "
                    f"(raise the cap with --max-output, e.g. --max-output {max(size // 1024**2 + 1, 2)}M)[/]"
                )
    if result.timed_out:
        err.print(f"[yellow]stockade: timed out after {timeout}s; every process was killed[/]")
    if result.oom_killed:
        err.print(f"[yellow]stockade: killed by the memory limit ({memory} MiB)[/]")
    if result.locks_killed:
        err.print("[yellow]stockade: killed for holding more file locks than a sandbox may (4,096)[/]")
    raise typer.Exit(result.exit_code)


def _result_json(result: CommandResult) -> dict[str, object]:
    return {
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "duration_s": result.duration_s,
        "timed_out": result.timed_out,
        "oom_killed": result.oom_killed,
        "locks_killed": result.locks_killed,
        "truncated": result.truncated,
        "stdout_bytes": result.stdout_bytes,
        "stderr_bytes": result.stderr_bytes,
        "signal": result.signal,
    }


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
        with (
            interruptible(),
            closed_whole(
                Sandbox.create(
                    tier, limits=Limits(memory_mb=memory, timeout_s=timeout), allow_weaker=allow_weaker
                )
            ) as sbx,
        ):
            execution = sbx.run_code(
                code, language, on_stdout=lambda s: out.file.write(s), on_stderr=lambda s: err.file.write(s)
            )
    except exc.StockadeError as error:
        _fail(error)
    except Interrupted as stop:
        err.print(f"[yellow]stockade: stopped by {stop}; the sandbox and everything in it were removed[/]")
        raise typer.Exit(exit_code(stop.signum)) from None
    for result in execution.results:
        if result.text is not None:
            out.print(result.text, markup=False, highlight=False)
    if execution.error is not None:
        err.print(
            execution.error.traceback or f"{execution.error.name}: {execution.error.value}", markup=False
        )
        raise typer.Exit(1)


def _read_source(path: Path) -> str:
    """As the other file inputs are read: a FIFO (no writer) hung the command for ever."""
    return read_config_text(
        path, what="FILE", fix="give a readable text file, or - to read the code from standard input"
    )


def gc(
    network: Annotated[
        bool,
        typer.Option(
            "--network",
            help="also remove the docker tier's full network (stockade-net) and its firewall rules, "
            "when no sandbox is on it",
        ),
    ] = False,
    snapshot_dir: Annotated[
        list[Path] | None,
        typer.Option(
            "--snapshot-dir",
            envvar="STOCKADE_SERVICE_SNAPSHOT_DIR",
            help="also collect this snapshot store, or each tenant's store of a service's snapshot "
            "folder (serve --snapshot-dir): snapshots and objects nothing keeps (repeatable)",
        ),
    ] = None,
) -> None:
    """Remove what crashed processes left behind: cgroups, mounts, run folders, containers, and
    snapshots nothing keeps."""
    from stockade.sandbox import _gc
    from stockade.sandbox._snapshot_files import MARKER
    from stockade.sandbox.snapshots import SnapshotStore

    engine = None
    if network:  # lasting, like the image: shared by every process's full-network sandboxes
        from stockade.sandbox.docker import DockerBackend

        # Asked first: without the engine's word that no sandbox is on the network, its
        # walls stay (BackendUnavailable, exit 2), and nothing else is removed either.
        engine = DockerBackend()
        try:
            engine._api()
        except exc.BackendUnavailable as err:
            raise exc.BackendUnavailable(
                f"{err}: gc --network removes the full network's firewall rules only once the engine "
                "says no sandbox is on it; nothing was removed"
            ) from None
    stores: list[SnapshotStore] = []
    for folder in snapshot_dir or ():
        if not folder.is_dir():
            out.print(f"no snapshot folder {escape(str(folder))}: nothing collected there")
            continue
        found = _gc.snapshot_stores(folder)
        if not found:
            out.print(
                f"no snapshot store in {escape(str(folder))} (a store holds a {MARKER} file): "
                "nothing collected there"
            )
        stores += found
    removed = _gc.collect(stores)
    if engine is not None:
        from stockade.sandbox import _netfull

        removed += _netfull.remove(engine._api(), remote=engine.remote)
        busy = _netfull.sandboxes_on(engine._api())
        if busy:
            out.print(
                f"kept {_netfull.NETWORK} and its firewall rules: {busy} sandbox(es) on it; "
                "close them, then run gc --network again"
            )
        if engine.remote:
            out.print("kept this host's firewall rules: the engine asked (DOCKER_HOST) is another host's")
    for line in removed:
        out.print(f"removed {escape(line, one_line=True)}")  # a file's name, shown, never acted on
    out.print(f"{len(removed)} leftover(s) removed")


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
    app.command("exec", context_settings={"allow_interspersed_args": False})(exec_)
    app.command("run-code")(run_code)
    app.command("gc")(gc)
