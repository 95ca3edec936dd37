"""What the run viewer shows, read from the stores that already hold it: the run store (runs,
steps, the ledger with each call's observation, the final diff), the audit trail (every
model call, tool call, denial, approval, retry, kill, anomaly and judged exec, in order; and
its chain's verification) and the approval book (what waits for a decision).

Two sources: ``LocalRuns`` (a laptop's SQLite file, for ``stockade ui``) and ``ServiceRuns``
(one tenant's runs in the service's database, for ``stockade serve``). Both build the same
values (``RunRow``, ``RunView``) with ``timeline``; the pages only render them. Nothing here
decides anything: an approval goes to the same book (locally, as ``stockade approve``) or
the same function (``runs.decide_approval``, as the API) that would take it otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from stockade import exceptions as exc
from stockade.agent.state import RunState, RunStatus, ToolCallRecord
from stockade.audit.events import AuditEvent, EventKind
from stockade.audit.stores import AuditStore, Row, open_store
from stockade.audit.verify import verify_run
from stockade.policy.approval import ApprovalStore, Choice
from stockade.runs.store import RunStore, RunSummary, open_run_store

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

# A run in one of these is done changing. A paused, interrupted or broken run is followed too: a
# decision (here, or anywhere else) or a restart sends it on.
SETTLED = frozenset(s.value for s in RunStatus if s.finished)
STATUSES = ("queued", *(s.value for s in RunStatus))
OBSERVATION_CHARS = 20_000  # of one tool call's observation, on the page
LISTED = 1000  # runs read to filter one page of the list
# audit events on one page of a run, and in one live update of it: a run of 10^5 events
# rendered whole was ~40 MiB and about a minute of the server's time, at every update
PAGE = 250


@dataclass(frozen=True, kw_only=True)
class Window:
    """Which of a run's audit events a page shows: the newest ``PAGE`` (before ``before``, when
    given), or the first ``PAGE`` after ``after`` (an earlier page read forwards, or a live
    page's update: what came after the last event it shows). ``step``: the step the events
    just before ``after`` are in (an event outside any step goes with it)."""

    before: int | None = None
    after: int | None = None
    step: int = 0


LATEST = Window()  # a run's page as it opens: its newest events


@dataclass(frozen=True, kw_only=True)
class Filters:
    status: str | None = None
    model: str | None = None  # a part of the model's name
    since: datetime | None = None  # UTC
    until: datetime | None = None
    limit: int = 100

    def keeps(self, row: RunRow) -> bool:
        if self.model and self.model.lower() not in row.model.lower():
            return False
        if self.since is not None and row.created < self.since.timestamp():
            return False
        return not (self.until is not None and row.created > self.until.timestamp())


@dataclass(frozen=True, kw_only=True)
class RunRow:
    run_id: str
    status: str
    model: str
    task: str
    created: float  # seconds since the epoch
    updated: float
    steps: int | None = None
    tokens: int | None = None
    cost_usd: float | None = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One line of the timeline. Every text here is untrusted (the model's, the code's): the
    templates escape it."""

    seq: int
    # run, model, tool, denial, approval, retry, kill, anomaly, exec, limit, breaker, check, sandbox, note
    kind: str
    title: str
    when: str
    facts: tuple[str, ...] = ()
    args: str | None = None
    text: str | None = None
    failed: bool = False


@dataclass(frozen=True, kw_only=True)
class Step:
    index: int  # 0: before the first step or after the last
    entries: tuple[Entry, ...]


@dataclass(frozen=True, kw_only=True)
class Pending:
    request_id: str
    action: str
    rule: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Verification:
    ok: bool | None  # None: nothing to verify (no events)
    summary: str


@dataclass(frozen=True, kw_only=True)
class RunView:
    row: RunRow
    steps: tuple[Step, ...]
    pending: tuple[Pending, ...]
    diff: str | None
    answer: str | None
    verification: Verification | None
    last_seq: int  # of the last event the page shows (of any kind, entry or not)
    first_seq: int = 0  # of the first it shows; 0: none
    earlier: bool = False  # the run has events before the page's (a link goes to them)
    later: bool = False  # and after them: the page is not the run's latest
    live: bool = field(default=False)


class RunSource(Protocol):
    """The runs one viewer session may see."""

    label: str  # who is looking ("tenant acme, role dev"; "this machine")
    can_decide: bool

    def runs(self, filters: Filters) -> list[RunRow]: ...

    def run(self, run_id: str, *, verified: bool = True, window: Window = LATEST) -> RunView | None: ...

    def changes(self, run_id: str, after_seq: int) -> tuple[int, str] | None:
        """(the last audit seq of the run, its status); None when there is no such run."""

    def decide(self, run_id: str, request_id: str, choice: Choice) -> None: ...


# -- the timeline ---------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str | None:
    return None if seconds is None else f"{seconds * 1000:,.0f} ms"


def _when(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%H:%M:%S.%f")[:-3]


def _pretty(value: object) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


def _cut(text: str, limit: int = OBSERVATION_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n… [{len(text) - limit} more characters]"


def _str(value: object) -> str:
    return "" if value is None else str(value)


def _tool_entry(event: AuditEvent, records: dict[str, ToolCallRecord]) -> Entry:
    a = event.attributes
    record = records.get(_str(a.get("idempotency_key"))) or records.get(_str(a.get("call_id")))
    facts = [f for f in (_ms(event.duration_s),) if f]
    code = record.exit_code if record is not None else None
    if code is not None:
        facts.insert(0, f"exit {code}")
    if a.get("error_type"):
        facts.append(_str(a.get("error_type")))
    if a.get("outcome") == "unknown":
        facts.append("outcome unknown (cut by a crash)")
    if a.get("reconciled"):
        facts.append("recorded on resume")
    observation = record.observation if record is not None else None
    if observation is None and a.get("observation_chars"):
        observation = f"({a.get('observation_chars')} characters, not in the run store)"
    return Entry(
        seq=event.seq,
        kind="tool",
        title=_str(a.get("tool")) or "tool call",
        when=_when(event.timestamp_ns),
        facts=tuple(facts),
        args=_pretty(a.get("args", {})),
        text=_cut(observation) if observation else None,
        failed=bool(a.get("is_error")),
    )


def _entry(event: AuditEvent, records: dict[str, ToolCallRecord], texts: dict[int, str]) -> Entry | None:  # noqa: C901 - a branch per kind of event
    a, kind, when, seq = event.attributes, event.kind, _when(event.timestamp_ns), event.seq
    match kind:
        case EventKind.MODEL_CALL:
            calls = a.get("tool_calls")
            asked = ", ".join(str(c) for c in calls) if isinstance(calls, list) and calls else "final answer"
            facts: tuple[str, ...] = (
                _ms(event.duration_s) or "",
                f"{a.get('input_tokens', 0)} in / {a.get('output_tokens', 0)} out tokens",
                f"→ {asked}",
            )
            return Entry(
                seq=seq,
                kind="model",
                title=f"model call ({_str(a.get('model'))})",
                when=when,
                facts=facts,
                text=texts.get(event.step) or None,
            )
        case EventKind.TOOL_CALL:
            return _tool_entry(event, records)
        case EventKind.POLICY_DECISION:
            decision = _str(a.get("decision"))
            what = _str(a.get("tool") or a.get("action") or a.get("model") or a.get("level"))
            return Entry(
                seq=seq,
                kind="denial" if decision == "deny" else "note",
                when=when,
                title=f"{'denied' if decision == 'deny' else decision or 'policy'}: {what}",
                facts=tuple(
                    f
                    for f in (f"rule {_str(a.get('rule'))}" if a.get("rule") else "", _str(a.get("level")))
                    if f
                ),
                args=_pretty(a["args"]) if "args" in a else None,
                text=_str(a.get("reason")) or None,
                failed=decision == "deny",
            )
        case EventKind.APPROVAL:
            outcome = _str(a.get("outcome"))
            title = {"pending": "waits for approval", "approved": "approved", "denied": "denied"}.get(
                outcome, outcome
            )
            action = _str(a.get("action"))
            facts = tuple(
                f
                for f in (
                    f"by {event.actor}" if outcome != "pending" else "",
                    f"rule {a.get('rule')}" if a.get("rule") else "",
                    f"through {a.get('through')}" if a.get("through") else "",
                )
                if f
            )
            return Entry(
                seq=seq,
                kind="approval",
                title=f"{title}: {action}" if action else title,
                when=when,
                facts=facts,
                text=_str(a.get("reason")) or None,
                failed=outcome == "denied",
            )
        case EventKind.RETRY:
            if a.get("flaky"):
                text = f"exit {a.get('first_exit_code')} then {a.get('second_exit_code')}"
                return Entry(
                    seq=seq,
                    kind="retry",
                    title=f"flaky, run again: {_str(a.get('subject'))}",
                    when=when,
                    text=text,
                )
            return Entry(
                seq=seq,
                kind="retry",
                title=f"retry {a.get('attempt')}: {_str(a.get('subject'))}",
                when=when,
                facts=(f"after {float(str(a.get('delay_s') or 0)):.2f} s",),
                text=_str(a.get("reason")) or None,
            )
        case EventKind.KILL_SWITCH:
            verb = "interrupted" if a.get("interrupted") else "killed"
            return Entry(
                seq=seq,
                kind="kill",
                title=verb,
                when=when,
                text=_str(a.get("reason")) or None,
                facts=(f"by {event.actor}",),
                failed=True,
            )
        case EventKind.ANOMALY:
            return Entry(
                seq=seq,
                kind="anomaly",
                title=f"anomaly: {_str(a.get('rule'))}",
                when=when,
                facts=(f"action {_str(a.get('action'))}",),
                text=_str(a.get("detail")) or None,
                failed=True,
            )
        case EventKind.EXEC:
            argv = a.get("argv")
            words = " ".join(str(w) for w in argv) if isinstance(argv, list) else _str(argv)
            verdict = _str(a.get("verdict"))
            return Entry(
                seq=seq,
                kind="exec",
                title=f"exec {verdict}: {words}",
                when=when,
                facts=((f"rule {a.get('rule')}",) if a.get("rule") else ())
                + (("between calls: by what a call left running",) if a.get("between") else ()),
                failed=verdict in ("deny", "refuse"),
            )
        case EventKind.RATE_LIMITED | EventKind.BUDGET:
            # a limit either holds the action until its window allows it or stops the run
            waits = a.get("action") == "wait"
            then = ("waits for its window",) if waits else ("stops the run",) if a.get("action") else ()
            return Entry(
                seq=seq,
                kind="limit",
                title=f"{kind.value.replace('_', ' ')}: {_str(a.get('limit'))}",
                when=when,
                facts=then,
                text=_str(a.get("detail")) or None,
                failed=not waits,
            )
        case EventKind.BREAKER_CHANGE:
            failures = a.get("failures")
            return Entry(
                seq=seq,
                kind="breaker",
                title=f"breaker {_str(a.get('name'))}: {_str(a.get('old'))} → {_str(a.get('new'))}",
                when=when,
                facts=(f"{failures} failures in a row",) if isinstance(failures, int) and failures else (),
                text=_str(a.get("reason")) or None,
                failed=a.get("new") == "open",
            )
        case EventKind.CHECK:
            passed = a.get("passed") is True
            return Entry(
                seq=seq,
                kind="check",
                title=f"check {'passed' if passed else 'failed'}: {_str(a.get('command'))}",
                when=when,
                facts=(f"exit {a.get('exit_code')}", _ms(event.duration_s) or ""),
                text=_str(a.get("summary")) or None,
                failed=not passed,
            )
        case EventKind.RUN_START:
            return Entry(
                seq=seq,
                kind="run",
                title="run started" + (" (resumed)" if a.get("resumed") else ""),
                when=when,
                text=_str(a.get("task")) or None,
            )
        case EventKind.RUN_END:
            return Entry(
                seq=seq,
                kind="run",
                title=f"run ended: {_str(a.get('status'))}",
                when=when,
                text=_str(a.get("error")) or None,
                failed=a.get("status") != "success",
            )
        case EventKind.SANDBOX_START | EventKind.SANDBOX_STOP:
            verb = "started" if kind == EventKind.SANDBOX_START else "stopped"
            tier = _str(a.get("tier"))
            return Entry(
                seq=seq, kind="sandbox", title=f"sandbox {verb}" + (f" ({tier})" if tier else ""), when=when
            )
        case EventKind.RUN_CRASH | EventKind.ERROR | EventKind.NOTE:
            detail = _str(a.get("detail") or a.get("error") or a.get("message"))
            return Entry(
                seq=seq,
                kind="note",
                title=kind.value.replace("_", " "),
                when=when,
                text=detail or None,
                failed=kind != EventKind.NOTE,
            )
        case _:
            # commands, code, file writes: the sandbox ops under a tool call, which the call shows
            return None


def timeline(
    events: Iterable[AuditEvent],
    records: Sequence[ToolCallRecord] = (),
    texts: dict[int, str] | None = None,
    *,
    step: int = 0,
) -> tuple[tuple[Step, ...], int]:
    """The run's audit events as steps of entries (in the trail's order), and the last seq.
    ``records`` (the run store's ledger) give each call its observation and exit code;
    ``texts`` the model's words at each step; ``step``: the step of the events just before
    these (a window of the trail)."""
    by_key: dict[str, ToolCallRecord] = {}
    for record in records:
        by_key[record.idempotency_key] = record
        by_key.setdefault(record.call.id, record)
    steps: list[Step] = []
    last = 0
    for event in events:
        last = max(last, event.seq)
        entry = _entry(event, by_key, texts or {})
        if entry is None:
            continue
        # events outside any step (approvals, a pause, a resume, the end) go with the step they
        # happened in: the one before them
        index = event.step or (steps[-1].index if steps else step)
        if steps and steps[-1].index == index:
            steps[-1] = Step(index=index, entries=(*steps[-1].entries, entry))
        else:
            steps.append(Step(index=index, entries=(entry,)))
    return tuple(steps), last


def _texts(state: RunState | None) -> dict[int, str]:
    if state is None:
        return {}
    steps = [*state.steps, *([state.current] if state.current is not None else [])]
    return {s.index: _cut(s.response.text, 4000) for s in steps if s.response.text}


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
        from stockade.server.runs import owns, run_status

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
        from stockade.server.runs import run_status

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
        from stockade.server.runs import decide_approval

        decide_approval(self.service, self.principal, run_id, request_id, choice, through="run viewer")
