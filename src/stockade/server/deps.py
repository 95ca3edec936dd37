"""The dependencies every route declares: the service, and the authenticated principal."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import anyio
from fastapi import Depends, Request

from stockade import exceptions as exc
from stockade.server.tenants import Principal, Tenants

HOP_HEADER = "x-stockade-hop"  # a request a peer API process forwarded: its value, our hop key
# Threads of their own for counting a call against its tenant's rate (a Redis round trip when
# the service has one): never the server's pool, which one tenant's long calls may fill.
ADMIT_THREADS = 16

if TYPE_CHECKING:
    from stockade.server.service import Service

__all__ = ["HOP_HEADER", "Caller", "authenticate", "get_service", "principal_of", "recheck"]


def get_service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


def principal_of(tenants: Tenants, authorization: str) -> Principal:
    """Who an ``Authorization`` header's token stands for; ``AuthenticationError`` when it has
    none, or one ``tenants`` does not know. In memory only: no I/O."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise exc.AuthenticationError(
            "this request has no API token: send `Authorization: Bearer stk_…` (make one with "
            "`stockade token new`)"
        )
    return tenants.authenticate(token.strip())


def _admit_limiter(request: Request) -> anyio.CapacityLimiter:
    state = request.app.state
    limiter: anyio.CapacityLimiter | None = getattr(state, "admit_limiter", None)
    if limiter is None:  # made in the app's event loop (anyio's limiters belong to one)
        limiter = state.admit_limiter = anyio.CapacityLimiter(ADMIT_THREADS)
    return limiter


async def authenticate(request: Request) -> Principal:
    """The request's principal, admitted by its tenant's rate limit; before any work is done.
    Async: FastAPI would run a plain function on the server's pool of threads, where one
    tenant's running calls would hold up every other tenant's requests. The principal is in
    memory (the tenants file is looked at at most once a second); the rate is counted on
    threads of its own."""
    service = get_service(request)
    principal = principal_of(service.tenants, request.headers.get("authorization", ""))
    hop = request.headers.get(HOP_HEADER)
    counted = hop is None or not service.sandboxes.is_peer(hop)  # a peer's forward was counted there
    if counted and service.limits.rate(principal.tenant) is not None:
        await anyio.to_thread.run_sync(service.limits.admit, principal, limiter=_admit_limiter(request))
    return principal


def recheck(request: Request, caller: Principal) -> None:
    """``AuthenticationError`` once the request's token no longer stands for ``caller`` (taken
    out of the tenants file, given a new secret, moved to another tenant, given another role
    or admin flag). A response that lasts (an event stream) asks it as it goes: a revoked or
    demoted token must not keep reading through a stream it opened before. In memory only,
    and not counted against the tenant's rate."""
    now = principal_of(get_service(request).tenants, request.headers.get("authorization", ""))
    if not now.stands_as(caller):
        role = f" under role {caller.role!r}" if caller.role else ""
        raise exc.AuthenticationError(
            f"the API token no longer stands for tenant {caller.tenant.id!r}{role}: open the stream again"
        )


Caller = Annotated[Principal, Depends(authenticate)]
