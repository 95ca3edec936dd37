"""``stockade image build``: the sandbox image the container tiers run.

``--offline`` needs no registry: debootstrap a minimal Debian with python3 into a cached
folder (used as is by gVisor without Docker) and ``docker import`` it. The work is done by
the project's ``scripts/build-image.sh``, which caches by content and skips what is built.
Without ``--offline`` the image is built from ``scripts/Dockerfile.sandbox`` (pulls a base).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Annotated

import typer

from stockade.cli._console import CliConsole

err = CliConsole(stderr=True)
image_app = typer.Typer(help="Build the sandbox image of the docker and gvisor tiers.", no_args_is_help=True)


def _scripts() -> Path | None:
    """The project's scripts folder (present in a source checkout, not in a wheel)."""
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "scripts" / "build-image.sh"
        if candidate.is_file():
            return candidate.parent
    return None


@image_app.command("build")
def build(
    offline: Annotated[
        bool, typer.Option("--offline", help="no registry: debootstrap + docker import (needs root)")
    ] = False,
    tag: Annotated[str, typer.Option("--tag", help="image tag (online build)")] = "stockade-sandbox:latest",
) -> None:
    """Build the sandbox image (cached: an unchanged recipe is not rebuilt)."""
    scripts = _scripts()
    if scripts is None:
        err.print(
            "[red]stockade:[/] the image recipes live in the project's scripts/ folder; run from a checkout"
        )
        raise typer.Exit(2)
    if offline:
        argv = ["bash", str(scripts / "build-image.sh")]
    else:
        argv = ["docker", "build", "-f", str(scripts / "Dockerfile.sandbox"), "-t", tag, str(scripts)]
    result = subprocess.run(argv, check=False)
    raise typer.Exit(result.returncode)


def register(app: typer.Typer) -> None:
    app.add_typer(image_app, name="image")
