"""Runs over HTTP: submit an agent task, list your runs, read one. A run is its role's
(``owns``, ``run_views.py``): to another role of its tenant it is no run (404), its events,
approvals, diff and artifacts with it, since its sandbox held what that role's policy let in;
the kill switch (``POST /v1/runs/kill``) still stops every live run of the tenant. A
submission is checked against what the role allows before the run is queued.

What a run keeps in the database counts against its tenant's ``storage_mb``: its spec from
its submission (one that does not fit is refused), its rows in the run store from each time
it stops; ``DELETE /v1/runs/{id}`` erases a run that ended, and frees them.

The other run routes, each a router of its own, included after this one in this order: a
run's live events (``run_events.py``), its controls (approvals, kill, resume:
``run_controls.py``) and what it leaves (diff, artifacts, erasure, the trail's check:
``run_records.py``); the workspaces runs start from (``workspaces.py``) come before it.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from stockade import exceptions as exc
from stockade.server.authz import (
    check_acceptance_check,
    check_model,
    check_run_rules,
    choose_tier,
    engine_for,
)
from stockade.server.bodies import JSONRoute
from stockade.server.deps import Caller, get_service
from stockade.server.run_spec import build_model, run_limits
from stockade.server.run_views import blocking, owned_run, owns, run_out, runs_quota
from stockade.server.schemas import RunOut, RunSubmit
from stockade.server.service import Service
from stockade.server.tenants import Principal, check_share
from stockade.types import Limits, MiB

__all__ = ["router"]

router = APIRouter(tags=["runs"], route_class=JSONRoute)


def _authorise(service: Service, caller: Principal, body: RunSubmit) -> None:
    """What the role allows, asked before the run is queued: the model, the tier, the workspace,
    the acceptance check (as the role running it through the sandbox API), the sandbox rules the
    role's policy gives (no tier holds some: ``check_run_rules``); and the run's limits, as its
    start would take them."""
    run_limits(body)
    engine = engine_for(caller, body.trust)
    check_run_rules(engine)
    model = build_model(body)  # a model spec that cannot be resolved fails here, not on a worker
    check_model(engine, model.name, model.provider)
    if body.check is not None:
        check_acceptance_check(engine, body.check)
    if body.tier is not None:
        choose_tier(engine, body.tier)
    elif not engine.allowed_tiers():
        raise exc.PolicyDenied(f"role {caller.role!r} may use no tier", rule=f"roles.{caller.role}.tiers")
    share = body.sandbox_limits.build() if body.sandbox_limits is not None else Limits()
    check_share(caller.tenant, share, what="the run's sandbox")  # past them it would wait for ever
    if body.workspace is not None and (
        service.store.workspace_size(caller.tenant.id, caller.role, body.workspace) is None
    ):  # none, or another role's upload: a run starts from its role's uploads alone
        raise exc.InvalidArgument(
            f"no workspace {body.workspace!r}",
            argument="workspace",
            fix="upload it first (POST /v1/workspaces) and give the id it returns",
        )


@router.post("/v1/runs", status_code=202, response_model=RunOut, summary="Submit an agent task")
async def submit_run(body: RunSubmit, request: Request, response: Response, caller: Caller) -> RunOut:
    service = get_service(request)

    def work() -> RunOut:
        spec = body.model_dump(mode="json")
        if body.idempotency_key is not None:
            # the role's own keys: another role's run is neither named nor blocks this one
            existing = service.store.run_by_key(caller.tenant.id, caller.role, body.idempotency_key)
            if existing is not None:
                if existing.spec != spec or not owns(caller, existing):
                    raise exc.RunConflict(
                        f"idempotency key {body.idempotency_key!r} was used for another run "
                        f"({existing.run_id}) with a different request; use a new key"
                    )
                response.status_code = 200
                return run_out(service, existing)
        _authorise(service, caller, body)
        run_id = uuid.uuid4().hex
        added = service.store.add_run(
            run_id=run_id, tenant=caller.tenant.id, role=caller.role, spec=spec, labels=dict(body.labels),
            max_active=caller.tenant.quotas.runs, idem_key=body.idempotency_key,
            max_bytes=caller.tenant.quotas.storage_mb * MiB,
        )  # fmt: skip
        if not added:
            raise runs_quota(caller)
        try:
            service.executor.submit(run_id)
        except exc.ServiceUnavailable as away:
            # not sent (the broker away): the run is withdrawn, so the 503 means nothing was
            # made and a retry, with the same idempotency key or without, makes it once
            service.store.withdraw_run(run_id)
            raise exc.ServiceUnavailable(
                f"{away}: the run was not created; submit it again", retry_after=away.retry_after
            ) from None
        row = service.store.run(run_id)
        assert row is not None
        return run_out(service, row)

    out: RunOut = await blocking(work)
    return out


@router.get("/v1/runs", response_model=list[RunOut], summary="Your runs, newest first")
async def list_runs(
    request: Request, caller: Caller,
    status: Annotated[str | None, Query(description="queued, running, paused, success, ...")] = None,
    label: Annotated[str | None, Query(description="KEY=VALUE")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> list[RunOut]:  # fmt: skip
    service = get_service(request)
    pair: tuple[str, str] | None = None
    if label is not None:
        key, sep, value = label.partition("=")
        if not sep:
            raise exc.InvalidArgument(
                "label must be KEY=VALUE", argument="label", fix="give e.g. label=team=core"
            )
        pair = (key, value)

    def work() -> list[RunOut]:
        rows = service.store.runs(
            caller.tenant.id, status=status, label=pair, limit=limit, roles=(caller.role,)
        )
        return [run_out(service, r) for r in rows]

    found: list[RunOut] = await blocking(work)
    return found


@router.get("/v1/runs/{run_id}", response_model=RunOut, summary="One run")
async def get_run(run_id: str, request: Request, caller: Caller) -> RunOut:
    service = get_service(request)
    out: RunOut = await blocking(lambda: run_out(service, owned_run(service, caller, run_id), detail=True))
    return out
