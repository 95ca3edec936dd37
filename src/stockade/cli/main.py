"""``stockade``: the command-line face of the SDK.

Each group of commands lives in its own module exposing ``register(app)``; this module only
assembles them. Every module is imported at start (``--help`` lists every command), and with
them the SDK's core; the optional dependencies (docker-py, the database drivers, the model
providers' SDKs, OpenTelemetry) load only inside the commands that use them.
"""

from __future__ import annotations

import errno
import importlib
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from stockade.exceptions import StockadeError

# Exit codes of an error no command handled itself (a command documents its own codes).
BAD_INPUT = 2  # a StockadeError: the input, the configuration or the host refused
OS_FAILED = 1  # the OS failed a read or a write (a full disk, an output that is a folder)


class _Stockade(TyperGroup):
    """Every command's errors end the same way: a StockadeError is one red line (and its fix)
    and exit 2, an OSError one line and exit 1, never a traceback of input the user gave."""

    def invoke(self, ctx: Any) -> Any:  # typer's own click Context, which it does not export
        from stockade.cli._console import CliConsole, escape

        try:
            return super().invoke(ctx)
        except StockadeError as error:
            err = CliConsole(stderr=True)
            err.print(f"[red]stockade:[/] {escape(str(error), one_line=True)}")
            fix = getattr(error, "fix", "")
            if fix and fix not in str(error):
                err.print(f"[cyan]fix:[/] {escape(fix)}")
            raise typer.Exit(BAD_INPUT) from None
        except OSError as error:
            if error.errno == errno.EPIPE:  # the reader left (`| head`): click ends quietly
                raise
            where = f" {error.filename!r}" if error.filename is not None else ""
            reason = error.strerror or str(error)
            CliConsole(stderr=True).print(f"[red]stockade:[/] {escape(f'{reason}{where}', one_line=True)}")
            raise typer.Exit(OS_FAILED) from None


app = typer.Typer(
    cls=_Stockade,
    name="stockade",
    help="Run untrusted, agent-written code in enforced isolation tiers.",
    no_args_is_help=True,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        from stockade import __version__

        print(f"stockade {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit"),
    ] = False,
) -> None:
    """Run untrusted, agent-written code in enforced isolation tiers."""


# One module per group of commands; each defines register(app: typer.Typer) -> None.
COMMAND_MODULES = (
    "stockade.cli.sandbox_cmds",
    "stockade.cli.audit_cmds",
    "stockade.cli.agent_cmds",
    "stockade.cli.policy_cmds",
    "stockade.cli.image_cmds",
    "stockade.cli.prepare_cmds",
    "stockade.cli.runs_cmds",
    "stockade.cli.replay_cmds",
    "stockade.cli.snapshot_cmds",
    "stockade.cli.service_cmds",
    "stockade.cli.mcp_cmds",
    "stockade.cli.viewer_cmds",
)

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


if __name__ == "__main__":
    app()
