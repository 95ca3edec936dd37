"""The FastAPI application: routes, the problem handlers, and the service's lifetime."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from stockade import __version__
from stockade import exceptions as exc
from stockade.server import problems
from stockade.server.bodies import BodyCap
from stockade.server.guard import RequestGuard
from stockade.server.held import HeldBytes
from stockade.server.routing import Peers, SandboxRouting
from stockade.server.run_controls import router as run_controls_router
from stockade.server.run_events import router as run_events_router
from stockade.server.run_records import router as run_records_router
from stockade.server.runs import router as runs_router
from stockade.server.sandbox_files import router as sandbox_files_router
from stockade.server.sandboxes import router as sandboxes_router
from stockade.server.service import Service
from stockade.server.snapshots import router as snapshots_router
from stockade.server.viewer import ServiceAuth, ViewerHeaders, viewer_router
from stockade.server.workspaces import router as workspaces_router

__all__ = ["create_app"]

log = logging.getLogger("stockade.server")
PROBLEM = "application/problem+json"
# Blocking calls (sandbox ops, the database) run on threads: enough for a few hundred clients.
THREADS = 256


def _unparsed_why(cause: BaseException | None) -> str:
    """Why FastAPI's parser gave up on a body, as far as what it raised tells."""
    if isinstance(cause, RecursionError):
        return " (JSON nested too deeply)"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        limit = sys.get_int_max_str_digits()
        return f" (a JSON number of over {limit:,} digits: Python's limit for reading an integer)"
    return ""


def _respond(problem: problems.Problem) -> Response:
    return Response(
        content=problem.content(),
        status_code=problem.status,
        media_type=PROBLEM,
        headers=dict(problem.headers),
    )


def create_app(service: Service) -> FastAPI:
    """The API over ``service``; the app starts and closes it with its own lifetime."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = THREADS
        service.start()
        try:
            yield
        finally:
            await peers.aclose()
            await anyio.to_thread.run_sync(service.close)

    # the interactive docs' pages run a CDN's scripts on this origin, where the viewer's
    # cookie is: only when asked for (ServiceConfig.docs)
    docs = service.config.docs
    app = FastAPI(
        title="stockade",
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        version=__version__,
        summary="Sandboxes and agent runs for untrusted, model-written code, per tenant.",
        description=(
            "Every /v1 request needs `Authorization: Bearer <token>`. Errors are RFC 9457 problem "
            "documents (`application/problem+json`) naming the field at fault and the fix. Command "
            "output streams as NDJSON; a run's events as Server-Sent Events."
        ),
        lifespan=lifespan,
        responses={
            401: {"description": "no token, or a wrong one", "content": {PROBLEM: {}}},
            404: {"description": "no such thing, or not yours", "content": {PROBLEM: {}}},
            422: {
                "description": "a field is wrong: the problem names it and the fix",
                "content": {PROBLEM: {}},
            },
        },
    )
    peers = Peers()
    app.state.service = service
    app.state.peers = peers
    app.add_middleware(SandboxRouting, service=service, peers=peers)  # a sandbox held by a peer: there
    viewer = viewer_router(ServiceAuth(service))  # the run viewer, /ui
    # the run routes in the order they were one router's (the OpenAPI page lists them so)
    run_routers = (workspaces_router, runs_router, run_events_router, run_controls_router, run_records_router)
    routers = (sandboxes_router, sandbox_files_router, snapshots_router, *run_routers, viewer)
    # outermost: a body is bounded before a route or a peer sees it
    routes = [route for router in routers for route in router.routes]
    app.add_middleware(BodyCap, limit=service.config.max_request_bytes, routes=routes)
    # before that: a /v1 request without a known token is refused from its headers, and a
    # body that takes too long is cut (408)
    config = service.config
    # each tenant's bytes in flight (request bodies, responses not yet read), at most its bodies_mb
    app.state.held_bytes = held = HeldBytes()
    app.add_middleware(
        RequestGuard, service=service, grace_s=config.body_timeout_s, min_rate=config.min_body_rate, held=held
    )
    app.add_middleware(ViewerHeaders)  # outermost: the viewer's headers on every answer under /ui
    for router in routers:
        app.include_router(router)

    @app.exception_handler(exc.StockadeError)
    async def stockade_error(request: Request, error: exc.StockadeError) -> Response:
        problem = problems.from_error(error, request.url.path)
        if problem.status >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, error)
        return _respond(problem)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> Response:
        # FastAPI's errors as they are: no copy, nor its jsonable_encoder over them all
        return _respond(problems.from_validation(error.errors(), request.url.path))

    routes_at = "/docs" if docs else "/openapi.json"

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        if error.status_code == 400:  # FastAPI's own: a body its parser gave up on
            unparsed = {"type": "json_invalid", "msg": f"{error.detail}{_unparsed_why(error.__cause__)}"}
            return _respond(problems.from_validation([unparsed], request.url.path))
        body = problems.problem_body(
            status=error.status_code, type_="about:blank", title=str(error.detail), detail=str(error.detail),
            instance=request.url.path,
            fix=f"see {routes_at} for the API's routes" if error.status_code in (404, 405) else "",
        )  # fmt: skip
        return Response(
            content=problems.Problem(status=error.status_code, body=body, headers={}).content(),
            status_code=error.status_code, media_type=PROBLEM, headers=dict(error.headers or {}),
        )  # fmt: skip

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, error: ClientDisconnect) -> Response:
        # the body stopped mid-way: its client went, or the guard answered in the app's place
        # (408, 429) and closed the connection; no one hears this answer, and nothing failed
        return Response(status_code=400)

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path)
        problem = problems.from_error(
            exc.StockadeError(f"internal error ({type(error).__name__}); the server's log has the details"),
            request.url.path,
        )
        return _respond(problem)

    @app.get("/healthz", tags=["service"], summary="Alive (no token needed)")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "version": __version__, "mode": "embedded" if service.embedded else "distributed"}

    @app.get("/problems/{slug}", tags=["service"], summary="What a problem type means")
    async def problem_type(slug: str) -> JSONResponse:
        described = problems.describe(slug)
        if described is None:
            raise exc.ResourceNotFound(f"no problem type {slug!r}", kind="problem", id=slug)
        return JSONResponse(described)

    return app
