"""``stockade audit verify | export | tail``: check and read the audit trail.

The store is ``--db`` (or ``STOCKADE_AUDIT_DB``): ``sqlite:///PATH``, a file path, or
``postgresql://...``. A keyed chain needs its key: ``--key-file`` or ``STOCKADE_AUDIT_KEY``.
``verify`` also cross-checks the chain with the run store's ledger (``--runs-db``; by default
the audit database, when it holds one).
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TextIO

import typer

from stockade import exceptions as exc
from stockade._config_file import audit_key
from stockade._display import visible, visible_json
from stockade._private import replace_private
from stockade._sqlite_reader import SQLiteReader
from stockade._state import sqlite_files, sqlite_path
from stockade.audit.events import AuditEvent
from stockade.audit.ledger import RunsLedger
from stockade.audit.postgres import PostgresStore
from stockade.audit.stores import AuditStore, open_store
from stockade.audit.verify import verify as verify_store
from stockade.cli._console import CliConsole, escape, print_json

if TYPE_CHECKING:
    from stockade.runs import RunStore

out = CliConsole()
err = CliConsole(stderr=True)

DEFAULT_DB = "sqlite:///.stockade/audit.db"
# How often `tail` reads its first events again while a writer keeps appending to the file
# (each read that saw the file change proves nothing; the next is read anew).
READS_WHILE_WRITTEN = 5

DbOpt = Annotated[
    str,
    typer.Option("--db", envvar="STOCKADE_AUDIT_DB", help="sqlite:///PATH, a file path, or postgresql://..."),
]
RunOpt = Annotated[str | None, typer.Option("--run", help="only this run id")]
KeyFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--key-file",
        help="file holding the chain's HMAC key: its bytes less one final line ending "
        "(else STOCKADE_AUDIT_KEY)",
    ),
]
NamespaceOpt = Annotated[str, typer.Option("--namespace", help="table prefix of the store")]


class ExportFormat(enum.StrEnum):
    JSONL = "jsonl"


def _has_audit_tables(path: Path, namespace: str) -> bool:
    """Whether a SQLite file holds an audit trail, asked read-only: opening a store would create
    its tables in whatever database the path names."""
    return _has_table(path, f"{namespace}_events")


# Exit codes of ``verify``: a store that cannot be read is neither a trail that verifies nor
# one that is absent (2: "nothing to verify", what a monitor takes for "no trail yet").
UNREADABLE = 3
_SQLITE_NOTADB = 26  # the file is no SQLite database: it holds no trail


@contextlib.contextmanager
def _exits(unreadable: tuple[type[exc.StockadeError], ...]) -> Iterator[None]:
    """A store's error as the command's exit: one of ``unreadable`` (a store that fails or
    lacks its tables: nothing proven) UNREADABLE, any other ``StockadeError`` 2."""
    try:
        yield
    except unreadable as error:
        err.print(f"[red]{escape(str(error))}[/]")
        raise typer.Exit(UNREADABLE) from error
    except exc.StockadeError as error:
        err.print(f"[red]{escape(str(error))}[/]")
        raise typer.Exit(2) from error


def _has_table(path: Path, table: str) -> bool:
    """Whether the SQLite file at ``path`` has ``table``; exits UNREADABLE where the file
    cannot be read (a full disk, an I/O error, a lock): that is no answer either way."""
    import sqlite3

    try:
        with contextlib.closing(SQLiteReader(path)) as db:
            found = db.query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,))
    except sqlite3.DatabaseError as error:
        if getattr(error, "sqlite_errorcode", None) == _SQLITE_NOTADB:
            return False
        err.print(f"[red]cannot read {escape(str(path))}[/]: {escape(str(error))}")
        raise typer.Exit(UNREADABLE) from error
    return bool(found)


def _store(db: str, namespace: str) -> AuditStore:
    path = sqlite_path(db)
    if path is not None:
        if not path.exists():
            err.print(f"[red]no audit store at {escape(str(path))}[/] (set --db or STOCKADE_AUDIT_DB)")
            raise typer.Exit(2)
        if not _has_audit_tables(path, namespace):
            err.print(
                f"[red]{escape(str(path))} holds no audit trail[/] (no {escape(namespace)}_events table; "
                "check --db and --namespace)"
            )
            raise typer.Exit(2)
    with _exits((exc.AuditStoreError,)):  # read-only: reading the trail must not create tables, or rows
        store = open_store(db, namespace=namespace, read_only=True)
        if isinstance(store, PostgresStore) and not store.has_trail():
            store.close()
            err.print(
                f"[red]the database holds no audit trail[/] (no {escape(namespace)}_events table; "
                "check --db and --namespace)"
            )
            raise typer.Exit(2)
    return store


# Exit code of ``export`` and ``tail`` at an event that cannot be read (edited around the store).
DAMAGED = 1


def _stop(error: exc.AuditError, after: str) -> typer.Exit:
    """Report why reading stopped: an event that is not one (1), or a store that fails (3)."""
    err.print(f"[red]stopped {after}[/]: {escape(str(error))}")
    return typer.Exit(UNREADABLE if isinstance(error, exc.AuditStoreError) else DAMAGED)


@contextlib.contextmanager
def _ledger(runs_db: str | None, db: str, namespace: str, key: bytes | None) -> Iterator[RunStore | None]:
    """The run store to cross-check with: ``--runs-db``, else the audit database if it has one
    (with the audit key, its rows' MACs are checked too)."""
    from stockade.runs import open_run_store

    url = runs_db or db
    if not _holds_run_store(url, namespace):
        if runs_db is not None:
            path = sqlite_path(url)
            where = (
                f"at {path}" if path is not None else f"in that database (no {namespace}_tool_calls table)"
            )
            err.print(f"[red]no run store {escape(where)}[/] (check --runs-db and --runs-namespace)")
            raise typer.Exit(2)
        yield None
        return
    with _exits((exc.RunStoreError,)):  # read-only: checking the evidence must not change it
        store = open_run_store(url, namespace=namespace, key=key, read_only=True)
    with store:
        yield store


def _holds_run_store(url: str, namespace: str) -> bool:
    """Whether the database at ``url`` has a run store of ``namespace`` to cross-check with,
    asked read-only; exits UNREADABLE where it cannot be asked (that is no answer either way)."""
    from stockade.runs.store import holds_run_store

    path = sqlite_path(url)
    if path is not None:
        return path.exists() and _has_table(path, f"{namespace}_tool_calls")
    with _exits((exc.RunStoreError,)):
        return holds_run_store(url, namespace=namespace)


def _tenant_ledger(ledger: RunStore, tenant: str) -> RunsLedger | None:
    """The ledger of ``tenant``'s runs, when the run store's database is a service's (its
    ``svc_runs`` says whose each run is) and ``tenant`` is one; else None."""
    if not tenant:
        return None
    try:
        rows = ledger.db.query("SELECT run_id FROM svc_runs WHERE tenant = ?", (tenant,))
    except Exception:  # no such table (SQLite's and PostgreSQL's errors differ): no service's
        return None
    return RunsLedger(ledger, frozenset(str(r[0]) for r in rows))


def _key(key_file: Path | None) -> bytes | None:
    return audit_key(key_file)


def verify(
    *,
    db: DbOpt = DEFAULT_DB,
    run: RunOpt = None,
    key_file: KeyFileOpt = None,
    namespace: NamespaceOpt = "audit",
    expect_head: Annotated[
        str | None,
        typer.Option("--expect-head", help="SEQ:HASH the chain must reach (kept outside the store)"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    runs_db: Annotated[
        str | None,
        typer.Option(
            "--runs-db",
            envvar="STOCKADE_RUNS_DB",
            help="the run store whose ledger the chain must agree with (default: --db, if it has one)",
        ),
    ] = None,
    runs_namespace: Annotated[
        str, typer.Option("--runs-namespace", help="table prefix of the run store")
    ] = "runs",
    tenant: Annotated[
        str | None,
        typer.Option(
            "--tenant",
            help="on a service's database: this tenant's trail (audit_t_TENANT), against its own runs",
        ),
    ] = None,
) -> None:
    """Check the hash chain: exit 0 when intact, 1 with the problems found (seq and what), 2 when
    there is nothing to verify (no trail, no events, no events of --run), 3 when the store
    cannot be read (a full disk, an I/O error: nothing proven either way). The tool calls of the
    run store's ledger and the chain's tool_call events must agree: a call in one and not the
    other is a problem (not_in_trail, not_in_ledger), and so is a call, or a run's final end,
    twice in the chain (duplicate_in_trail), and a call its run's process died during, until
    the run is resumed (in_flight). With the key, a run store row a resume acts on whose MAC
    is wrong or missing is a problem (store_forged), and so is a trail whose head says it is
    unkeyed (downgraded: rewritten without the key, or never keyed). A service keeps a chain
    per tenant and one run store for all: a tenant's trail (--tenant, or --namespace
    audit_t_TENANT) is checked against that tenant's runs only."""
    pinned: tuple[int, str] | None = None
    if expect_head is not None:
        seq, _, digest = expect_head.partition(":")
        if not seq.isdigit() or not digest or int(seq) >= 2**63:
            err.print("[red]--expect-head takes SEQ:HASH[/]")
            raise typer.Exit(2)
        pinned = (int(seq), digest)
    if tenant is not None:
        namespace = f"audit_t_{tenant}"
    key = _key(key_file)
    with _store(db, namespace) as store, _ledger(runs_db, db, runs_namespace, key) as ledger:
        owner = namespace.removeprefix("audit_t_") if namespace.startswith("audit_t_") else ""
        scoped = _tenant_ledger(ledger, owner) if ledger is not None else None
        if tenant is not None and scoped is None:
            err.print(f"[red]{escape(db)} holds no service's runs[/]: --tenant needs a service's database")
            raise typer.Exit(2)
        with _exits((exc.AuditStoreError, exc.RunStoreError)):  # a store failed mid-way: nothing proven
            report = verify_store(store, run_id=run, key=key, expected_head=pinned, ledger=scoped or ledger)
    if as_json:
        print_json(
            {
                "ok": report.ok and report.found,
                "found": report.found,
                "checked": report.checked,
                "algorithm": report.algorithm,
                "head": {"seq": report.last_seq, "hash": report.last_hash},
                "run_id": report.run_id,
                "run_events": report.run_events,
                "problems": [
                    {"seq": p.seq, "kind": p.kind.value, "detail": p.detail} for p in report.problems
                ],
                "ledger": ledger is not None,
                "problems_elsewhere": report.problems_elsewhere,
            }
        )
    else:
        colour = "green" if report.ok and report.found else "red"
        out.print(f"[{colour}]{escape(report.summary())}[/]")
        out.print(f"head: {report.last_seq}:{report.last_hash}")
        if ledger is None:
            out.print("no run store in the database: tool calls not cross-checked (--runs-db names one)")
        for problem in report.problems:
            out.print(f"  [red]seq {problem.seq}[/] {problem.kind.value}: {escape(problem.detail)}")
        if report.problems_elsewhere:
            out.print(f"  ({report.problems_elsewhere} problem(s) in other runs)")
    if not report.ok:
        raise typer.Exit(1)
    if not report.found:
        err.print(
            f"[red]nothing to verify:[/] no events of run {escape(run)}" if run is not None and report.checked
            else "[red]nothing to verify:[/] the audit trail is empty"
        )  # fmt: skip
        raise typer.Exit(2)


def _write(event: AuditEvent, stream: TextIO) -> None:
    # the same JSON with its lone surrogates (an exec's argv of bytes that are no UTF-8), controls,
    # bidi and invisible characters as JSON escapes: UTF-8 writes it, a terminal shows it
    stream.write(visible_json(json.dumps(event.to_json(), ensure_ascii=False, separators=(",", ":"))) + "\n")


def export(
    *,
    db: DbOpt = DEFAULT_DB,
    run: RunOpt = None,
    format: Annotated[ExportFormat, typer.Option("--format", help="output format")] = ExportFormat.JSONL,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="file to write (default: stdout)")
    ] = None,
    after: Annotated[int, typer.Option("--after", help="only events after this seq")] = 0,
    namespace: NamespaceOpt = "audit",
) -> None:
    """Write events as JSON Lines (one event per line, with its hash) for a SIEM. The output
    file takes its name once the export is done (one that cannot start leaves it as it was; a
    store damaged part way still has the events read before it written, and exits 1), and is
    never the database itself, nor its -wal, -shm or -journal."""
    if output is not None:
        _refuse_own_file(output, db)
    written, last = 0, after
    failure: exc.AuditError | None = None
    with _store(db, namespace) as store, _output(output) as stream:  # as private as the store
        try:
            for event in store.events(run_id=run, after_seq=after):
                _write(event, stream)
                written, last = written + 1, event.seq
        except exc.AuditError as error:  # the events read so far are written, and the cut said
            failure = error
    if failure is not None:  # never end as if whole
        raise _stop(failure, f"after seq {last} ({written} events exported)") from failure


@contextlib.contextmanager
def _output(output: Path | None) -> Iterator[TextIO]:
    if output is None:
        yield sys.stdout
    else:
        with replace_private(output) as stream:
            yield stream


def _refuse_own_file(output: Path, db: str) -> None:
    """Exit 2 when ``output`` is the SQLite database ``db`` or one of its files, by name or
    as the same file (a symlink, a hard link): the export would replace what it reads."""
    path = sqlite_path(db)
    if path is None:
        return
    names = {os.path.realpath(p) for base in (path, Path(os.path.realpath(path))) for p in sqlite_files(base)}
    same = os.path.realpath(output) in names
    for name in names:
        with contextlib.suppress(OSError):
            same = same or os.path.samefile(output, name)
    if same:
        err.print(
            f"[red]--output {escape(str(output))} is the audit database {escape(str(path))} or one of its "
            "files[/]: the export would replace what it reads; write it elsewhere"
        )
        raise typer.Exit(2)


def _line(event: AuditEvent) -> str:
    duration = "" if event.duration_s is None else f" {event.duration_s * 1000:.1f}ms"
    # what code chose (U+009B, an 8-bit CSI, cleared the screen) is shown, never acted on
    attrs = visible_json(json.dumps(event.attributes, ensure_ascii=False, separators=(",", ":")))
    when = event.timestamp.strftime("%Y-%m-%d %H:%M:%S")
    who = visible(f"{event.run_id} #{event.step} {event.actor}", one_line=True)
    return f"{event.seq:>8} {when} {who} {event.kind.value}{duration} {attrs}"


def tail(
    *,
    db: DbOpt = DEFAULT_DB,
    run: RunOpt = None,
    lines: Annotated[
        int, typer.Option("-n", "--lines", min=0, max=1_000_000, help="how many of the last events")
    ] = 20,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing new events")] = False,
    interval: Annotated[float, typer.Option("--interval", help="seconds between polls with --follow")] = 0.5,
    namespace: NamespaceOpt = "audit",
) -> None:
    """The last events, one line each (unverified: use `stockade audit verify` to trust them)."""
    with _store(db, namespace) as store:
        last: deque[AuditEvent] = deque(maxlen=lines)
        failure: exc.AuditError | None = None
        for _ in range(READS_WHILE_WRITTEN):
            last.clear()
            failure = None
            try:
                head = store.head()
                start = 0 if run is not None or head is None else max(0, head.seq - lines)
                last.extend(store.events(run_id=run, after_seq=start))
            except exc.AuditStoreChanged as error:  # a writer appended meanwhile: read again
                failure = error
                continue
            except exc.AuditError as error:  # show what was read before it, then why it stopped
                failure = error
            break
        seen = 0
        for event in last:
            print(_line(event))
            seen = event.seq
        sys.stdout.flush()  # a pipe (tail -f | grep) must see these before the first new event
        if failure is not None:
            raise _stop(failure, f"after seq {seen}")
        while follow:
            time.sleep(interval)
            try:
                for event in store.events(run_id=run, after_seq=seen):
                    print(_line(event), flush=True)
                    seen = event.seq
            except exc.AuditStoreChanged:
                continue  # what tail follows is written: the next poll reads on from `seen`
            except exc.AuditError as error:
                raise _stop(error, f"after seq {seen}") from error


def register(app: typer.Typer) -> None:
    group = typer.Typer(name="audit", help="Verify, export and read the audit trail.", no_args_is_help=True)
    group.command("verify")(verify)
    group.command("export")(export)
    group.command("tail")(tail)
    app.add_typer(group)
