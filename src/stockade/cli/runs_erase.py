"""``stockade runs erase``: erase runs (named by whole ids, a data subject's, or those older
than the retention period) from the run store and from everything else that kept them: the
sandbox snapshots, `stockade agent`'s paused state, the approval requests, and in the audit
store the keys their events were sealed with. Apart from the commands that read runs: it is
the one that writes the audit trail and removes files.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer

from stockade import exceptions as exc
from stockade._config_file import audit_key
from stockade.cli._console import CliConsole, escape
from stockade.cli._numbers import checked
from stockade.cli._runs_store import DEFAULT_DB, DbOpt, NamespaceOpt, run_store
from stockade.cli.agent_cmds import STATE_DIR

out = CliConsole()
err = CliConsole(stderr=True)

MAX_AGE_DAYS = 1_000_000  # --older-than: past it the cut-off leaves what a timestamp holds


def erase(
    run_ids: Annotated[list[str] | None, typer.Argument(help="whole run ids (never a prefix)")] = None,
    *,
    subject: Annotated[
        str | None, typer.Option("--subject", help="every run of this data subject (GDPR Art. 17)")
    ] = None,
    older_than: Annotated[
        float | None, typer.Option("--older-than", help="every run last updated this many days ago or more")
    ] = None,
    db: DbOpt = DEFAULT_DB,
    namespace: NamespaceOpt = "runs",
    audit_db: Annotated[
        str | None, typer.Option("--audit-db", help="the audit store of these runs (default: --db)")
    ] = None,
    snapshot_dir: Annotated[
        Path | None,
        typer.Option(
            "--snapshot-dir",
            help="where the runs kept their paused sandboxes (default: $STOCKADE_SNAPSHOT_DIR, "
            "else the host's snapshot store)",
        ),
    ] = None,
    approval_dir: Annotated[
        Path | None,
        typer.Option(
            "--approval-dir",
            help="where the runs' approval requests were kept (default: $STOCKADE_APPROVAL_DIR, else the "
            "user's)",
        ),
    ] = None,
    state_dir: Annotated[
        Path,
        typer.Option(
            "--state-dir", help="where `stockade agent` kept the runs' paused state (as its --state-dir)"
        ),
    ] = STATE_DIR,
) -> None:
    """Erase runs, named by their whole ids (a prefix or another case names no run): from the
    run store, their steps, calls, outputs, workspaces and seeds (what no other run shares);
    the snapshots of their sandboxes a paused run kept; the state `stockade agent` kept to
    resume a paused run (``--state-dir``: its options and its copy of the workspace); their
    approval requests and decisions (which name the calls' arguments); in the audit store,
    the keys their events were sealed with (runs about a data subject), so that what those
    events said can never be read again. The audit chain keeps every event and verifies as
    before; it gains one ``run_erased`` event per sealed run (so verify tells an erasure from a
    key deleted outside stockade) and a ``note`` (``action: delete``) per other run erased (so
    verify tells it from rows deleted outside stockade), which needs the chain's key
    (``STOCKADE_AUDIT_KEY``). The trail records each erasure before the rows go: an erasure cut
    in between is finished by erasing the run again, as is one whose trail never recorded it."""
    import time

    from stockade.audit._store_append import check_chain
    from stockade.audit.events import Chain, Draft, EventKind
    from stockade.audit.stores import open_store
    from stockade.audit.verify import unrecorded_erasures
    from stockade.policy.approval_store import ApprovalStore
    from stockade.runs.snapshots import erase_run_snapshots
    from stockade.sandbox.snapshots import SnapshotStore

    if older_than is not None:  # a negative age reached runs updated "in the future": every run
        checked(older_than, "--older-than", zero=True, most=MAX_AGE_DAYS)
    named = list(dict.fromkeys(run_ids or []))
    if "" in named:  # a prefix of every run id, once
        err.print("[red]an empty run id names no run[/]")
        raise typer.Exit(2)
    with run_store(db, namespace, read_only=False) as store:
        chosen = list(named)
        if subject is not None or older_than is not None:
            before = time.time_ns() - round(older_than * 86400e9) if older_than is not None else None
            chosen += [r for r in store.runs_of(subject=subject, before_ns=before) if r not in named]
        if not chosen and subject is None:
            err.print("nothing to erase: give run ids, --subject or --older-than (or none matched)")
            raise typer.Exit(1 if older_than is not None else 2)
        try:
            with open_store(audit_db or db) as audit:
                present = store.stored_runs(chosen)
                gone = [r for r in named if r not in present]
                # gone from the store with no erasure in the trail (an erasure cut before it
                # was recorded, rows deleted by hand): recording it is what is left to do
                unrecorded = unrecorded_erasures(audit, gone)
                known = unrecorded | store.erased_runs(gone)
                unknown = [r for r in gone if r not in known]
                if unknown:
                    err.print(
                        f"[red]no run {escape(unknown[0])!r} in {escape(db)}[/] (erase takes whole run "
                        "ids: `stockade runs list` shows them)"
                    )
                    raise typer.Exit(2)
                store.check_erasable(sorted(present))  # a running run: nothing recorded, nothing erased
                chain = Chain(audit_key())
                if present or unrecorded:  # their erasure is recorded below: no row goes unless it can be
                    check_chain(audit.head(), chain, audit.ns)
                # the keys first: one the chain's key cannot record the erasure of stops it all
                sealed = audit.erase_keys(chain, run_ids=chosen, subject=subject)
                # the others' erasure in their trail too, before their rows go: verify tells it
                # from rows deleted behind the store's back (a sealed run's run_erased says it),
                # and an erasure cut after it is finished by erasing again
                now = time.time_ns()
                deleted = [
                    Draft(run_id=run, kind=EventKind.NOTE, actor="stockade", timestamp_ns=now,
                          attributes={"action": "delete"})
                    for run in sorted((present | unrecorded) - set(sealed))
                ]  # fmt: skip
                if deleted:
                    audit.append(deleted, chain)
                erased = store.erase(chosen)
            snapshots = SnapshotStore(snapshot_dir) if snapshot_dir is not None else SnapshotStore.default()
            kept = erase_run_snapshots(snapshots, chosen)
            approvals = ApprovalStore(approval_dir)
            for run_id in chosen:
                approvals.erase(run_id)
            paused = sum(_erase_paused_state(state_dir, run_id) for run_id in chosen)
        except exc.StockadeError as error:
            err.print(f"[red]{escape(str(error))}[/]")
            raise typer.Exit(2) from error
    if not erased and not sealed and not unrecorded and not kept and not paused:
        err.print(
            f"nothing to erase: no run of {escape(repr(subject))} in {escape(db)}"
            if not named
            else f"nothing to erase: {escape(', '.join(named))} erased already"
        )
        raise typer.Exit(1)
    out.print(
        f"erased {erased} run(s) from {escape(db)}"
        + (f", with the {kept} sandbox snapshot(s) they kept" if kept else "")
        + (f", the paused state of {paused}" if paused else "")
        + (
            f"; recorded the erasure of {len(unrecorded)} run(s) the store no longer had"
            if unrecorded
            else ""
        )
        + f"; the audit events of {len(sealed)} sealed run(s) "
        "can no longer be read (the chain keeps them, records the erasure and still verifies)"
    )


def _erase_paused_state(state_dir: Path, run_id: str) -> int:
    """Remove what `stockade agent` kept to resume the run (``<state-dir>/<run-id>``: its
    ``run.json`` and its copy of the workspace); 1 when there was one. A folder without
    ``run.json`` is not one, and stays: a --state-dir given wrong deletes nothing else."""
    if not run_id or "/" in run_id or run_id.startswith("."):  # never a folder `agent` made
        return 0
    folder = state_dir / run_id
    if folder.is_symlink() or not (folder / "run.json").is_file():
        return 0
    shutil.rmtree(folder)
    return 1
