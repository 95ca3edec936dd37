"""A run's controls over HTTP: its approval requests and their decisions, its kill (or every
live run of the tenant at once, the kill switch ``POST /v1/runs/kill``, which stops them
whatever role submitted them), and its resume once its breaker stopped it. Each decides what
a run does next: a decided or resumed run is queued again, taking a place of the runs quota,
and sent to a worker (``_send``: a broker away is no error of the request, the run's wake
sends it); a killed run that waits ends where it is, and the sandbox it kept goes.

Apart from the routes that submit a run and read what it made: these act on a run that
exists, and the viewer's decisions go through ``decide_approval`` too.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Query, Request

from stockade import exceptions as exc
from stockade.audit.events import EventKind
from stockade.policy.approval_book import Choice
from stockade.runtime.kill_sources import kill_all
from stockade.server.authz import check_approver
from stockade.server.bodies import JSONRoute
from stockade.server.deps import Caller, get_service
from stockade.server.run_views import blocking, owned_run, run_out, run_status, runs_quota
from stockade.server.schemas import (
    ApprovalDecision,
    KillAllOut,
    KillAllRequest,
    KilledRun,
    KillRequest,
    RunOut,
)
from stockade.server.service import Service
from stockade.server.state.rows import TERMINAL, WAITING
from stockade.server.tenants import Principal
from stockade.server.wakes import RESEND_S, SEND_RETRY_S, Wakes

__all__ = ["decide_approval", "router"]

router = APIRouter(tags=["runs"], route_class=JSONRoute)
log = logging.getLogger("stockade.runs")


@router.get("/v1/runs/{run_id}/approvals", summary="The run's approval requests and decisions, oldest first")
async def list_approvals(
    run_id: str, request: Request, caller: Caller,
    offset: Annotated[int, Query(ge=0, le=2**62, description="leave out this many first")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[dict[str, str]]:  # fmt: skip
    service = get_service(request)

    def work() -> list[dict[str, str]]:
        owned_run(service, caller, run_id)
        return service.approvals.requests(run_id, offset=offset, limit=limit)

    found: list[dict[str, str]] = await blocking(work)
    return found


@router.post("/v1/runs/{run_id}/approvals/{request_id}", response_model=RunOut,
             summary="Approve or deny a pending action; the run goes on")  # fmt: skip
async def decide(
    run_id: str, request_id: str, body: ApprovalDecision, request: Request, caller: Caller
) -> RunOut:
    service = get_service(request)
    choice = Choice.APPROVED if body.decision == "approve" else Choice.DENIED
    out: RunOut = await blocking(lambda: decide_approval(service, caller, run_id, request_id, choice))
    return out


def decide_approval(
    service: Service, caller: Principal, run_id: str, request_id: str, choice: Choice, *, through: str = "api"
) -> RunOut:
    """Record a decision (if the caller's role may decide) and send a paused run on."""
    row = owned_run(service, caller, run_id)
    check_approver(caller)
    if row.status in TERMINAL:  # nothing of it will run: a decision would be recorded for nothing
        raise exc.RunConflict(f"run {run_id!r} ended ({row.status}): its requests wait for no decision")
    within = (caller.tenant.id, caller.tenant.quotas.runs)
    if row.status == "paused" and not service.store.has_room(*within):
        # A paused run holds no place of the runs quota; sent on, it takes one: deciding one
        # paused run after another queued any number of them (found from outside). Nothing
        # recorded: decide again once fewer runs are queued or running.
        raise runs_quota(caller)
    service.approvals.decide(run_id, request_id, choice, by=f"api-token/{caller.token_id}")
    service.audit.get(caller.tenant).record(
        EventKind.APPROVAL, run_id=run_id, actor=f"human:api-token/{caller.token_id}",
        attributes={"request_id": request_id, "outcome": choice.value, "through": through},
    )  # fmt: skip
    # Tried whatever the status read before: a run pausing meanwhile (its sandbox being kept)
    # found this decision's request pending and paused, or found it decided and queued itself
    # (``ServiceStore.pause``). (Another decision took the last place meanwhile: the run stays
    # paused, its decisions made; `resume` sends it on once there is room.)
    if service.store.set_status(run_id, "queued", only_from=("paused",), within=within, wake_s=RESEND_S):
        _send(service, run_id, "decided")
    updated = service.store.run(run_id)
    assert updated is not None
    return run_out(service, updated, detail=True)


def _send(service: Service, run_id: str, reason: str) -> None:
    """Send a run just queued, with its wake (``set_status(wake_s=...)``): a send that fails (the
    broker away) is no error of the request, whose decision or resume is kept; the run's wake
    comes sooner then, and a waker sends it once the broker is back."""
    try:
        service.executor.submit(run_id, reason=reason)
    except exc.ServiceUnavailable as away:
        log.warning(
            "run %s: %s; a waker sends it within %.0f s of the broker's return", run_id, away, SEND_RETRY_S
        )
        Wakes(service.store.db, namespace=service.store.ns).set(run_id, SEND_RETRY_S)


@router.post("/v1/runs/{run_id}/kill", response_model=RunOut, summary="Kill a run, wherever it runs")
async def kill_run(run_id: str, request: Request, caller: Caller, body: KillRequest | None = None) -> RunOut:
    service = get_service(request)
    reason = (body or KillRequest()).reason

    def work() -> RunOut:
        row = owned_run(service, caller, run_id)
        if row.status in TERMINAL:
            return run_out(service, row, detail=True)
        service.audit.get(caller.tenant).record(
            EventKind.KILL_SWITCH, run_id=run_id, actor=f"human:api-token/{caller.token_id}",
            attributes={"reason": reason, "through": "api"},
        )  # fmt: skip
        # not running anywhere: it ends here, and the sandbox it kept while it waited goes (its
        # snapshot_mb); running: its worker's switch sees the mark before its next call, and the
        # end (or pause) its worker writes is "killed" (``set_status(killed_if_pulled=...)``)
        if service.store.set_status(run_id, "killed", error=reason, only_from=WAITING):
            service.snapshots.release_runs(row.tenant, [run_id])
        elif service.kills.pull(run_id, reason):  # (not pulled: it ended meanwhile, as it says)
            # paused or queued again meanwhile (its worker's last write before the switch): it
            # ends where it waits, as above
            if service.store.set_status(run_id, "killed", error=reason, only_from=WAITING):
                service.snapshots.release_runs(row.tenant, [run_id])
            # "running" and no process holds its lease (taken before its sandbox starts): its
            # worker died, and it ends here too. Before, it answered "running", and ~25 s later
            # a worker started a fresh sandbox only to find the switch and end it "killed".
            elif not service.run_store.leased(run_id):
                service.store.set_status(run_id, "killed", error=reason, only_from=("running",))
        updated = service.store.run(run_id)
        assert updated is not None
        return run_out(service, updated, detail=True)

    out: RunOut = await blocking(work)
    return out


@router.post("/v1/runs/kill", response_model=KillAllOut,
             summary="Kill every live run of your tenant (an admin token: another's, or all)")  # fmt: skip
async def kill_all_runs(request: Request, caller: Caller, body: KillAllRequest | None = None) -> KillAllOut:
    service = get_service(request)
    asked = body or KillAllRequest()
    if asked.all_tenants and asked.tenant is not None:
        raise exc.InvalidArgument(
            "give tenant or all_tenants, not both", argument="tenant", fix="leave tenant out with all_tenants"
        )
    tenant = None if asked.all_tenants else (asked.tenant or caller.tenant.id)
    if tenant != caller.tenant.id and not caller.admin:
        whose = "every tenant" if tenant is None else f"tenant {tenant!r}"
        raise exc.PolicyDenied(
            f"only an admin token may kill the runs of {whose}; this token acts for tenant "
            f"{caller.tenant.id!r} (leave tenant and all_tenants out to kill its runs)",
            rule="tokens.admin",
            action=f"kill the runs of {whose}",
        )
    if tenant is not None and tenant not in service.tenants.tenants:
        raise exc.ResourceNotFound(f"no tenant {tenant!r}", kind="tenant", id=tenant)

    def work() -> KillAllOut:
        # the runs that wait end where they are (or a worker would start them next), then the
        # switches of the runs live now, wherever they run; a run submitted afterwards is not
        # stopped, as with `stockade kill --all`
        ended = service.kills.end_waiting(asked.reason, tenant=tenant)
        for run in ended:
            if run.where in WAITING:  # ended here: the sandbox it kept while it waited goes
                service.snapshots.release_runs(run.tenant, [run.run_id])
        seen = {r.run_id for r in ended}
        pulled = ended + [
            r for r in kill_all(service.kills, asked.reason, tenant=tenant) if r.run_id not in seen
        ]
        for run in pulled:
            owner = service.tenants.tenants.get(run.tenant or "")
            if owner is not None:  # each kill in the trail of the run's own tenant
                service.audit.get(owner).record(
                    EventKind.KILL_SWITCH, run_id=run.run_id, actor=f"human:api-token/{caller.token_id}",
                    attributes={"reason": asked.reason, "through": "api", "scope": "all"},
                )  # fmt: skip
        return KillAllOut(killed=[KilledRun(run_id=r.run_id, tenant=r.tenant, where=r.where) for r in pulled])

    out: KillAllOut = await blocking(work)
    return out


@router.post("/v1/runs/{run_id}/resume", response_model=RunOut,
             summary="Resume a run its breaker stopped (broken), once someone has looked")  # fmt: skip
async def resume_run(run_id: str, request: Request, caller: Caller) -> RunOut:
    service = get_service(request)

    def work() -> RunOut:
        within = (caller.tenant.id, caller.tenant.quotas.runs)
        row = owned_run(service, caller, run_id)
        decided = row.status == "paused" and service.approvals.count_pending(run_id) == 0
        if row.status != "broken" and not decided:
            raise exc.RunConflict(
                f"run {run_id} is {run_status(service, row)}: only a broken run, or a paused one whose "
                "approvals are all decided, is resumed here (a paused one goes on once its approvals "
                "are decided; an interrupted one when a worker takes it up)"
            )
        if not service.store.has_room(*within):  # refused before it is recorded as resumed
            raise runs_quota(caller)
        service.audit.get(caller.tenant).record(
            EventKind.NOTE, run_id=run_id, actor=f"human:api-token/{caller.token_id}",
            attributes={"action": "resume", "status": row.status, "through": "api"},
        )  # fmt: skip
        # the runner resumes it from its last step, the breaker closed (AgentSession.resume);
        # back in the queue, it takes a place of the runs quota, as a submitted run does
        if service.store.set_status(
            run_id, "queued", only_from=(row.status,), within=within, wake_s=RESEND_S
        ):
            _send(service, run_id, "resumed")
        updated = service.store.run(run_id)
        assert updated is not None
        return run_out(service, updated, detail=True)

    out: RunOut = await blocking(work)
    return out
