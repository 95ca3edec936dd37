"""``stockade snapshots list`` and ``delete``: what a snapshot store keeps, what keeps each
snapshot, and an operator's way to remove one.

A snapshot stays while a ref keeps it: a paused sandbox (its id), a snapshot a caller took,
an agent run that paused (its run id: ``stockade runs erase`` removes it), a microVM's boot
image (with ``--boot``). ``stockade gc`` removes what nothing keeps. In a service's tenant
store (``<serve --snapshot-dir>/<tenant>``) a ref names the role that took it; one that names
none (a token without a role, or a snapshot kept by a stockade from before roles owned them)
is reached by no token of a tenant whose policy has roles, yet counts against its
``snapshot_mb``: ``delete --no-role`` removes those.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from stockade import exceptions as exc
from stockade.cli._console import CliConsole, escape, print_json
from stockade.sandbox.snapshots import Held, SnapshotStore

out = CliConsole()
err = CliConsole(stderr=True)

# what a caller's snapshots are held by (a run's are ``stockade runs erase``'s, a boot image gc's)
CALLERS = ("paused", "kept")

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
    no_role: Annotated[
        bool,
        typer.Option("--no-role", help="only the paused and kept snapshots whose ref names no role"),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON list")] = False,
) -> None:
    """The snapshots kept: id, kind (files or memory), tier, size, when taken, what keeps
    each (a paused sandbox, a run by its id, a caller: kept, a boot image) and, in a service's
    tenant store, the role that took it."""
    store = _given(snapshot_dir) if snapshot_dir is not None else SnapshotStore.default()
    kinds = ("paused", "kept", "run", "boot") if boot else ("paused", "kept", "run")
    held = _role_less(store) if no_role else store.held(kinds)
    if as_json:
        print_json([_held_json(h) for h in held])
        return
    table = Table("snapshot", "kind", "tier", "size", "taken", "held by", "role", box=None)
    for h in held:
        s = h.snapshot
        table.add_row(
            s.id,
            s.kind.value,
            s.tier,
            f"{s.size_bytes / MiB:.1f} MiB",
            datetime.fromtimestamp(s.taken_at, tz=UTC).strftime("%Y-%m-%d %H:%M:%S"),
            escape(h.holder),
            escape(h.role or "-") if h.kind in CALLERS else "",
        )
    out.print(table)


def _given(folder: Path) -> SnapshotStore:
    """The store at ``folder``, which must be one: a mistyped path listed an empty table, and
    ``delete --no-role`` deleted nothing, each exit 0, as if the store held nothing."""
    if not folder.is_dir():
        what = "is not a folder" if os.path.lexists(folder) else "does not exist"
        err.print(f"[red]error:[/] --snapshot-dir {escape(str(folder))} {what}")
        err.print(
            "[cyan]fix:[/] give the store's folder (a service tenant's is <serve --snapshot-dir>/<tenant>)"
        )
        raise typer.Exit(2)
    return SnapshotStore(folder)


def _role_less(store: SnapshotStore) -> list[Held]:
    return [h for h in store.held(CALLERS) if h.role is None]


def delete_snapshots(
    ids: Annotated[
        list[str] | None, typer.Argument(help="snapshot ids (snap-...)", show_default=False)
    ] = None,
    *,
    snapshot_dir: Annotated[
        Path,
        typer.Option(
            "--snapshot-dir",
            help="the store: a service tenant's is <serve --snapshot-dir>/<tenant>",
            show_default=False,
        ),
    ],
    no_role: Annotated[
        bool,
        typer.Option(
            "--no-role",
            help="every paused or kept snapshot whose ref names no role (a tenant whose policy has "
            "roles: what none of its tokens reaches)",
        ),
    ] = False,
) -> None:
    """Delete snapshots a caller kept or paused, with their bytes: the paused sandbox or kept
    snapshot is gone, and what it took of its tenant's snapshot_mb is free. A run's snapshot is
    left to `stockade runs erase`. Safe while the service runs (the store's own lock)."""
    store = _given(snapshot_dir)
    chosen = list(dict.fromkeys([*(ids or ()), *(h.snapshot.id for h in _role_less(store) if no_role)]))
    if not ids and not no_role:
        err.print("[red]error:[/] name the snapshots to delete, or give --no-role")
        raise typer.Exit(2)
    failed = _delete(store, chosen)
    out.print(f"{len(chosen) - failed} snapshot(s) deleted")
    if failed:
        raise typer.Exit(1)


def _delete(store: SnapshotStore, ids: Sequence[str]) -> int:
    """Delete each of ``ids``; how many were refused."""
    failed = 0
    for sid in ids:
        holders = [h for h in store.held(("paused", "kept", "run")) if h.snapshot.id == sid]
        runs = [h for h in holders if h.kind == "run"]
        if runs or not holders:
            why = (
                f"a paused run's ({runs[0].holder}): stockade runs erase"
                if runs
                else "no snapshot a caller keeps"
            )
            err.print(f"[red]error:[/] {escape(sid)} is {escape(why)}; left as it is")
            failed += 1
            continue
        try:
            store.discard(sid)
        except (exc.SnapshotError, OSError) as error:
            err.print(f"[red]error:[/] {escape(sid)}: {escape(str(error))}")
            failed += 1
            continue
        out.print(f"deleted {escape(sid)} ({', '.join(escape(h.holder) for h in holders)})")
    return failed


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
    group.command("delete")(delete_snapshots)
    app.add_typer(group)
