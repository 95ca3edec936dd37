"""Runs over HTTP: submit an agent task, follow it, decide its approvals, kill it (or every
live run of the tenant at once), resume it once its breaker stopped it, fetch its diff and its
final workspace, delete it once it has ended. A run is its role's (``owns``): to another role
of its tenant it is no run (404), its events, approvals, diff and artifacts with it, since its
sandbox held what that role's policy let in; the kill switch (``POST /v1/runs/kill``) still
stops every live run of the tenant. An uploaded workspace is its role's too: another role
lists none of it, deletes none of it (404), and a run of that role cannot start from it.

What a run keeps in the database counts against its tenant's ``storage_mb``: its spec from
its submission (one that does not fit is refused), its rows in the run store from each time
it stops; ``DELETE /v1/runs/{id}`` erases a run that ended, and frees them.

A run's live events are its audit trail (``GET /v1/runs/{id}/events``, Server-Sent Events):
each audit event of the run as it is written, ``id`` its sequence number (reconnect with
``Last-Event-ID`` to continue), ``event`` its kind (model_call, tool_call, policy_decision,
approval, retry, kill_switch, ...) and ``data`` its JSON body; ``event: status`` whenever
the run's status changes, and ``event: end`` once it has ended or paused and every event of
it has been sent. The token is asked again at each poll: once it is taken out of the tenants
file (or given a new secret) the stream ends with ``event: error``, whose data is the 401
problem. The stream reads the database, not a worker: it works whichever worker
runs the run, and after a worker died. A tenant holds ``ServiceConfig.max_streams`` streams
open at once (each polls the database); one more is answered 429.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse

from stockade import exceptions as exc
from stockade.audit.events import EventKind
from stockade.audit.ledger import RunsLedger
from stockade.audit.verify import verify
from stockade.policy.approval import Choice
from stockade.runs.seeds import pack_workspace
from stockade.runtime.killswitch import kill_all
from stockade.server.authz import (
    check_acceptance_check,
    check_approver,
    check_model,
    check_run_rules,
    choose_tier,
    engine_for,
)
from stockade.server.bodies import JSONRoute, raw_body, read_body
from stockade.server.deps import Caller, get_service, recheck
from stockade.server.held import HeldResponse, held_bytes, unpacking
from stockade.server.problems import from_error
from stockade.server.retention import erase_run
from stockade.server.runner import build_model, run_limits
from stockade.server.schemas import (
    ApprovalDecision,
    KillAllOut,
    KillAllRequest,
    KilledRun,
    KillRequest,
    RunOut,
    RunSubmit,
    WorkspaceInfo,
    WorkspaceOut,
)
from stockade.server.scratch import scratch
from stockade.server.service import Service
from stockade.server.state.rows import TERMINAL, WAITING, RunRow
from stockade.server.streams import HeldStream
from stockade.server.tenants import Principal, check_share
from stockade.server.uploads import unpack_within
from stockade.server.wakes import RESEND_S, SEND_RETRY_S, Wakes
from stockade.types import Limits, MiB

__all__ = ["decide_approval", "owns", "router", "run_status"]

router = APIRouter(tags=["runs"], route_class=JSONRoute)
log = logging.getLogger("stockade.runs")

# a run that waits for someone (an approval; a look at why its actions kept failing): its stream ends too
_WAITING = frozenset({"paused", "broken"})
# the pending requests a run's JSON shows (latest first; ``pending_count`` says how many wait, and
# GET .../approvals pages them all): one run's 2,000 made every GET of it 8.3 MB
PENDING_SHOWN = 20


def owns(principal: Principal, row: RunRow) -> bool:
    """Whether a run is the caller's: its tenant's, submitted under its role. A run's sandbox
    held what the role's policy let in, so another role of the tenant sees no run there."""
    return row.tenant == principal.tenant.id and row.role == principal.role


def _row(service: Service, principal: Principal, run_id: str) -> RunRow:
    row = service.store.run(run_id)
    if row is None or not owns(principal, row):
        raise exc.ResourceNotFound(f"no run {run_id!r}", kind="run", id=run_id)
    return row


def _status(service: Service, row: RunRow) -> str:
    """The service's status, corrected by the run store's sweep: a run whose worker died is
    "interrupted" until a worker takes it up again."""
    if row.status == "running":
        summary = service.run_store.summary(row.run_id)
        if summary is not None and summary.status.value == "interrupted":
            return "interrupted"
    return row.status


def _out(service: Service, row: RunRow, *, detail: bool = False) -> RunOut:
    spec = row.spec
    out = RunOut(
        run_id=row.run_id,
        status=_status(service, row),
        task=str(spec.get("task", "")),
        model=str(spec.get("model") or "scripted"),
        labels=row.labels,
        submitted_at=row.submitted_ns / 1e9,
        started_at=row.started_ns / 1e9 if row.started_ns else None,
        finished_at=row.finished_ns / 1e9 if row.finished_ns else None,
        attempts=row.attempts,
        worker=row.worker,
        error=row.error,
    )
    # the run store's figures for one run at a time: a listing stays one query (each summary
    # would sweep the store's leases)
    summary = service.run_store.summary(row.run_id) if detail else None
    if summary is not None:
        out.steps, out.tokens, out.cost_usd = summary.steps, summary.usage.total_tokens, summary.cost_usd
        out.error = row.error or summary.error
    if detail:
        if summary is not None and summary.status.finished:
            state = service.run_store.load(row.run_id)
            out.answer = state.answer if state is not None else None
        out.pending_approvals = service.approvals.pending(row.run_id, limit=PENDING_SHOWN)
        out.pending_count = service.approvals.count_pending(row.run_id)
    return out


async def _blocking(function: Any) -> Any:
    return await anyio.to_thread.run_sync(function)


# -- workspaces --------------------------------------------------------------------------------


@router.post("/v1/workspaces", status_code=201, response_model=WorkspaceOut, tags=["runs"],
             summary="Upload a workspace (a tar or tar.gz) for runs to start from")  # fmt: skip
@raw_body
async def upload_workspace(request: Request, caller: Caller) -> WorkspaceOut:
    service = get_service(request)
    cap = service.config.max_upload_bytes
    data = await read_body(request, cap, caller)

    def work(room: int) -> WorkspaceOut:
        with scratch("workspace", service.config.temp_dir) as tmp:
            files = unpack_within(data, Path(tmp) / "in", room, cap)
            seed = pack_workspace(Path(tmp) / "in", max_bytes=cap)
        service.store.put_workspace(
            caller.tenant.id,
            caller.role,
            seed.digest,
            seed.data,
            len(seed.data),
            max_bytes=caller.tenant.quotas.storage_mb * MiB,
        )
        return WorkspaceOut(id=seed.digest, bytes=len(seed.data), files=files)

    # one of the tenant's calls (its unpacking holds a server thread), its files counted
    with unpacking(request, caller, cap) as room:
        out: WorkspaceOut = await service.sandboxes.calls.run(caller.tenant, lambda: work(room))
    return out


@router.get("/v1/workspaces", response_model=list[WorkspaceInfo], tags=["runs"],
            summary="Your uploaded workspaces, newest first")  # fmt: skip
async def list_workspaces(request: Request, caller: Caller) -> list[WorkspaceInfo]:
    service = get_service(request)
    rows = await _blocking(lambda: service.store.workspaces(caller.tenant.id, caller.role))
    return [WorkspaceInfo(id=digest, bytes=size, uploaded_at=ns / 1e9) for digest, size, ns in rows]


@router.delete("/v1/workspaces/{workspace_id}", status_code=204, tags=["runs"],
               summary="Delete an uploaded workspace (its bytes leave your storage_mb)")  # fmt: skip
async def delete_workspace(workspace_id: str, request: Request, caller: Caller) -> Response:
    service = get_service(request)

    def work() -> None:
        tenant = caller.tenant.id
        if service.store.workspace_size(tenant, caller.role, workspace_id) is None:
            raise exc.ResourceNotFound(f"no workspace {workspace_id!r}", kind="workspace", id=workspace_id)
        users = [
            r.run_id for r in service.store.open_runs(tenant)
            if owns(caller, r) and r.spec.get("workspace") == workspace_id
        ]  # fmt: skip
        if users:  # they start, and resume, from it (another role's run starts from its own copy)
            raise exc.RunConflict(
                f"workspace {workspace_id} is the start of run {users[0]}, which has not ended: "
                "wait for it, or kill it first"
            )
        if not service.store.delete_workspace(tenant, caller.role, workspace_id):
            raise exc.ResourceNotFound(f"no workspace {workspace_id!r}", kind="workspace", id=workspace_id)

    await _blocking(work)
    return Response(status_code=204)


# -- runs ---------------------------------------------------------------------------------------


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
                return _out(service, existing)
        _authorise(service, caller, body)
        run_id = uuid.uuid4().hex
        added = service.store.add_run(
            run_id=run_id, tenant=caller.tenant.id, role=caller.role, spec=spec, labels=dict(body.labels),
            max_active=caller.tenant.quotas.runs, idem_key=body.idempotency_key,
            max_bytes=caller.tenant.quotas.storage_mb * MiB,
        )  # fmt: skip
        if not added:
            raise _runs_quota(caller)
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
        return _out(service, row)

    out: RunOut = await _blocking(work)
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
        return [_out(service, r) for r in rows]

    found: list[RunOut] = await _blocking(work)
    return found


@router.get("/v1/runs/{run_id}", response_model=RunOut, summary="One run")
async def get_run(run_id: str, request: Request, caller: Caller) -> RunOut:
    service = get_service(request)
    out: RunOut = await _blocking(lambda: _out(service, _row(service, caller, run_id), detail=True))
    return out


@router.get("/v1/runs/{run_id}/events", summary="The run's events, live (Server-Sent Events)",
            response_class=StreamingResponse)  # fmt: skip
async def run_events(
    run_id: str, request: Request, caller: Caller,
    after: Annotated[int, Query(ge=0, le=2**62, description="send events after this sequence number")] = 0,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse:  # fmt: skip
    service = get_service(request)
    await _blocking(lambda: _row(service, caller, run_id))
    namespace = caller.tenant.audit_namespace
    await _blocking(lambda: service.audit.get(caller.tenant))  # its tables exist
    # the id of the last event the client saw (EventSource sends it on reconnecting): a sequence
    # number, or anything else ignored
    resumed = int(last_event_id) if last_event_id and re.fullmatch(r"[0-9]{1,18}", last_event_id) else 0
    start = max(after, resumed)

    async def stream() -> AsyncIterator[bytes]:
        seq, last_status = start, None
        while True:
            try:  # at each poll: a token taken out meanwhile reads no further (a reload reads files)
                await _blocking(lambda: recheck(request, caller))
            except exc.AuthenticationError as error:
                problem = from_error(error, request.url.path).body
                yield f"event: error\ndata: {json.dumps(problem)}\n\n".encode()
                return
            status = await _blocking(lambda: _status(service, _row(service, caller, run_id)))
            rows = await _blocking(functools.partial(service.store.audit_rows, namespace, run_id, seq))
            for number, kind, body in rows:
                seq = number
                yield f"id: {number}\nevent: {kind}\ndata: {body}\n\n".encode()
            if status != last_status:
                last_status = status
                yield f"event: status\ndata: {json.dumps({'run_id': run_id, 'status': status})}\n\n".encode()
            if (status in TERMINAL or status in _WAITING) and not rows:
                yield f"event: end\ndata: {json.dumps({'run_id': run_id, 'status': status})}\n\n".encode()
                return
            if await request.is_disconnected():
                return
            if not rows:
                await asyncio.sleep(service.config.event_poll_s)

    # taken last: nothing between here and the response's end can leave it held
    slot = service.streams.take(caller.tenant.id, who=f"tenant {caller.tenant.id!r}")
    return HeldStream(stream(), slot=slot, headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


@router.get("/v1/runs/{run_id}/approvals", summary="The run's approval requests and decisions, oldest first")
async def list_approvals(
    run_id: str, request: Request, caller: Caller,
    offset: Annotated[int, Query(ge=0, le=2**62, description="leave out this many first")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[dict[str, str]]:  # fmt: skip
    service = get_service(request)

    def work() -> list[dict[str, str]]:
        _row(service, caller, run_id)
        return service.approvals.requests(run_id, offset=offset, limit=limit)

    found: list[dict[str, str]] = await _blocking(work)
    return found


@router.post("/v1/runs/{run_id}/approvals/{request_id}", response_model=RunOut,
             summary="Approve or deny a pending action; the run goes on")  # fmt: skip
async def decide(
    run_id: str, request_id: str, body: ApprovalDecision, request: Request, caller: Caller
) -> RunOut:
    service = get_service(request)
    choice = Choice.APPROVED if body.decision == "approve" else Choice.DENIED
    out: RunOut = await _blocking(lambda: decide_approval(service, caller, run_id, request_id, choice))
    return out


def _runs_quota(caller: Principal) -> exc.QuotaExceeded:
    quota = caller.tenant.quotas.runs
    return exc.QuotaExceeded(
        f"tenant {caller.tenant.id!r} has {quota} runs queued or running, its quota",
        quota="runs", limit=quota, used=quota,
    )  # fmt: skip


def decide_approval(
    service: Service, caller: Principal, run_id: str, request_id: str, choice: Choice, *, through: str = "api"
) -> RunOut:
    """Record a decision (if the caller's role may decide) and send a paused run on."""
    row = _row(service, caller, run_id)
    check_approver(caller)
    if row.status in TERMINAL:  # nothing of it will run: a decision would be recorded for nothing
        raise exc.RunConflict(f"run {run_id!r} ended ({row.status}): its requests wait for no decision")
    within = (caller.tenant.id, caller.tenant.quotas.runs)
    if row.status == "paused" and not service.store.has_room(*within):
        # A paused run holds no place of the runs quota; sent on, it takes one: deciding one
        # paused run after another queued any number of them (found from outside). Nothing
        # recorded: decide again once fewer runs are queued or running.
        raise _runs_quota(caller)
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
    return _out(service, updated, detail=True)


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
        row = _row(service, caller, run_id)
        if row.status in TERMINAL:
            return _out(service, row, detail=True)
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
        return _out(service, updated, detail=True)

    out: RunOut = await _blocking(work)
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

    out: KillAllOut = await _blocking(work)
    return out


@router.post("/v1/runs/{run_id}/resume", response_model=RunOut,
             summary="Resume a run its breaker stopped (broken), once someone has looked")  # fmt: skip
async def resume_run(run_id: str, request: Request, caller: Caller) -> RunOut:
    service = get_service(request)

    def work() -> RunOut:
        within = (caller.tenant.id, caller.tenant.quotas.runs)
        row = _row(service, caller, run_id)
        decided = row.status == "paused" and service.approvals.count_pending(run_id) == 0
        if row.status != "broken" and not decided:
            raise exc.RunConflict(
                f"run {run_id} is {_status(service, row)}: only a broken run, or a paused one whose "
                "approvals are all decided, is resumed here (a paused one goes on once its approvals "
                "are decided; an interrupted one when a worker takes it up)"
            )
        if not service.store.has_room(*within):  # refused before it is recorded as resumed
            raise _runs_quota(caller)
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
        return _out(service, updated, detail=True)

    out: RunOut = await _blocking(work)
    return out


@router.get("/v1/runs/{run_id}/diff", summary="The run's workspace diff (at its end)",
            response_class=Response)  # fmt: skip
async def run_diff(run_id: str, request: Request, caller: Caller) -> Response:
    service = get_service(request)

    def work() -> str:
        _row(service, caller, run_id)
        trace = service.run_store.trace(run_id)
        return trace.diff or "" if trace is not None else ""

    return _held(
        request, caller, (await _blocking(work)).encode(), "text/x-diff; charset=utf-8", "a run's diff"
    )


@router.get("/v1/runs/{run_id}/artifacts", summary="The run's final workspace (tar.gz)",
            response_class=Response)  # fmt: skip
async def run_artifacts(run_id: str, request: Request, caller: Caller) -> Response:
    service = get_service(request)

    def work() -> bytes:
        _row(service, caller, run_id)
        data = service.store.artifacts(run_id)
        if data is None:
            raise exc.ResourceNotFound(
                f"run {run_id} has no artifacts (yet): they are kept when it ends",
                kind="artifacts",
                id=run_id,
            )
        return data

    return _held(request, caller, await _blocking(work), "application/gzip", "a run's artifacts")


def _held(request: Request, caller: Principal, data: bytes, media_type: str, what: str) -> Response:
    """``data`` as the response, counted against the tenant's ``bodies_mb`` until it is read."""
    hold = held_bytes(request).hold(caller.tenant, len(data), what=what)
    return HeldResponse.of(data, hold=hold, media_type=media_type)


@router.delete("/v1/runs/{run_id}/artifacts", status_code=204,
               summary="Delete a run's kept final workspace (its bytes leave your storage_mb)")  # fmt: skip
async def delete_run_artifacts(run_id: str, request: Request, caller: Caller) -> Response:
    service = get_service(request)

    def work() -> None:
        _row(service, caller, run_id)
        if not service.store.delete_artifacts(run_id):
            raise exc.ResourceNotFound(f"run {run_id} has no artifacts", kind="artifacts", id=run_id)

    await _blocking(work)
    return Response(status_code=204)


@router.delete("/v1/runs/{run_id}", status_code=204,
               summary="Erase a run that ended (what it kept leaves your storage_mb)")  # fmt: skip
async def delete_run(run_id: str, request: Request, caller: Caller) -> Response:
    service = get_service(request)

    def work() -> None:
        row = _row(service, caller, run_id)
        actor = f"human:api-token/{caller.token_id}"
        if not erase_run(service, caller.tenant, row, actor=actor, attributes={"through": "api"}):
            raise exc.ResourceNotFound(f"no run {run_id!r}", kind="run", id=run_id)  # deleted meanwhile

    await _blocking(work)
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

    found: dict[str, Any] = await _blocking(work)
    return found


def run_status(service: Service, row: RunRow) -> str:
    """The status a client is shown (the run store's correction included)."""
    return _status(service, row)
