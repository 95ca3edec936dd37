"""A run's live events over HTTP: its audit trail (``GET /v1/runs/{id}/events``,
Server-Sent Events), each audit event of the run as it is written, ``id`` its sequence number
(reconnect with ``Last-Event-ID`` to continue), ``event`` its kind (model_call, tool_call,
policy_decision, approval, retry, kill_switch, ...) and ``data`` its JSON body; ``event:
status`` whenever the run's status changes, and ``event: end`` once it has ended or paused
and every event of it has been sent. The token is asked again at each poll: once it is taken
out of the tenants file (or given a new secret) the stream ends with ``event: error``, whose
data is the 401 problem. The stream reads the database, not a worker: it works whichever
worker runs the run, and after a worker died. A tenant holds ``ServiceConfig.max_streams``
streams open at once (each polls the database); one more is answered 429.

Apart from the other runs' routes: the one that answers for as long as the run lasts, a poll
loop holding one of the tenant's stream slots.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from stockade import exceptions as exc
from stockade.server.bodies import JSONRoute
from stockade.server.deps import Caller, get_service, recheck
from stockade.server.problems import from_error
from stockade.server.run_views import blocking, owned_run, run_status
from stockade.server.state.rows import TERMINAL
from stockade.server.streams import HeldStream

__all__ = ["router"]

router = APIRouter(tags=["runs"], route_class=JSONRoute)

# a run that waits for someone (an approval; a look at why its actions kept failing): its stream ends too
_WAITING = frozenset({"paused", "broken"})


@router.get("/v1/runs/{run_id}/events", summary="The run's events, live (Server-Sent Events)",
            response_class=StreamingResponse)  # fmt: skip
async def run_events(
    run_id: str, request: Request, caller: Caller,
    after: Annotated[int, Query(ge=0, le=2**62, description="send events after this sequence number")] = 0,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse:  # fmt: skip
    service = get_service(request)
    await blocking(lambda: owned_run(service, caller, run_id))
    namespace = caller.tenant.audit_namespace
    await blocking(lambda: service.audit.get(caller.tenant))  # its tables exist
    # the id of the last event the client saw (EventSource sends it on reconnecting): a sequence
    # number, or anything else ignored
    resumed = int(last_event_id) if last_event_id and re.fullmatch(r"[0-9]{1,18}", last_event_id) else 0
    start = max(after, resumed)

    async def stream() -> AsyncIterator[bytes]:
        seq, last_status = start, None
        while True:
            try:  # at each poll: a token taken out meanwhile reads no further (a reload reads files)
                await blocking(lambda: recheck(request, caller))
            except exc.AuthenticationError as error:
                problem = from_error(error, request.url.path).body
                yield f"event: error\ndata: {json.dumps(problem)}\n\n".encode()
                return
            status = await blocking(lambda: run_status(service, owned_run(service, caller, run_id)))
            rows = await blocking(functools.partial(service.store.audit_rows, namespace, run_id, seq))
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
