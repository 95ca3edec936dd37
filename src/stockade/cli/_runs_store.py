"""What every ``stockade runs`` command and ``stockade replay`` share: the options that name
the run store, opening it (read-only for the commands that only read), and a run named by a
unique prefix of its id. Apart, below the commands, so that ``runs erase`` and ``replay``
import it and not the module that registers them.
"""

from __future__ import annotations

from typing import Annotated

import typer

from stockade import exceptions as exc
from stockade._config_file import audit_key
from stockade._state import sqlite_path
from stockade.cli._console import CliConsole, escape
from stockade.runs.store import RunStore, open_run_store

err = CliConsole(stderr=True)

DEFAULT_DB = "sqlite:///.stockade/audit.db"

DbOpt = Annotated[
    str,
    typer.Option(
        "--db",
        envvar=["STOCKADE_RUNS_DB", "STOCKADE_AUDIT_DB"],
        help="sqlite:///PATH, a file path, or postgresql://...",
    ),
]
NamespaceOpt = Annotated[str, typer.Option("--namespace", help="table prefix of the run store")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]


def run_store(db: str, namespace: str, *, read_only: bool) -> RunStore:
    """The run store; ``read_only`` for the commands that only read it (they change nothing).
    With the audit key (``STOCKADE_AUDIT_KEY``, as `stockade audit`), rows edited outside
    stockade are told apart: shown ``forged`` in a list, refused when one run is read."""
    path = sqlite_path(db)
    if path is not None and not path.exists():
        err.print(f"[red]no run store at {escape(str(path))}[/] (set --db or STOCKADE_RUNS_DB)")
        raise typer.Exit(2)
    try:
        return open_run_store(db, namespace=namespace, key=audit_key(), read_only=read_only)
    except exc.StockadeError as error:
        err.print(f"[red]{escape(str(error))}[/]")
        raise typer.Exit(2) from error


def resolve_run(store: RunStore, run_id: str) -> str:
    matches = store.find(run_id)
    if run_id in matches:
        return run_id
    if len(matches) == 1:
        return matches[0]
    err.print(
        f"[red]no run {escape(run_id)!r}[/]"
        if not matches
        else f"[red]{escape(run_id)!r} names several runs:[/] {escape(', '.join(matches))}"
    )
    raise typer.Exit(2)
