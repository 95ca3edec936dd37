"""What runs leave, over HTTP: a run's workspace diff and its final workspace (the artifacts,
kept once it ends, deleted on their own), the erasure of a run that ended (what it kept
leaves the tenant's ``storage_mb``), and the check of the tenant's audit trail with its runs'
ledger. Apart from the routes that submit and steer a run: these read or remove what a run
has written, and most act on a run that has ended.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from stockade import exceptions as exc
from stockade.audit.ledger import RunsLedger
from stockade.audit.verify import verify
from stockade.server.bodies import JSONRoute
from stockade.server.deps import Caller, get_service
from stockade.server.held import HeldResponse, held_bytes
from stockade.server.retention import erase_run
from stockade.server.run_views import blocking, owned_run
from stockade.server.tenants import Principal

__all__ = ["router"]

router = APIRouter(tags=["runs"], route_class=JSONRoute)


@router.get("/v1/runs/{run_id}/diff", summary="The run's workspace diff (at its end)",
            response_class=Response)  # fmt: skip
async def run_diff(run_id: str, request: Request, caller: Caller) -> Response:
    service = get_service(request)

    def work() -> str:
        owned_run(service, caller, run_id)
        trace = service.run_store.trace(run_id)
        return trace.diff or "" if trace is not None else ""

    return _held(
        request, caller, (await blocking(work)).encode(), "text/x-diff; charset=utf-8", "a run's diff"
    )


@router.get("/v1/runs/{run_id}/artifacts", summary="The run's final workspace (tar.gz)",
            response_class=Response)  # fmt: skip
async def run_artifacts(run_id: str, request: Request, caller: Caller) -> Response:
    service = get_service(request)

    def work() -> bytes:
        owned_run(service, caller, run_id)
        data = service.store.artifacts(run_id)
        if data is None:
            raise exc.ResourceNotFound(
                f"run {run_id} has no artifacts (yet): they are kept when it ends",
                kind="artifacts",
                id=run_id,
            )
        return data

    return _held(request, caller, await blocking(work), "application/gzip", "a run's artifacts")


def _held(request: Request, caller: Principal, data: bytes, media_type: str, what: str) -> Response:
    """``data`` as the response, counted against the tenant's ``bodies_mb`` until it is read."""
    hold = held_bytes(request).hold(caller.tenant, len(data), what=what)
    return HeldResponse.of(data, hold=hold, media_type=media_type)


@router.delete("/v1/runs/{run_id}/artifacts", status_code=204,
               summary="Delete a run's kept final workspace (its bytes leave your storage_mb)")  # fmt: skip
async def delete_run_artifacts(run_id: str, request: Request, caller: Caller) -> Response:
    service = get_service(request)

    def work() -> None:
        owned_run(service, caller, run_id)
        if not service.store.delete_artifacts(run_id):
            raise exc.ResourceNotFound(f"run {run_id} has no artifacts", kind="artifacts", id=run_id)

    await blocking(work)
    return Response(status_code=204)


@router.delete("/v1/runs/{run_id}", status_code=204,
               summary="Erase a run that ended (what it kept leaves your storage_mb)")  # fmt: skip
async def delete_run(run_id: str, request: Request, caller: Caller) -> Response:
    service = get_service(request)

    def work() -> None:
        row = owned_run(service, caller, run_id)
        actor = f"human:api-token/{caller.token_id}"
        if not erase_run(service, caller.tenant, row, actor=actor, attributes={"through": "api"}):
            raise exc.ResourceNotFound(f"no run {run_id!r}", kind="run", id=run_id)  # deleted meanwhile

    await blocking(work)
    return Response(status_code=204)


@router.get("/v1/audit/verify", tags=["audit"], summary="Verify your audit trail's hash chain")
async def verify_audit(request: Request, caller: Caller) -> dict[str, Any]:
    service = get_service(request)

    def work() -> dict[str, Any]:
        # It reads every event of the trail: one at a time per tenant (a second is a 429), so
        # a tenant asking many at once does not take every core from the others.
        with service.trail_checks.hold(caller.tenant.id, who=f"tenant {caller.tenant.id}"):
            log = service.audit.get(caller.tenant)
            log.flush()
            # Its runs' ledger too (a tool call in one and not the other is a problem): the runs
            # that ended, whose calls and events are all written.
            ledger = RunsLedger(service.run_store, service.store.run_ids(caller.tenant.id, ended=True))
            report = verify(log.store, key=service.config.audit_key, ledger=ledger)
            return {"ok": report.ok, "checked": report.checked, "summary": report.summary()}

    found: dict[str, Any] = await blocking(work)
    return found
