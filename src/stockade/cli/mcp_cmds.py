"""``stockade mcp``: the agent tools as an MCP server, a sandbox per client session.

Its standard output is the protocol (stdio): everything it says goes to standard error.
"""

from __future__ import annotations

import enum
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from stockade import exceptions as exc
from stockade.cli._console import CliConsole, escape
from stockade.cli._numbers import checked
from stockade.cli._signals import Interrupted, held, interruptible, signal_name
from stockade.cli._signals import exit_code as signal_exit_code
from stockade.runtime.failures import DEFAULT_FAILURES
from stockade.sandbox import _registry
from stockade.server.body_limits import BODY_TIMEOUT_S, MIN_BODY_RATE
from stockade.types import Trust

if TYPE_CHECKING:
    from stockade.server.mcp_face import McpFace

err = CliConsole(stderr=True)


DEFAULT_DB = "sqlite:///.stockade/audit.db"


class TransportName(enum.StrEnum):
    STDIO = "stdio"
    HTTP = "http"


def mcp(
    transport: Annotated[
        TransportName,
        typer.Option("--transport", help="stdio (one client) or http (streamable HTTP, sessions)"),
    ] = TransportName.STDIO,
    policy: Annotated[
        Path | None, typer.Option("--policy", "-p", help="the policy file (TOML or YAML)")
    ] = None,
    role: Annotated[str | None, typer.Option("--role", help="a role of the policy")] = None,
    trust: Annotated[Trust | None, typer.Option("--trust", help="tightens the policy's trust level")] = None,
    tier: Annotated[str | None, typer.Option("--tier", "-t", help=_registry.NAMES)] = None,
    workspace: Annotated[
        Path | None,
        typer.Option("--workspace", "-w", help="a folder each session starts from (a copy of it)"),
    ] = None,
    audit_db: Annotated[
        str, typer.Option("--audit-db", envvar="STOCKADE_AUDIT_DB", help="the audit trail (and run store)")
    ] = DEFAULT_DB,
    runs_db: Annotated[
        str | None, typer.Option("--runs-db", help="the run store (default: --audit-db)")
    ] = None,
    rate: Annotated[
        int | None, typer.Option("--rate-per-minute", help="tool calls per rolling minute, all sessions")
    ] = None,
    spend_per_hour: Annotated[
        float | None,
        typer.Option(
            "--dollars-per-hour", help="model spend per rolling hour (the client's model costs nothing here)"
        ),
    ] = None,
    kill_target: Annotated[
        str | None, typer.Option("--kill-target", help="kill directory or redis://... (stockade kill)")
    ] = None,
    approval_wait: Annotated[
        float,
        typer.Option(
            "--approval-wait",
            help="seconds a call waits for `stockade approve` when the client cannot ask its user",
        ),
    ] = 300.0,
    max_steps: Annotated[int, typer.Option("--max-calls", help="tool calls in one session")] = 10_000,
    max_wall: Annotated[
        float, typer.Option("--max-session-s", help="seconds one session may last")
    ] = 86_400.0,
    max_denials: Annotated[
        int, typer.Option("--max-denials", help="denied calls in a row that end a session")
    ] = 3,
    max_invalid: Annotated[
        int,
        typer.Option(
            "--max-invalid-calls",
            min=0,
            help="calls a session may make that run nothing (an unknown tool, arguments that do not "
            "fit its schema or are over 256 KiB); one more ends it",
        ),
    ] = 100,
    max_failures: Annotated[
        int,
        typer.Option(
            "--max-failures", min=0, help='failed calls in a row that end a session "broken" (0: never)'
        ),
    ] = DEFAULT_FAILURES,
    host: Annotated[str, typer.Option("--host", help="http: the address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="http: the port")] = 8765,
    idle_timeout: Annotated[
        float, typer.Option("--idle-timeout", help="http: seconds before an unused session ends")
    ] = 1800.0,
    max_sessions: Annotated[
        int, typer.Option("--max-sessions", min=1, help="http: sessions open at once (each has a sandbox)")
    ] = 16,
    allow_origin: Annotated[
        list[str] | None,
        typer.Option("--allow-origin", help="http: a web page origin whose requests are let in (repeatable)"),
    ] = None,
    head_timeout: Annotated[
        float,
        typer.Option(
            "--head-timeout",
            min=0.001,
            help="http: seconds a connection has to send a request's line and headers (from its "
            "opening, or its previous response); then it is closed",
        ),
    ] = 10.0,
    keep_alive_timeout: Annotated[
        int, typer.Option("--keep-alive-timeout", min=1, help="http: seconds an idle connection is kept open")
    ] = 5,
    send_timeout: Annotated[
        float,
        typer.Option(
            "--send-timeout",
            min=0.001,
            help="http: seconds a client may read none of an answer waiting for it (an event stream's "
            "too); then its connection is reset",
        ),
    ] = 30.0,
    max_connections: Annotated[
        int,
        typer.Option(
            "--max-connections",
            min=1,
            help="http: connections open at once; one more closes the one waiting longest for its "
            "request's head, else resets the one stalled longest on a client that does not read, or "
            "is answered 503 and closed when there is neither (at most half of ulimit -n)",
        ),
    ] = 1000,
    max_per_address: Annotated[
        int | None,
        typer.Option(
            "--max-connections-per-address",
            min=1,
            help="http: connections one client address (IPv6: its /64) may hold at once, loopback too; "
            "one more is answered 503 and closed. Default: an eighth of --max-connections",
        ),
    ] = None,
    body_timeout: Annotated[
        float,
        typer.Option(
            "--body-timeout",
            min=0.001,
            help="http: seconds a request's body may take, plus its size at --min-body-rate; slower is 408",
        ),
    ] = BODY_TIMEOUT_S,
    min_body_rate: Annotated[
        int,
        typer.Option("--min-body-rate", min=1, help="http: bytes/s a body must come at after --body-timeout"),
    ] = MIN_BODY_RATE,
    token_env: Annotated[
        str,
        typer.Option(
            "--token-env",
            help="http: the environment variable holding the bearer token clients must send "
            "(required when --host is not this machine alone)",
        ),
    ] = "STOCKADE_MCP_TOKEN",
) -> None:
    """Serve the agent tools (run_code, run_tests, read_file, write_file, apply_patch,
    list_files, git_diff) to an MCP client: each client session gets a sandbox of its own under
    the policy, with its rate limit, kill switch and audit trail, recorded as a run
    (`stockade runs show`). Workspace files and the session's diff are resources. An action the
    policy sends for approval is asked through the client when it can ask its user, else it
    waits for `stockade approve` (up to --approval-wait seconds; then it is denied)."""
    import anyio
    import stamina.instrumentation

    from stockade.agent import RunLimits
    from stockade.assembly import AgentConfig
    from stockade.server.connections import ConnectionLimits
    from stockade.server.mcp_face import McpFace
    from stockade.server.mcp_http import LOOPBACK, MIN_TOKEN_CHARS, serve_http
    from stockade.server.mcp_session import MODEL_NAME, McpAgent
    from stockade.server.mcp_stdio import serve_stdio

    checked(idle_timeout, "--idle-timeout")
    checked(approval_wait, "--approval-wait", zero=True)
    checked(max_wall, "--max-session-s")
    checked(body_timeout, "--body-timeout")
    if spend_per_hour is not None:
        checked(spend_per_hour, "--dollars-per-hour")
    stamina.instrumentation.set_on_retry_hooks([])  # retries are in the audit trail; stdout is the protocol's
    token = (os.environ.get(token_env) or None) if transport is TransportName.HTTP else None
    if transport is TransportName.HTTP and token is None and host not in LOOPBACK:
        err.print(
            f"[red]error:[/] {escape(host)} is not this machine alone, and ${escape(token_env)} holds no "
            "token: whoever reached the endpoint would run code in sandboxes under this policy"
        )
        err.print(
            f"[cyan]fix:[/] export {escape(token_env)}=$(python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'); clients send Authorization: Bearer <it>"
        )
        raise typer.Exit(2)
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        err.print(f"[red]error:[/] ${escape(token_env)} is shorter than {MIN_TOKEN_CHARS} characters")
        raise typer.Exit(2)
    if workspace is not None and not workspace.is_dir():
        err.print(f"[red]error:[/] --workspace {escape(str(workspace))} is not a folder")
        raise typer.Exit(2)
    try:
        config = AgentConfig(
            model=MODEL_NAME,  # replaced by the client: see McpAgent
            policy=policy, role=role, trust=trust, tier=tier, audit=audit_db, runs_url=runs_db,
            # no token budget: the client's calls count none (its model is not ours to count)
            limits=RunLimits(
                max_steps=max_steps, max_wall_s=max_wall, max_denials=max_denials, max_malformed=max_invalid
            ),
            rate_per_minute=rate, dollars_per_hour=spend_per_hour, kill_target=kill_target,
            max_consecutive_failures=max_failures or None,
        )  # fmt: skip
        agent = McpAgent(config, workspace=workspace)
    except exc.StockadeError as error:
        err.print(f"[red]error:[/] {escape(str(error))}")
        for problem in getattr(error, "problems", ()):
            err.print(f"  {escape(problem)}")
        raise typer.Exit(2) from None
    face = McpFace(
        agent, transport=transport.value, approval_wait_s=approval_wait,
        idle_timeout_s=idle_timeout if transport is TransportName.HTTP else None,
    )  # fmt: skip
    where = f"http://{host}:{port}/mcp" if transport is TransportName.HTTP else "stdio"
    if token is not None:
        where += f" (bearer token from ${token_env})"
    err.print(
        f"[dim]stockade mcp on {escape(where)}: the {agent.agent.tier} tier "
        f"({escape(agent.agent.tier_reason)}), audited in {escape(audit_db)}[/]"
    )
    if transport is TransportName.HTTP:
        code = _served(
            face, lambda: serve_http(
                face, host=host, port=port, token=token, max_sessions=max_sessions,
                allowed_origins=tuple(allow_origin or ()),
                connections=ConnectionLimits(
                    head_timeout_s=head_timeout, keep_alive_s=keep_alive_timeout, send_timeout_s=send_timeout,
                    max_connections=max_connections, max_per_address=max_per_address,
                ),
                body_timeout_s=body_timeout, min_body_rate=float(min_body_rate),
            ),
        )  # fmt: skip
    else:
        code = _served(face, lambda: anyio.run(serve_stdio, face))
    if code:
        raise typer.Exit(code)


def _served(face: McpFace, serve: Callable[[], None]) -> int:
    """``serve()`` until its clients leave or a stop signal: the exit code; then every session's
    run ends and its sandbox is removed, whatever signal comes meanwhile (a client closes stdin,
    then signals: cut short, the close left the sandboxes behind)."""
    code = 0
    try:
        with interruptible():
            serve()
    except Interrupted as stop:
        err.print(f"[yellow]stockade mcp: stopped by {stop}[/]")
        code = signal_exit_code(stop.signum)  # as a shell reports a process the signal stopped
    except exc.RequestTooLarge as error:
        err.print(f"[red]error:[/] {escape(str(error))}")
        code = 1
    except BaseExceptionGroup as group:
        if not _client_gone(group):
            raise
        # its reply had nowhere to go; nothing is left to say on stdout (flushing it at exit
        # would raise once more)
        _stdout_to_null()
        err.print("[yellow]stockade mcp: the client went away (stdout closed); the session ended[/]")
    finally:
        with held() as late:
            face.close()
    if late and not code:
        err.print(f"[yellow]stockade mcp: stopped by {signal_name(late[0])} (after every session ended)[/]")
        code = signal_exit_code(late[0])
    return code


def _client_gone(group: BaseExceptionGroup[BaseException]) -> bool:
    """Whether every error of ``group`` is the client's end of the pipes closing."""
    import anyio

    gone = (BrokenPipeError, ConnectionResetError, anyio.ClosedResourceError, anyio.BrokenResourceError)
    rest = group.split(gone)[1]
    return rest is None


def _stdout_to_null() -> None:
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError):  # not a file (tests)
        pass


def register(app: typer.Typer) -> None:
    app.command("mcp")(mcp)
