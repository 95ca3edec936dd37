"""What the run viewer shows, read from the stores that already hold it: the run store (runs,
steps, the ledger with each call's observation, the final diff), the audit trail (every
model call, tool call, denial, approval, retry, kill, anomaly and judged exec, in order; and
its chain's verification) and the approval book (what waits for a decision).

Two sources: ``LocalRuns`` (a laptop's SQLite file, for ``stockade ui``) and ``ServiceRuns``
(one tenant's runs in the service's database, for ``stockade serve``). Both build the same
values (``RunRow``, ``RunView``) with ``timeline``; the pages only render them. Nothing here
decides anything: an approval goes to the same book (locally, as ``stockade approve``) or
the same function (``runs.decide_approval``, as the API) that would take it otherwise.

The values live in ``values`` and the timeline, built from values alone, in ``timeline``;
their names in ``__all__`` are still importable from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from stockade import exceptions as exc
from stockade.agent.state import RunState, RunStatus, ToolCallRecord
from stockade.audit.events import AuditEvent, EventKind
from stockade.audit.stores import AuditStore, Row, open_store
from stockade.audit.verify import verify_run
from stockade.policy.approval_book import Choice
from stockade.policy.approval_store import ApprovalStore
from stockade.runs.store import RunStore, RunSummary, open_run_store
from stockade.server.viewer.timeline import cut, timeline
from stockade.server.viewer.values import (
    LATEST,
    PAGE,
    SETTLED,
    Entry,
    Filters,
    Pending,
    RunRow,
    RunSource,
    RunView,
    Step,
    Verification,
    Window,
)

if TYPE_CHECKING:
    from stockade.server.service import Service
    from stockade.server.tenants import Principal

__all__ = [
    "Entry",
    "Filters",
    "LocalRuns",
    "Pending",
    "RunRow",
    "RunSource",
    "RunView",
    "ServiceRuns",
    "Step",
    "Verification",
    "Window",
    "timeline",
]

LISTED = 1000  # runs read to filter one page of the list


# -- one run's page, read from the stores -------------------------------------------------------


def _texts(state: RunState | None) -> dict[int, str]:
    if state is None:
        return {}
    steps = [*state.steps, *([state.current] if state.current is not None else [])]
    return {s.index: cut(s.response.text, 4000) for s in steps if s.response.text}


def _records(
    runs: RunStore, run_id: str, events: list[AuditEvent]
) -> tuple[list[ToolCallRecord], RunState | None]:
    """The window's calls and the checkpoint holding what else it shows: the ledger's rows of
    its calls (as they return, live), then the steps of the model calls it shows (their words)
    and of the calls the ledger has not (a denied call of the step in progress)."""
    calls = {
        str(e.attributes["idempotency_key"]): e.step
        for e in events
        if e.kind == EventKind.TOOL_CALL and e.attributes.get("idempotency_key")
    }
    records = runs.tool_calls(run_id, keys=calls.keys()) if calls else []
    found = {r.idempotency_key for r in records}
    wanted = {e.step for e in events if e.kind == EventKind.MODEL_CALL and e.step}
    wanted.update(step for key, step in calls.items() if key not in found and step)
    # a step of thousands of calls is read only for its model call or a call the ledger lacks
    state = runs.glimpse(run_id, wanted)
    if state is not None:
        for step in [*state.steps, *([state.current] if state.current is not None else [])]:
            records.extend(r for r in step.tool_calls if r.idempotency_key not in found)
    return records, state


def _verification(store: AuditStore, run_id: str, key: bytes | None, runs: RunStore) -> Verification:
    """The run's events and their links into the chain, read in proportion to the run: a page
    of a 3-event run on a tenant trail of 500,000 events read them all (~5 s, at every open
    and every refresh of a settled run). The whole trail is ``stockade audit verify``'s."""
    try:
        report = verify_run(store, run_id, key=key, ledger=runs)
    except exc.StockadeError as error:
        return Verification(ok=False, summary=f"cannot verify: {error}")
    if not report.found:
        return Verification(ok=None, summary=report.summary())
    if report.ok:
        return Verification(ok=True, summary=report.summary())
    shown = "; ".join(str(p) for p in report.problems[:3])
    return Verification(ok=False, summary=f"{report.summary()}: {shown}")


def _row(s: RunSummary) -> RunRow:
    return RunRow(
        run_id=s.run_id,
        status="forged" if s.forged else s.status.value,  # its row was edited: nothing of it holds
        model=s.model_name,
        task=s.task,
        created=s.created_ns / 1e9,
        updated=s.updated_ns / 1e9,
        steps=s.steps,
        tokens=s.usage.total_tokens,
        cost_usd=s.cost_usd,
        error=s.error,
    )


def _window(store: AuditStore, run_id: str, window: Window) -> tuple[list[Row], bool, bool]:
    """The window's rows, whether the run has events before them and whether after: a few
    reads of the run's index, at most ``PAGE + 1`` rows, whatever the run's size."""
    if window.after is not None:
        rows = store.window(run_id, after_seq=window.after, limit=PAGE + 1)
        later, rows = len(rows) > PAGE, rows[:PAGE]
        first = rows[0].seq if rows else window.after + 1
        earlier = bool(store.window(run_id, before_seq=first, limit=1, newest=True))
    else:
        rows = store.window(run_id, before_seq=window.before, limit=PAGE + 1, newest=True)
        earlier, rows = len(rows) > PAGE, rows[-PAGE:]
        last = rows[-1].seq if rows else (window.before or 1) - 1
        later = window.before is not None and bool(store.window(run_id, after_seq=last, limit=1))
    return rows, earlier, later


def _view(
    row: RunRow,
    runs: RunStore,
    store: AuditStore,
    pending: list[dict[str, str]],
    *,
    key: bytes | None,
    verified: bool,
    window: Window,
) -> RunView:
    """One window of the run: its events, and only the steps and ledger rows they name."""
    run_id = row.run_id
    rows, earlier, later = _window(store, run_id, window)
    events = list(store.opened(rows))
    records, state = _records(runs, run_id, events)
    steps, last = timeline(events, records, _texts(state), step=window.step)
    if not rows:
        last = window.after if window.after is not None else max(0, (window.before or 1) - 1)
    settled = row.status in SETTLED
    return RunView(
        row=row,
        steps=steps,
        last_seq=last,
        first_seq=rows[0].seq if rows else 0,
        earlier=earlier,
        later=later,
        live=not settled and not later,
        pending=tuple(
            Pending(
                request_id=p["id"],
                action=p.get("action", ""),
                rule=p.get("rule", ""),
                reason=p.get("reason", ""),
            )
            for p in pending
        ),
        diff=runs.diff(run_id),
        answer=(state.answer or None) if state is not None else None,
        verification=_verification(store, run_id, key, runs) if verified else None,
    )


# -- a laptop: stockade ui -------------------------------------------------------------------------


class LocalRuns:
    """The runs of one SQLite run store and the audit trail beside it (``.stockade/audit.db``)."""

    label = "this machine"
    can_decide = True

    def __init__(
        self,
        db: str,
        *,
        namespace: str = "runs",
        approvals: str | Path | None = None,
        key: bytes | None = None,
    ) -> None:
        self.db = db
        # both read-only: viewing the records changes none of them (decisions go to the book)
        self.runs_store = open_run_store(db, namespace=namespace, read_only=True)
        self.audit = open_store(db, read_only=True)
        self.approvals = ApprovalStore(approvals)
        self.key = key

    def close(self) -> None:
        self.runs_store.close()
        self.audit.close()

    def runs(self, filters: Filters) -> list[RunRow]:
        try:
            status = RunStatus(filters.status) if filters.status else None
        except ValueError:
            return []
        rows = []
        for s in self.runs_store.runs(limit=LISTED, status=status):
            row = _row(s)
            if filters.keeps(row):
                rows.append(row)
        return rows[: filters.limit]

    def run(self, run_id: str, *, verified: bool = True, window: Window = LATEST) -> RunView | None:
        summary = self.runs_store.summary(run_id)
        if summary is None:
            return None
        pending = self.approvals.pending(run_id)
        return _view(
            _row(summary),
            self.runs_store,
            self.audit,
            pending,
            key=self.key,
            verified=verified,
            window=window,
        )

    def changes(self, run_id: str, after_seq: int) -> tuple[int, str] | None:
        summary = self.runs_store.summary(run_id)
        if summary is None:
            return None
        newest = self.audit.window(run_id, after_seq=after_seq, limit=1, newest=True)
        return (newest[0].seq if newest else after_seq), summary.status.value

    def decide(self, run_id: str, request_id: str, choice: Choice) -> None:
        """What ``stockade approve`` does: a paused run finds it when resumed (an MCP session
        waiting for its approval goes on now)."""
        self.approvals.decide(run_id, request_id, choice, by="run viewer")


# -- the service: one tenant's runs ---------------------------------------------------------------


class ServiceRuns:
    """What one principal of ``stockade serve`` may see: its tenant's runs of its role,
    nothing else."""

    def __init__(self, service: Service, principal: Principal) -> None:
        from stockade.server.authz import may_approve

        self.service = service
        self.principal = principal
        self.label = f"tenant {principal.tenant.id}" + (f", role {principal.role}" if principal.role else "")
        self.can_decide = may_approve(principal)

    def _row(self, run_id: str) -> RunRow | None:
        from stockade.server.run_views import owns, run_status

        row = self.service.store.run(run_id)
        if row is None or not owns(self.principal, row):
            return None  # another tenant's run, or another role's of its tenant, is no run at all
        spec = row.spec
        summary = self.service.run_store.summary(run_id)
        return RunRow(
            run_id=row.run_id,
            status=run_status(self.service, row),
            model=str(spec.get("model") or "scripted"),
            task=str(spec.get("task", "")),
            created=row.submitted_ns / 1e9,
            updated=(row.finished_ns or row.started_ns or row.submitted_ns) / 1e9,
            steps=summary.steps if summary is not None else None,
            tokens=summary.usage.total_tokens if summary is not None else None,
            cost_usd=summary.cost_usd if summary is not None else None,
            error=row.error or (summary.error if summary is not None else None),
        )

    def runs(self, filters: Filters) -> list[RunRow]:
        from stockade.server.run_views import run_status

        until = int(filters.until.timestamp() * 1e9) if filters.until is not None else None
        rows = self.service.store.runs(
            self.principal.tenant.id, status=filters.status, limit=LISTED, before_ns=until,
            roles=(self.principal.role,),
        )  # fmt: skip
        found = []
        for r in rows:
            row = RunRow(
                run_id=r.run_id,
                status=run_status(self.service, r),
                model=str(r.spec.get("model") or "scripted"),
                task=str(r.spec.get("task", "")),
                created=r.submitted_ns / 1e9,
                updated=(r.finished_ns or r.started_ns or r.submitted_ns) / 1e9,
                error=r.error,
            )
            if filters.keeps(row):
                found.append(row)
        return found[: filters.limit]

    def run(self, run_id: str, *, verified: bool = True, window: Window = LATEST) -> RunView | None:
        row = self._row(run_id)
        if row is None:
            return None
        service = self.service
        log = service.audit.get(self.principal.tenant)
        log.flush()
        pending = service.approvals.pending(run_id)
        return _view(
            row,
            service.run_store,
            log.store,
            pending,
            key=service.config.audit_key,
            verified=verified,
            window=window,
        )

    def changes(self, run_id: str, after_seq: int) -> tuple[int, str] | None:
        row = self._row(run_id)
        if row is None:
            return None
        service = self.service
        service.audit.get(self.principal.tenant)  # its tables exist
        newest = service.store.audit_last_seq(self.principal.tenant.audit_namespace, run_id, after_seq)
        return (after_seq if newest is None else newest), row.status

    def decide(self, run_id: str, request_id: str, choice: Choice) -> None:
        from stockade.server.run_controls import decide_approval

        decide_approval(self.service, self.principal, run_id, request_id, choice, through="run viewer")
