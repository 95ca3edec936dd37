"""``stockade snapshots list``: what a snapshot store keeps, and what keeps each snapshot.

A snapshot stays while a ref keeps it: a paused sandbox (its id), a snapshot a caller took,
an agent run that paused (its run id: ``stockade runs erase`` removes it), a microVM's boot
image (with ``--boot``). ``stockade gc`` removes what nothing keeps.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from stockade.cli._console import CliConsole, escape
from stockade.sandbox.snapshots import Held, SnapshotStore

out = CliConsole()

MiB = 1024 * 1024


def list_snapshots(
    *,
    snapshot_dir: Annotated[
        Path | None,
        typer.Option(
            "--snapshot-dir",
            help="the store (default: $STOCKADE_SNAPSHOT_DIR, else the host's snapshot store)",
        ),
    ] = None,
    boot: Annotated[bool, typer.Option("--boot", help="the microVM's boot images too")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON list")] = False,
) -> None:
    """The snapshots kept: id, kind (files or memory), tier, size, when taken, and what keeps
    each: a paused sandbox, a run (by its id), a caller (kept), a boot image."""
    store = SnapshotStore(snapshot_dir) if snapshot_dir is not None else SnapshotStore.default()
    kinds = ("paused", "kept", "run", "boot") if boot else ("paused", "kept", "run")
    held = store.held(kinds)
    if as_json:
        print(json.dumps([_held_json(h) for h in held]))
        return
    table = Table("snapshot", "kind", "tier", "size", "taken", "held by", box=None)
    for h in held:
        s = h.snapshot
        table.add_row(
            s.id,
            s.kind.value,
            s.tier,
            f"{s.size_bytes / MiB:.1f} MiB",
            datetime.fromtimestamp(s.taken_at, tz=UTC).strftime("%Y-%m-%d %H:%M:%S"),
            escape(h.holder),
        )
    out.print(table)


def _held_json(h: Held) -> dict[str, object]:
    s = h.snapshot
    return {
        "id": s.id,
        "kind": s.kind.value,
        "tier": s.tier,
        "source": s.source,
        "size_bytes": s.size_bytes,
        "taken_at": s.taken_at,
        "held_by": {"kind": h.kind, "name": h.name, **h.extra},
    }


def register(app: typer.Typer) -> None:
    group = typer.Typer(name="snapshots", help="What the snapshot store keeps.", no_args_is_help=True)
    group.command("list")(list_snapshots)
    app.add_typer(group)
