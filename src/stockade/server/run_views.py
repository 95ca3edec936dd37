"""What every run route shares: the caller's run (``owns``: another role's is no run), the
status and JSON a client is shown of it, the runs quota's refusal, and the work run off the
event loop. The routes of ``runs.py``, ``run_events.py``, ``run_controls.py`` and
``workspaces.py`` read a run through these, and the viewer reads the same (``run_status``);
apart from the routes, so that none of them imports another's.
"""

from __future__ import annotations

from typing import Any

import anyio

from stockade import exceptions as exc
from stockade.server.schemas import RunOut
from stockade.server.service import Service
from stockade.server.state.rows import RunRow
from stockade.server.tenants import Principal

__all__ = ["PENDING_SHOWN", "blocking", "owned_run", "owns", "run_out", "run_status", "runs_quota"]

# the pending requests a run's JSON shows (latest first; ``pending_count`` says how many wait, and
# GET .../approvals pages them all): one run's 2,000 made every GET of it 8.3 MB
PENDING_SHOWN = 20


def owns(principal: Principal, row: RunRow) -> bool:
    """Whether a run is the caller's: its tenant's, submitted under its role. A run's sandbox
    held what the role's policy let in, so another role of the tenant sees no run there."""
    return row.tenant == principal.tenant.id and row.role == principal.role


def owned_run(service: Service, principal: Principal, run_id: str) -> RunRow:
    row = service.store.run(run_id)
    if row is None or not owns(principal, row):
        raise exc.ResourceNotFound(f"no run {run_id!r}", kind="run", id=run_id)
    return row


def run_status(service: Service, row: RunRow) -> str:
    """The status a client is shown: the service's, corrected by the run store's sweep: a run
    whose worker died is "interrupted" until a worker takes it up again."""
    if row.status == "running":
        summary = service.run_store.summary(row.run_id)
        if summary is not None and summary.status.value == "interrupted":
            return "interrupted"
    return row.status


def run_out(service: Service, row: RunRow, *, detail: bool = False) -> RunOut:
    spec = row.spec
    out = RunOut(
        run_id=row.run_id,
        status=run_status(service, row),
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


def runs_quota(caller: Principal) -> exc.QuotaExceeded:
    quota = caller.tenant.quotas.runs
    return exc.QuotaExceeded(
        f"tenant {caller.tenant.id!r} has {quota} runs queued or running, its quota",
        quota="runs", limit=quota, used=quota,
    )  # fmt: skip


async def blocking(function: Any) -> Any:
    return await anyio.to_thread.run_sync(function)
