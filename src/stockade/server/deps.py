"""The dependencies every route declares: the service, and the authenticated principal."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from stockade import exceptions as exc
from stockade.server.tenants import Principal, Tenants

HOP_HEADER = "x-stockade-hop"  # a request a peer API process forwarded: its value, our hop key

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


def authenticate(request: Request) -> Principal:
    """The request's principal, admitted by its tenant's rate limit; before any work is done."""
    service = get_service(request)
    principal = principal_of(service.tenants, request.headers.get("authorization", ""))
    hop = request.headers.get(HOP_HEADER)
    if hop is None or not service.sandboxes.is_peer(hop):  # a peer's forward was counted there
        service.limits.admit(principal)
    return principal


def recheck(request: Request, caller: Principal) -> None:
    """``AuthenticationError`` once the request's token no longer stands for ``caller`` (taken
    out of the tenants file, given a new secret, moved to another tenant). A response that
    lasts (an event stream) asks it as it goes: a revoked token must not keep reading through
    a stream it opened before. In memory only, and not counted against the tenant's rate."""
    now = principal_of(get_service(request).tenants, request.headers.get("authorization", ""))
    if now.token_id != caller.token_id or now.tenant.id != caller.tenant.id:
        raise exc.AuthenticationError(
            f"the API token no longer stands for tenant {caller.tenant.id!r}: open the stream again"
        )


Caller = Annotated[Principal, Depends(authenticate)]
