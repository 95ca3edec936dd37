"""``stockade``: the command-line face of the SDK.

Each group of commands lives in its own module exposing ``register(app)``; this module only
assembles them. Every module is imported at start (``--help`` lists every command), and with
them the SDK's core; the optional dependencies (docker-py, the database drivers, the model
providers' SDKs, OpenTelemetry) load only inside the commands that use them.
"""

from __future__ import annotations

import importlib
from typing import Annotated

import typer

app = typer.Typer(
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
    "stockade.cli.snapshot_cmds",
    "stockade.cli.service_cmds",
    "stockade.cli.mcp_cmds",
    "stockade.cli.viewer_cmds",
)

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


if __name__ == "__main__":
    app()
