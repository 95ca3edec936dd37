"""``stockade agent`` (a task, a model, a workspace) and ``stockade demo`` (no API key needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax

from stockade import exceptions as exc
from stockade.agent import (
    Agent,
    AgentEvent,
    ModelResponded,
    RunFinished,
    RunLimits,
    RunResult,
    RunStarted,
    ToolDenied,
    ToolReturned,
)
from stockade.runtime.events import RetryScheduled, RuntimeEvent
from stockade.runtime.retry import Retrier, RetryingBackend
from stockade.sandbox import _registry
from stockade.sandbox.facade import Sandbox
from stockade.tools import default_toolset, shell

out = Console()
err = Console(stderr=True)


class Progress:
    """Prints each step, tool call, duration and retry as the run goes."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def __call__(self, event: AgentEvent) -> None:
        c = self.console
        if isinstance(event, RunStarted):
            c.print(f"[bold]run {event.run_id[:12]}[/] with {escape(event.model_name)}")
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
                f"    {mark} {record.call.name}({escape(args)}) {record.duration_s * 1000:.0f} ms  "
                f"[dim]{escape(summary[:100])}[/]"
            )
        elif isinstance(event, ToolDenied):
            c.print(f"    [yellow]denied[/] {event.call.name}: {escape(event.reason)}")
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
    console.print(
        f"[bold {colour}]{result.status.value}[/] after {len(result.steps)} steps, "
        f"{result.usage.total_tokens} tokens, ${result.cost_usd:.4f}"
    )
    if result.error:
        console.print(f"[red]{escape(result.error)}[/]")
    if result.answer:
        console.print(f"[bold]answer:[/] {escape(result.answer)}")
    if result.diff:
        console.print(Syntax(result.diff, "diff", theme="ansi_dark", background_color="default"))
    else:
        console.print("[dim](the workspace is unchanged)[/]")


def agent(
    task: Annotated[str, typer.Argument(help="what the agent should do")],
    workspace: Annotated[Path, typer.Option("--workspace", "-w", help="a folder copied into the sandbox")],
    model: Annotated[str, typer.Option("--model", "-m", help="PROVIDER:NAME, e.g. openai:gpt-4.1")],
    tier: Annotated[str, typer.Option("--tier", "-t", help="process, docker, gvisor or microvm")] = "process",
    max_steps: Annotated[int, typer.Option("--max-steps", help="model requests at most")] = 30,
    allow_shell: Annotated[bool, typer.Option("--shell/--no-shell", help="offer the raw shell tool")] = False,
) -> None:
    """Let a model work on a copy of WORKSPACE in a sandbox; show each step and the final diff.

    The host folder is never written: the diff shows what the agent changed.
    """
    progress = Progress(out)
    _quiet_stamina()
    try:
        backend = RetryingBackend(_registry.backend(tier), Retrier(observer=progress.retry))
        tools = default_toolset().including(shell) if allow_shell else default_toolset()
        runner = Agent(model, tools=tools, observers=[progress], limits=RunLimits(max_steps=max_steps))
        with Sandbox.create(backend=backend, workspace=workspace) as sandbox:
            result = runner.run_sync(task, sandbox=sandbox)
    except exc.StockadeError as error:
        err.print(f"[red]error:[/] {escape(str(error))}")
        raise typer.Exit(2) from None
    raise typer.Exit(0 if result.ok else 1)


def demo(
    tier: Annotated[str, typer.Option("--tier", "-t", help="the sandbox tier")] = "process",
) -> None:
    """A scripted model fixes a real bug in a sample project, in a real sandbox, no API key needed."""
    from stockade.demo import run_demo

    out.print(
        "[bold]stockade demo[/]: a scripted model fixes the failing test of a sample project in a "
        f"{tier}-tier sandbox (one transient fault is injected and retried on the way)\n"
    )
    progress = Progress(out)
    _quiet_stamina()
    try:
        result = run_demo(tier=tier, observers=[progress], on_retry=progress.retry)
    except exc.StockadeError as error:
        err.print(f"[red]error:[/] {escape(str(error))}")
        raise typer.Exit(2) from None
    raise typer.Exit(0 if result.ok else 1)


def register(app: typer.Typer) -> None:
    app.command("agent")(agent)
    app.command("demo")(demo)
