"""``stockade ui``: the run viewer on this machine (127.0.0.1 only), over the local stores."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Annotated

import typer

from stockade import exceptions as exc
from stockade._state import sqlite_path
from stockade.cli._console import CliConsole, escape

err = CliConsole(stderr=True)

DEFAULT_DB = "sqlite:///.stockade/audit.db"
HOST = "127.0.0.1"  # the viewer decides approvals: never on another interface


def ui(
    db: Annotated[
        str,
        typer.Option(
            "--db",
            envvar=["STOCKADE_RUNS_DB", "STOCKADE_AUDIT_DB"],
            help="the run store and audit trail (sqlite:///PATH or a file)",
        ),
    ] = DEFAULT_DB,
    namespace: Annotated[str, typer.Option("--namespace", help="table prefix of the run store")] = "runs",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="the port on 127.0.0.1")] = 8766,
    approval_dir: Annotated[
        Path | None,
        typer.Option(
            "--approval-dir", envvar="STOCKADE_APPROVAL_DIR", help="where pending approvals are kept"
        ),
    ] = None,
) -> None:
    """Browse the runs recorded here: each as a timeline (model calls, tool calls with their
    output, retries, denials, approvals with Approve/Deny, kills, anomalies), its diff and
    whether its audit chain verifies; a run still going updates live. Listens on 127.0.0.1
    only, behind a key printed at start."""
    import uvicorn

    from stockade.server.serving import log_config
    from stockade.server.viewer.data import LocalRuns
    from stockade.server.viewer.web import local_app

    path = sqlite_path(db)
    if path is not None and not path.exists():
        err.print(f"[red]no run store at {escape(str(path))}[/] (set --db or STOCKADE_RUNS_DB)")
        raise typer.Exit(2)
    try:
        source = LocalRuns(
            db if "://" in db else f"sqlite:///{db}", namespace=namespace, approvals=approval_dir
        )
    except exc.StockadeError as error:
        err.print(f"[red]error:[/] {escape(str(error))}")
        raise typer.Exit(2) from None
    key = secrets.token_urlsafe(24)
    err.print(f"stockade ui: open http://{HOST}:{port}/ui/login?key={key}")
    try:
        # its key comes in the login's query: never in an access line, whatever the level
        uvicorn.run(
            local_app(source, key), host=HOST, port=port, log_level="warning", log_config=log_config()
        )
    finally:
        source.close()


def register(app: typer.Typer) -> None:
    app.command("ui")(ui)
