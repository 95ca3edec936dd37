"""``stockade serve`` (the HTTP API), ``stockade worker`` (a Celery worker for its runs),
``stockade token new`` (an API token for a tenant and role) and ``stockade workspaces``
(the operator's view of the uploaded workspaces: a workspace is the role's that uploaded it,
and one kept before that names none, which no token of a tenant with roles reaches)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from stockade import exceptions as exc
from stockade._config_file import audit_key, read_config_text
from stockade._state import sqlite_path
from stockade.cli._console import CliConsole, escape, print_json
from stockade.server.body_limits import BODY_TIMEOUT_S, MIN_BODY_RATE

if TYPE_CHECKING:
    from stockade.server.state.store import ServiceStore

out = CliConsole()
err = CliConsole(stderr=True)

TenantsOption = Annotated[
    Path,
    typer.Option("--tenants", envvar="STOCKADE_TENANTS", help="the tenants file (TOML): tenants, tokens"),
]
DbOption = Annotated[
    str,
    typer.Option("--db", envvar="STOCKADE_DB", help="sqlite:///PATH (embedded) or postgresql://... (shared)"),
]
ToolsOption = Annotated[
    str | None, typer.Option("--tools", help="MODULE:ATTRIBUTE of a Toolset replacing the default tools")
]
QueueOption = Annotated[
    str, typer.Option("--queue", envvar="STOCKADE_QUEUE", help="the Celery queue (and Redis key prefix)")
]
SnapshotDirOption = Annotated[
    Path | None,
    typer.Option(
        "--snapshot-dir", envvar="STOCKADE_SERVICE_SNAPSHOT_DIR",
        help="the tenants' snapshots, paused sandboxes and paused runs' sandboxes (a folder per tenant); "
        "processes that share it restore each other's (default: snapshots/ beside a SQLite --db, else "
        ".stockade/snapshots)",
    ),
]  # fmt: skip
VisibilityOption = Annotated[
    float,
    typer.Option(
        "--visibility-timeout", help="seconds before Redis gives an unfinished run to another worker"
    ),
]

MaxAttemptsOption = Annotated[
    int,
    typer.Option(
        "--max-attempts", min=1, envvar="STOCKADE_MAX_ATTEMPTS",
        help="failed attempts of a run (its worker died, a sandbox would not start) before it ends error",
    ),
]  # fmt: skip


def _config(tenants: Path, db: str, redis: str | None, **options: object) -> object:
    from stockade.server import ServiceConfig, TenantsFile

    # the file is followed: a token taken out of it is refused within a second, without a restart
    return ServiceConfig(
        tenants=TenantsFile(tenants), database=db, redis=redis or None,
        audit_key=audit_key(), **options,  # type: ignore[arg-type]
    )  # fmt: skip


def serve(
    tenants: TenantsOption,
    db: DbOption = "sqlite:///.stockade/service.db",
    redis: Annotated[
        str | None,
        typer.Option("--redis", envvar="STOCKADE_REDIS", help="redis://...: runs go to `stockade worker`s"),
    ] = None,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535)] = 8080,
    run_threads: Annotated[int, typer.Option("--run-threads", help="runs at once, without Redis")] = 2,
    idle_timeout: Annotated[
        float, typer.Option("--idle-timeout", help="seconds before an unused sandbox is closed")
    ] = 300.0,
    tools: ToolsOption = None,
    visibility_timeout: VisibilityOption = 3600.0,
    queue: QueueOption = "stockade",
    max_attempts: MaxAttemptsOption = 20,
    advertise_url: Annotated[
        str | None,
        typer.Option(
            "--advertise-url", envvar="STOCKADE_ADVERTISE_URL",
            help="where the other API processes reach this one (default: http://HOST:PORT)",
        ),
    ] = None,
    snapshot_dir: SnapshotDirOption = None,
    prepare: Annotated[
        list[str] | None,
        typer.Option(
            "--prepare", metavar="TIER",
            help="at start, build TIER's start images for each tenant's policy (microvm: ready images)",
        ),
    ] = None,
    keep_runs_days: Annotated[
        float | None,
        typer.Option(
            "--keep-runs-days", min=0.0001,
            help="erase runs that ended longer ago (for tenants whose entry has no keep_runs_days); "
            "default: kept until deleted",
        ),
    ] = None,
    head_timeout: Annotated[
        float,
        typer.Option(
            "--head-timeout", min=0.001,
            help="seconds a connection has to send a request's line and headers (from its opening, "
            "or its previous response); then it is closed",
        ),
    ] = 10.0,
    keep_alive_timeout: Annotated[
        int, typer.Option("--keep-alive-timeout", min=1, help="seconds an idle connection is kept open")
    ] = 5,
    send_timeout: Annotated[
        float,
        typer.Option(
            "--send-timeout", min=0.001,
            help="seconds a client may read none of an answer waiting for it (an event stream's too); "
            "then its connection is reset",
        ),
    ] = 30.0,
    max_connections: Annotated[
        int,
        typer.Option(
            "--max-connections", min=1,
            help="connections open at once; one more closes the one waiting longest for its request's "
            "head, else resets the one stalled longest on a client that does not read, or is answered "
            "503 and closed when there is neither (at most half of the process's file descriptors, "
            "ulimit -n: the rest stay for sandboxes and the database)",
        ),
    ] = 1000,
    max_per_address: Annotated[
        int | None,
        typer.Option(
            "--max-connections-per-address", min=1,
            help="connections one client address (IPv6: its /64) may hold at once, loopback too; one "
            "more is answered 503 and closed. Default: an eighth of --max-connections. Behind a reverse "
            "proxy every connection is the proxy's: raise it to --max-connections",
        ),
    ] = None,
    body_timeout: Annotated[
        float,
        typer.Option(
            "--body-timeout", min=0.001,
            help="seconds a request's body may take, plus its size at --min-body-rate; slower is 408",
        ),
    ] = BODY_TIMEOUT_S,
    min_body_rate: Annotated[
        int,
        typer.Option("--min-body-rate", min=1, help="bytes/s a body must come at after --body-timeout"),
    ] = MIN_BODY_RATE,
    docs: Annotated[
        bool,
        typer.Option(
            "--docs",
            help="serve the interactive API docs (/docs, /redoc): their pages load scripts from a CDN "
            "(cdn.jsdelivr.net) that then run on the API's origin, beside the run viewer and its "
            "cookie; off, /openapi.json is still served",
        ),
    ] = False,
) -> None:  # fmt: skip
    """Serve the API: sandboxes and runs for the tenants of TENANTS. Without --redis every run
    runs in this process (SQLite is enough); with it, runs go to `stockade worker` processes
    (use a PostgreSQL --db that they share). Several servers may share one database: a
    request for a sandbox reaches the server that holds it (--advertise-url)."""
    from stockade.server import ConnectionLimits
    from stockade.server import serve as run_server

    try:
        connections = ConnectionLimits(
            head_timeout_s=head_timeout, keep_alive_s=keep_alive_timeout, send_timeout_s=send_timeout,
            max_connections=max_connections, max_per_address=max_per_address,
        )  # fmt: skip
        config = _config(
            tenants, db, redis, run_threads=run_threads, sandbox_idle_timeout_s=idle_timeout, tools=tools,
            visibility_timeout_s=visibility_timeout, queue=queue, advertise_url=advertise_url,
            max_attempts=max_attempts, snapshot_dir=snapshot_dir, prepare_tiers=tuple(prepare or ()),
            docs=docs,
            keep_runs_days=keep_runs_days, body_timeout_s=body_timeout, min_body_rate=float(min_body_rate),
        )  # fmt: skip
        mode = (
            f"runs on workers through {redis}" if redis else f"runs in this process ({run_threads} at a time)"
        )
        described = "API docs at /docs" if docs else "OpenAPI at /openapi.json (--docs for /docs)"
        err.print(
            f"[dim]stockade serve on {escape(f'http://{host}:{port}')} ({escape(mode)}); {described}[/]"
        )
        run_server(config, host=host, port=port, connections=connections)  # type: ignore[arg-type]
    except exc.StockadeError as error:
        err.print(f"[red]error:[/] {escape(str(error))}")
        for problem in getattr(error, "problems", ()):
            err.print(f"  {escape(problem)}")
        raise typer.Exit(2) from None


def worker(
    tenants: TenantsOption,
    redis: Annotated[str, typer.Option("--redis", envvar="STOCKADE_REDIS", help="the broker: redis://...")],
    db: DbOption = "sqlite:///.stockade/service.db",
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", help="runs at once")] = 2,
    pool: Annotated[str, typer.Option("--pool", help="prefork, threads or solo")] = "prefork",
    name: Annotated[
        str | None, typer.Option("--name", help="the worker's name (default: host and pid)")
    ] = None,
    tools: ToolsOption = None,
    visibility_timeout: VisibilityOption = 3600.0,
    queue: QueueOption = "stockade",
    max_attempts: MaxAttemptsOption = 20,
    snapshot_dir: SnapshotDirOption = None,
) -> None:
    """Run the service's runs (Celery over Redis). A run whose worker dies resumes on another
    from its last recorded step; the database (--db, PostgreSQL) must be the server's. A run
    paused for an approval keeps its sandbox under --snapshot-dir: a worker that shares that
    folder resumes it with its sandbox, another with its files."""
    try:
        from stockade.distributed.worker import run_worker
    except ModuleNotFoundError as missing:
        err.print(f'[red]error:[/] {escape(str(missing))}: pip install "stockade\\[celery,server,postgres]"')
        raise typer.Exit(2) from None
    try:
        config = _config(
            tenants, db, redis, tools=tools, visibility_timeout_s=visibility_timeout, queue=queue,
            snapshot_dir=snapshot_dir, max_attempts=max_attempts,
        )  # fmt: skip
        run_worker(config, concurrency=concurrency, pool=pool, name=name)  # type: ignore[arg-type]
    except exc.StockadeError as error:
        err.print(f"[red]error:[/] {escape(str(error))}")
        raise typer.Exit(2) from None


token_app = typer.Typer(help="API tokens of the service's tenants", no_args_is_help=True)


@token_app.command("new")
def token_new(
    tenant: Annotated[str, typer.Option("--tenant", help="the tenant the token acts for")],
    role: Annotated[str | None, typer.Option("--role", help="a role of the tenant's policy")] = None,
    append: Annotated[
        Path | None, typer.Option("--append", help="add the token's record to this tenants file")
    ] = None,
    admin: Annotated[
        bool, typer.Option("--admin", help="an operator's token: it may kill every tenant's runs")
    ] = False,
) -> None:
    """Make a token: it is printed once (keep it); the tenants file keeps only its hash."""
    from stockade.server.tenants import TENANT_ID, Tenants, new_token

    if not TENANT_ID.match(tenant):
        err.print(f"[red]error:[/] tenant id {escape(repr(tenant))} must match {escape(TENANT_ID.pattern)}")
        raise typer.Exit(2)
    token, record = new_token(tenant, role, admin=admin)
    lines = Tenants(tenants={}, tokens={}).toml_lines(record)
    if append is not None:
        # the file as it would be, loaded first: a token `serve` would refuse the whole file for
        # (an unknown tenant or role) is not appended to a file that loads. A file still being
        # written (missing, or not loading yet) takes it, said.
        before = read_config_text(append, what="the tenants file") if append.exists() else None
        problem = _load_problem((before or "") + "\n" + lines, append)
        if problem is not None:
            if before is not None and _load_problem(before, append) is None:
                err.print(
                    f"[red]error:[/] nothing appended, the tenants file would not load: {escape(problem)}"
                )
                raise typer.Exit(2)
            err.print(f"[yellow]the tenants file did not load before this token either:[/] {escape(problem)}")
        with append.open("a", encoding="utf-8") as file:
            file.write("\n" + lines)
    else:
        err.print("[dim]add to the tenants file:[/]")
        err.print(escape(lines), end="")
    print(token)


def _load_problem(text: str, path: Path) -> str | None:
    """Why a tenants file of ``text`` at ``path`` would not load; None when it would."""
    from stockade.server.tenants import Tenants

    try:
        Tenants.parse(text, path=path)
    except exc.StockadeError as error:
        return str(error)
    return None


workspaces_app = typer.Typer(
    help="Uploaded workspaces in the service's database, every role's (the operator's view)",
    no_args_is_help=True,
)


def _text_tenant(value: str) -> str:
    try:
        value.encode()
    except UnicodeEncodeError:  # bytes the shell passed that are no UTF-8 (a lone surrogate here)
        raise typer.BadParameter("a tenant is text (UTF-8); this holds bytes that are not") from None
    return value


TenantOption = Annotated[
    str, typer.Option("--tenant", help="the tenant whose workspaces", callback=_text_tenant)
]


def _service_store(db: str) -> ServiceStore:
    """The service's tables in ``db``, which must exist: a mistyped path is refused, not made
    (an empty database, and its folders, reported as a tenant without workspaces)."""
    from stockade.server.state.schema import open_database
    from stockade.server.state.store import ServiceStore

    path = sqlite_path(db)
    if path is not None and not path.is_file():
        err.print(f"[red]error:[/] no service database at {escape(str(path))}")
        err.print("[cyan]fix:[/] give --db (or STOCKADE_DB) as `stockade serve` was given it")
        raise typer.Exit(2)
    try:
        return ServiceStore(open_database(db))
    except exc.StockadeError as error:
        err.print(f"[red]error:[/] {escape(str(error))}")
        raise typer.Exit(2) from None


NoRoleOption = Annotated[
    bool,
    typer.Option(
        "--no-role",
        help="the workspaces that name no role: a role-less token's, or uploaded before workspaces "
        "were a role's (a tenant whose policy has roles: what none of its tokens reaches)",
    ),
]


@workspaces_app.command("list")
def workspaces_list(
    db: DbOption, tenant: TenantOption, no_role: NoRoleOption = False,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON list")] = False,
) -> None:  # fmt: skip
    """The tenant's uploaded workspaces, newest first: id, the role that uploaded it, size."""

    store = _service_store(db)
    try:
        rows = [r for r in store.all_workspaces(tenant) if not no_role or r[1] is None]
    finally:
        store.close()
    if as_json:
        print_json([{"id": d, "role": role, "bytes": size, "uploaded_ns": ns} for d, role, size, ns in rows])
        return
    for digest, role, size, _ in rows:
        out.print(f"{escape(digest)}  {escape(role or '-')}  {size:,} bytes")


@workspaces_app.command("delete")
def workspaces_delete(
    db: DbOption, tenant: TenantOption, no_role: NoRoleOption = False,
    ids: Annotated[list[str] | None, typer.Argument(help="workspace ids that name no role")] = None,
) -> None:  # fmt: skip
    """Delete workspaces that name no role (a role's own are its tokens' to delete: DELETE
    /v1/workspaces/ID); their bytes leave the tenant's storage_mb. One a run of the tenant
    that has not ended starts from is left, said."""
    if not ids and not no_role:
        err.print("[red]error:[/] name the workspaces to delete, or give --no-role")
        raise typer.Exit(2)
    store = _service_store(db)
    try:
        role_less = [r[0] for r in store.all_workspaces(tenant) if r[1] is None]
        chosen = list(dict.fromkeys([*(ids or ()), *(role_less if no_role else ())]))
        used = {r.spec.get("workspace") for r in store.open_runs(tenant)}
        failed = 0
        for digest in chosen:
            if digest in used:  # a run submitted before workspaces had a role may start from it
                err.print(f"[red]error:[/] {escape(digest)} is the start of a run that has not ended; left")
            elif digest not in role_less or not store.delete_workspace(tenant, None, digest):
                err.print(
                    f"[red]error:[/] tenant {escape(tenant)} has no workspace {escape(digest)} of no role"
                )
            else:
                out.print(f"deleted {escape(digest)}")
                continue
            failed += 1
    finally:
        store.close()
    out.print(f"{len(chosen) - failed} workspace(s) deleted")
    if failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.command("worker")(worker)
    app.add_typer(token_app, name="token")
    app.add_typer(workspaces_app, name="workspaces")
