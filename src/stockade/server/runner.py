"""Run one submitted run to its next stop: start it, or resume it from the run store.

The same code runs in the server's threads (embedded) and in Celery workers (distributed),
and it is safe to call twice for the same run, at once or in turn: the run store's lease
lets one process run it (another gets ``RunLeased``, retryable after the lease), a run the
store has is resumed from its last recorded step (each tool call returned is never run
again; a non-idempotent one cut mid-way is ``OutcomeUnknown``), a run that ended is left as
it is (its artifacts rebuilt from the store when its worker died before keeping them), and a
paused or broken one waits for a person (who queues it before it is sent). That is what lets
a broker deliver a run again after its worker died.

The agent is assembled with ``build_agent`` from the run's spec and its tenant: the tenant's
policy under the token's role, its audit trail (a chain of its own), approvals and kill
switches in the service's database, and the tenant's limits as any agent has them
(``AgentConfig.tenant``, ``rate_per_minute``, ``dollars_per_hour``) in the service's window
(``TenantLimits.window``: one per process, or Redis shared by every process). So a tool action
over the tenant's rate waits for the window and a full spend window stops the run ("budget"),
neither shown to the model; and the run's live mark names its tenant, for a kill-all. A wait
longer than ``ServiceConfig.limit_wait_in_place_s`` is not slept here: the run stops before
the action (``LimitWait``), waits queued saying why, its quota free, and ``execute`` raises
``RunDeferred``: the executor runs it again once the window frees.

While it runs, a run's sandbox holds its share of the tenant's quota (its CPUs and memory, and
one of its ``sandboxes``) beside the API's sandboxes (``ServiceStore.hold_run``); a run with no
room waits queued (``QuotaExceeded`` from ``execute``: the executor asks again later, without
holding a thread or a worker meanwhile).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import shutil
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from stockade import exceptions as exc
from stockade.agent import RunLimits, RunStatus
from stockade.assembly import AgentConfig, AgentSession, build_agent
from stockade.assembly.guards import record_denial
from stockade.audit.events import EventKind
from stockade.models.base import Model, resolve_model
from stockade.models.messages import ModelResponse, ToolCall
from stockade.models.scripted import ScriptedModel
from stockade.policy.engine import PolicyEngine
from stockade.runs.handback import prune_folder
from stockade.runs.seeds import pack_workspace, unpack_seed
from stockade.runs.snapshots import release_run_snapshots
from stockade.runs.store import RunStore
from stockade.runtime.events import LimitHit, RuntimeEvent
from stockade.server.authz import check_acceptance_check
from stockade.server.context import AuditLogs, ServiceConfig, TenantLimits, gave_up
from stockade.server.schemas import RunSubmit
from stockade.server.scratch import collect as collect_scratch
from stockade.server.scratch import scratch
from stockade.server.state.approvals import DatabaseApprovals
from stockade.server.state.kills import DatabaseKillSource
from stockade.server.state.rows import HELD, STARTABLE, TERMINAL, WAITING, RunRow
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore
from stockade.server.tenants import Tenant, check_share
from stockade.server.wakes import Wakes
from stockade.tools.base import Toolset
from stockade.tools.builtin import default_toolset
from stockade.types import Limits, MiB

__all__ = [
    "QUOTA_POLL_S", "RunOutcome", "Runner", "load_toolset", "quota_wait_s", "scripted_model",
]  # fmt: skip

log = logging.getLogger("stockade.runner")
QUOTA_POLL_S = 2.0  # how often a run that waits for room in its tenant's quota asks again
QUOTA_POLL_MAX_S = 30.0


def described(error: exc.StockadeError) -> str:
    """A run's error as the loop words one (``RunResult.error``): the class, then what it says."""
    return f"{type(error).__name__}: {error}"


def quota_wait_s(queued: int, sandboxes: int) -> float:
    """When a run that found its tenant's quota full asks again: every ``QUOTA_POLL_S`` while
    its tenant has no more runs queued than sandboxes, then as much longer as it has more (up
    to ``QUOTA_POLL_MAX_S``). All of a tenant's waiting runs ask at the same pace (no run asks
    more often for being younger), together about one ask every ``QUOTA_POLL_S`` per sandbox of
    the quota until the cap: 1,000 queued runs asked 500 times a second; now ~33."""
    return min(QUOTA_POLL_MAX_S, QUOTA_POLL_S * max(1.0, queued / max(1, sandboxes)))


_TURNS: TypeAdapter[list[str | ToolCall | list[ToolCall] | ModelResponse]] = TypeAdapter(
    list[str | ToolCall | list[ToolCall] | ModelResponse]
)
MAX_ARTIFACT_BYTES = 64 * 1024 * 1024
# Inside a run's artifacts: what they leave out of its workspace, a line per reason (a folder a
# copy carries, ``_state.CARRIED``; written only when something was left out).
LEFT_OUT = ".stockade/reports/left-out.txt"
MAX_SHARES = 10_000
# how a run that waits for its tenant's window says so (``RunRow.error``, shown by the API)
DEFERRED = "waiting off the worker for the tenant's"


def scripted_model(turns: list[object]) -> ScriptedModel:
    """A scripted model from the turns a request carries (never a file of the server's)."""
    try:
        parsed = _TURNS.validate_python(turns)
    except ValidationError as error:
        first = error.errors()[0]
        raise exc.InvalidArgument(
            f"scripted turn {'.'.join(str(p) for p in first['loc'])}: {first['msg']}",
            argument="scripted",
            fix='give a list of turns: "answer", {"name": TOOL, "args": {...}}, or a list of those',
        ) from None
    return ScriptedModel(parsed, name="scripted")


def run_limits(spec: RunSubmit) -> RunLimits:
    """The run's budgets (``InvalidArgument`` for one ``RunLimits`` refuses): asked at
    submission too, so that no run is queued only to fail at its start."""
    limits = spec.limits
    return RunLimits(
        max_steps=limits.max_steps, max_wall_s=limits.max_wall_s,
        max_tokens=limits.max_tokens, max_cost_usd=limits.max_cost_usd,
        max_pending_approvals=limits.max_pending_approvals,
    )  # fmt: skip


def build_model(spec: RunSubmit) -> Model:
    if spec.scripted is not None:
        return scripted_model(list(spec.scripted))
    if spec.model is None:
        raise exc.InvalidArgument("no model", argument="model", fix="give model (PROVIDER:NAME) or scripted")
    if spec.model.startswith("scripted:"):
        raise exc.InvalidArgument(
            "scripted:FILE names a file of the server's",
            argument="model",
            fix="send the turns themselves in `scripted`",
        )
    return resolve_model(spec.model)


def load_toolset(reference: str | None) -> Toolset:
    """The default tools, or the ``Toolset`` at ``module:attribute`` (a worker's own tools)."""
    if reference is None:
        return default_toolset()
    module, _, attribute = reference.partition(":")
    try:
        found = getattr(importlib.import_module(module), attribute or "toolset")
    except (ImportError, AttributeError) as error:
        raise exc.ConfigurationError(f"cannot load the tools {reference!r}: {error}") from None
    toolset = found() if callable(found) and not isinstance(found, Toolset) else found
    if not isinstance(toolset, Toolset):
        raise exc.ConfigurationError(f"{reference!r} is not a Toolset")
    return toolset


# how the agent loop words a pause: a local command, which does nothing to a service's run
_LOCAL_APPROVE = re.compile(r"stockade approve (\S+) (\S+)")


def _service_words(error: str | None) -> str | None:
    """A paused run's error as the service's user decides it: its approvals route, or the viewer."""
    if error is None:
        return None
    return _LOCAL_APPROVE.sub(
        r'POST /v1/runs/\1/approvals/\2 {"decision": "approve"} (or "deny"; or the run viewer)', error
    )


class _Deferral:
    """The run's last refusal that stopped it to wait off its worker (a ``LimitWait``)."""

    def __init__(self) -> None:
        self.hit: LimitHit | None = None

    def __call__(self, event: RuntimeEvent) -> None:
        if isinstance(event, LimitHit) and event.action == "defer":
            self.hit = event


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    run_id: str
    status: str
    error: str | None = None


class Runner:
    """Everything runs of one process share: the database, audit logs, limits, tools."""

    def __init__(self, config: ServiceConfig, *, name: str | None = None) -> None:
        self.config = config
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        db = open_database(config.database)
        # a connection of its own: the run store's writes are fenced transactions
        self.runs = RunStore(open_database(config.database), namespace="runs", key=config.audit_key)
        self.store = ServiceStore(db, runs=self.runs.ns)  # a run that stops: its rows are measured
        self.wakes = Wakes(db)
        self.approvals = DatabaseApprovals(self.store)
        self.kills = DatabaseKillSource(self.store)
        self.audit = AuditLogs(config.database, key=config.audit_key)
        self.limits = TenantLimits(config.redis, namespace=config.queue)
        self.tools = load_toolset(config.tools)
        self._sessions: dict[str, AgentSession] = {}
        self._shares: dict[str, Limits] = {}  # of runs waiting for room in their quota
        self._lock = threading.Lock()
        collect_scratch(config.temp_dir)  # a killed predecessor's seeds: a tenant's files

    def interrupt_all(self, reason: str) -> None:
        """Stop every run of this process where it is (they end "interrupted", resumable)."""
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            session.interrupt(reason)

    def quota_wait_s(self, tenant: Tenant | None) -> float:
        """When a run of ``tenant`` whose quota was full asks again (``quota_wait_s``)."""
        if tenant is None:
            return quota_wait_s(1, 1)
        return quota_wait_s(self.store.queued_count(tenant.id), tenant.quotas.sandboxes)

    def failed_attempt(self, run_id: str, tenant: Tenant | None, why: str) -> bool:
        """Count a failed attempt of the run (its worker died holding it, a retryable error);
        True when it was the last (``max_attempts``): the run has ended "error" then."""
        failed = self.store.count_failed(run_id)
        if failed < self.config.max_attempts:
            return False
        self.give_up(run_id, tenant, failed, why)
        return True

    def give_up(self, run_id: str, tenant: Tenant | None, attempts: int, why: str) -> None:
        """End the run "error" (unless it ended meanwhile), in its tenant's audit trail too."""
        error = f"{gave_up(attempts)} (the last: {why})"
        if not self.store.set_status(run_id, "error", error=error, only_from=[*WAITING, "running"]):
            return
        log.warning("run %s: %s", run_id, error)
        if tenant is not None:
            trail = self.audit.get(tenant)
            trail.continue_sealing(run_id)
            trail.record(
                EventKind.RUN_END, run_id=run_id, actor="service:executor",
                attributes={"status": "error", "error": error, "failed_attempts": attempts},
            )  # fmt: skip
            trail.flush()  # written before the task is done: nothing of the run runs after it

    def close(self) -> None:
        self.audit.close()
        self.runs.close()
        self.store.close()

    @contextlib.contextmanager
    def _seed(self, tenant: Tenant, run_id: str, digest: str | None) -> Iterator[Path | None]:
        """The workspace the run starts from: its role's upload (checked when it was submitted).
        A run submitted before workspaces had a role (they were the tenant's) may start from
        one kept from then, which names no role."""
        with scratch("run", self.config.temp_dir) as tmp:
            if digest is None:
                yield None
                return
            row = self.store.run_head(run_id)
            role = row.role if row is not None else None
            data = self.store.workspace(tenant.id, role, digest)
            if data is None and role is not None:
                data = self.store.workspace(tenant.id, None, digest)
            if data is None:
                raise exc.ResourceNotFound(f"no workspace {digest!r}", kind="workspace", id=digest)
            unpack_seed(data, Path(tmp) / "workspace")
            yield Path(tmp) / "workspace"

    def execute(self, run_id: str, tenant: Tenant | None) -> RunOutcome:
        """Run ``run_id`` until it ends or pauses. Raises ``RunLeased`` (another process runs
        it: retry after ``retry_after``), ``QuotaExceeded`` (no room in its tenant's quota: ask
        again later), ``RunDeferred`` (it waits for its tenant's window: run it again after
        ``retry_after``) and retryable errors (the store, the tier); any other error ends the
        run as "error"."""
        outcome = self._execute(run_id, tenant)
        if outcome.status in TERMINAL and tenant is not None:
            # A run that ended for good lets go of the sandbox it kept while it waited: its
            # session does when it ends, but one that ended without (killed before its resume
            # began, a spec refused on resume, killed while paused) held it in snapshot_mb.
            release_run_snapshots(self.config.snapshot_store(tenant), [run_id])
        return outcome

    def _execute(self, run_id: str, tenant: Tenant | None) -> RunOutcome:
        row = self.store.run_head(run_id)  # the spec is read once the run has its turn
        if row is None:
            return RunOutcome(run_id=run_id, status="missing", error="no such run")
        if row.status in TERMINAL or row.status in HELD:
            # A paused or broken run goes on only once a person sends it (the approvals decided,
            # POST /resume: both queue it first); a copy of its message (a waker's resend, the
            # broker's given back) went on unasked, its breaker closed, an action queued after
            # it opened run within 2 s, and each copy of a paused run started a sandbox.
            return RunOutcome(run_id=run_id, status=row.status, error=row.error)
        if tenant is None:
            self.store.set_status(run_id, "error", error=f"tenant {row.tenant!r} is no longer configured")
            return RunOutcome(run_id=run_id, status="error")
        still = self._still_waiting(row, tenant)
        if still is not None:  # delivered early (or a herd of its tenant's runs): no sandbox for nothing
            raise still
        summary = self.runs.summary(run_id)
        if summary is not None and summary.status.finished:
            # its worker died between recording the end and writing it here: the artifacts it
            # was packing are rebuilt from the run store's last workspace (else lost for good)
            if not self.store.has_artifacts(run_id):
                self._rebuild_artifacts(run_id, tenant)
            self.store.set_status(run_id, summary.status.value, error=summary.error)
            return RunOutcome(run_id=run_id, status=summary.status.value, error=summary.error)
        if (
            summary is not None and summary.status is RunStatus.BROKEN and row.status == "running"
            and not self.runs.leased(run_id)
        ):  # fmt: skip
            # Its worker died between the run store's "broken" and ours: resumed here, its breaker
            # closed with no one asking. It waits for a person (one whose worker died before the
            # resumed run's first checkpoint is resumed again: asked twice, never run unasked).
            self.store.set_status(run_id, "broken", error=summary.error, only_from=["running"])
            return RunOutcome(run_id=run_id, status="broken", error=summary.error)
        if self.runs.leased(run_id):
            # A copy of its message (a waker's resend, the broker's redelivery) while another
            # process runs it: nothing started, counted or written here (each copy started a
            # whole sandbox, outside the quota, and wrote itself in as the run's worker).
            raise exc.RunLeased(f"run {run_id} runs in another process", retry_after=self.runs.lease_s)
        resume = summary is not None
        deferral = _Deferral()
        prepared: tuple[RunSubmit, AgentConfig] | None = None
        share = self._shares.get(run_id)
        if share is None:  # the first time this process sees it: the spec gives the share
            prepared = self._prepare(run_id, row, tenant, deferral)
            if prepared is None:
                return self._as_stored(run_id)
            share = prepared[1].sandbox_limits or Limits()
            self._remember_share(run_id, share)
        with contextlib.ExitStack() as lease:  # the run store's, taken in _start before the sandbox
            # QuotaExceeded: asked again cheaply
            ended = self._start(run_id, row, tenant, share, resume=resume, lease=lease)
            self._shares.pop(run_id, None)
            if ended is not None:
                return ended
            prepared = prepared or self._prepare(run_id, row, tenant, deferral)
            if prepared is None:
                return self._as_stored(run_id)
            return self._drive(run_id, tenant, *prepared, resume=resume, deferral=deferral)

    def _drive(
        self, run_id: str, tenant: Tenant, spec: RunSubmit, config: AgentConfig, *, resume: bool,
        deferral: _Deferral,
    ) -> RunOutcome:  # fmt: skip
        """Run it (it holds its share and is "running") to where it ends or stops."""
        try:
            with (
                self._seed(tenant, run_id, spec.workspace) as seed,
                build_agent(config) as agent,
                agent.session(workspace=seed, run_id=run_id) as session,
            ):
                with self._lock:
                    self._sessions[run_id] = session
                try:
                    result = session.resume_sync() if resume else session.run_sync(spec.task)
                finally:
                    with self._lock:
                        self._sessions.pop(run_id, None)
                if result.status.finished:
                    self._keep_artifacts(run_id, tenant, session)
        except exc.RunLeased:
            raise
        except exc.RunStopped as stopped:  # a kill that struck before the loop could take it (a resume)
            self.store.set_status(run_id, stopped.status, error=str(stopped))
            return RunOutcome(run_id=run_id, status=stopped.status, error=str(stopped))
        except exc.RunConflict:
            return self._conflict(run_id)
        except exc.StockadeError as error:
            why = described(error)
            if error.retryable:
                self.store.set_status(run_id, "queued", error=why)
                raise
            self.store.set_status(run_id, "error", error=why)
            return RunOutcome(run_id=run_id, status="error", error=why)
        if result.status is RunStatus.INTERRUPTED and deferral.hit is not None:
            return self._defer(run_id, deferral.hit)
        status = result.status.value
        if result.status is RunStatus.PAUSED:
            asked = _service_words(result.error)
            if not self.store.pause(run_id, error=asked):
                # its approvals were decided while it was pausing, which sent nothing (it was
                # running): queued, it is sent on as a decision of a paused run would have
                raise exc.RunDeferred(
                    f"run {run_id}: its approvals were decided while it paused; sent on", retry_after=0.5
                )
            return self._as_stored(run_id)  # "killed" when its switch was pulled meanwhile
        # Only over "running": a kill written meanwhile stands. A switch pulled after the run's
        # last look at it (its last step, its artifacts being kept) makes it "killed": a kill
        # answered "running" is never followed by another end (it was "success").
        self.store.set_status(
            run_id, status, error=result.error, only_from=("running",), killed_if_pulled=True
        )
        return self._as_stored(run_id)

    def _conflict(self, run_id: str) -> RunOutcome:
        """The run store refused this delivery the run (``RunConflict``): another delivery
        started it at the same moment and runs it, left to it as a held run is (writing "error"
        here ended the service's run, and freed its quota, while it ran on); or it ended
        meanwhile (another delivery finished it), as the store says."""
        summary = self.runs.summary(run_id)
        if self.runs.leased(run_id) or (summary is not None and not summary.status.finished):
            # (a start that died after its first checkpoint: the next delivery resumes it)
            raise exc.RunLeased(f"run {run_id} started in another process", retry_after=5.0) from None
        status = summary.status.value if summary is not None else "error"
        self.store.set_status(run_id, status, error=summary.error if summary else "run conflict")
        return RunOutcome(run_id=run_id, status=status)

    def _prepare(
        self, run_id: str, row: RunRow, tenant: Tenant, deferral: _Deferral
    ) -> tuple[RunSubmit, AgentConfig] | None:
        """The run's spec and its agent's configuration; None when they are wrong (the run
        ended "error", saying why) or its check is no longer its role's to run ("denied")."""
        try:
            spec = RunSubmit.model_validate(self.store.run_spec(run_id) or {})
            if not self._check_allowed(run_id, row, tenant, spec.check):
                return None
            limits = spec.sandbox_limits.build() if spec.sandbox_limits is not None else None
            config = AgentConfig(
                model=build_model(spec),
                policy=tenant.policy,
                role=row.role,
                trust=spec.trust,
                tier=spec.tier,
                sandbox_limits=limits,
                audit=self.audit.get(tenant),
                limits=run_limits(spec),
                check=spec.check,
                check_timeout_s=spec.check_timeout_s,
                approver=None,
                approval_store=self.approvals,
                kill_source=self.kills,
                tools=self.tools,
                checkpointer=self.runs,
                # a paused run's sandbox is kept in the tenant's store, within its snapshot_mb;
                # a worker that cannot see that folder resumes the run with its files
                snapshot_store=self.config.snapshot_store(tenant),
                tenant=tenant.id,
                rate_per_minute=tenant.rate_per_minute,
                rate_period_s=tenant.rate_period_s,
                dollars_per_hour=tenant.dollars_per_hour,
                limits_window=self.limits.window,
                limit_wait_in_place_s=self.config.limit_wait_in_place_s,
                runtime_observers=(deferral,),
            )  # fmt: skip
        except exc.StockadeError as error:
            self.store.set_status(run_id, "error", error=described(error))
            return None
        except ValidationError as error:  # a stored spec the API would refuse now
            self.store.set_status(run_id, "error", error=f"the run's spec is invalid: {error}")
            return None
        return spec, config

    def _check_allowed(self, run_id: str, row: RunRow, tenant: Tenant, check: str | None) -> bool:
        """Whether the run's acceptance check is still its role's to run. It was judged when the
        run was submitted; judged again with the tenant's policy as it is now, a role that lost
        its command tool meanwhile runs no check when its run starts or resumes. Not: the run
        ends "denied", in its tenant's audit trail too."""
        if check is None:
            return True
        try:
            check_acceptance_check(PolicyEngine(tenant.policy, role=row.role), check)
        except exc.PolicyDenied as denied:
            self._deny(run_id, tenant, denied)
            return False
        return True

    def _deny(self, run_id: str, tenant: Tenant, denied: exc.PolicyDenied) -> None:
        if not self.store.set_status(
            run_id, "denied", error=described(denied), only_from=[*WAITING, "running"]
        ):
            return
        trail = self.audit.get(tenant)
        trail.continue_sealing(run_id)
        record_denial(trail, run_id, "check", denied)
        trail.flush()

    def _as_stored(self, run_id: str) -> RunOutcome:
        """The run as its row says now (what another writer, a kill, left there)."""
        now = self.store.run_head(run_id)
        if now is None:
            return RunOutcome(run_id=run_id, status="missing")
        return RunOutcome(run_id=run_id, status=now.status, error=now.error)

    def _remember_share(self, run_id: str, share: Limits) -> None:
        """What a run waiting for room in its quota asks for, kept between its asks (bounded:
        a run forgotten is only read again)."""
        if len(self._shares) >= MAX_SHARES:
            self._shares.clear()
        self._shares[run_id] = share

    def _defer(self, run_id: str, hit: LimitHit) -> RunOutcome:
        """The run stopped at its tenant's full window (``LimitWait``): it waits queued, its
        quota and its worker free, and the executor runs it again after the wait."""
        wait = max(hit.retry_after or 0.0, 1.0)
        why = f"{DEFERRED} {hit.kind} window ({hit.detail}); again in {wait:.0f} s"
        if not self.store.set_status(run_id, "queued", error=why, only_from=["running"]):
            return self._as_stored(run_id)  # killed meanwhile: as it is
        raise exc.RunDeferred(why, kind=hit.kind, retry_after=wait)

    def _still_waiting(self, row: RunRow, tenant: Tenant) -> exc.RunDeferred | None:
        """A run that waits for its tenant's rate window, run again before it has room (early,
        or its tenant's other runs took it): waits on, without starting its sandbox."""
        limit = self.limits.actions(tenant)
        if row.status != "queued" or not (row.error or "").startswith(DEFERRED) or limit is None:
            return None
        verdict = limit.peek(f"tenant:{tenant.id}")
        if verdict.allowed:
            return None
        return exc.RunDeferred(row.error or DEFERRED, kind="rate", retry_after=max(verdict.retry_after, 1.0))

    def _start(
        self, run_id: str, row: RunRow, tenant: Tenant, share: Limits, *, resume: bool,
        lease: contextlib.ExitStack,
    ) -> RunOutcome | None:  # fmt: skip
        """Hold the run's share of the tenant's quota (``QuotaExceeded``: it waits), take its
        lease in the run store (``RunLeased``: another delivery has it), then mark it running;
        the run as it ended instead, when a kill ended it meanwhile."""
        was = row.status
        try:
            check_share(tenant, share, what="the run's sandbox")
        except exc.QuotaExceeded as error:
            # the tenant's ceilings as they are now, as a submission is held to them: lowered
            # while the run waited, it asked for ever (holding a place of `runs`), or went on
            # with the larger ones (a resumed run's output_bytes)
            why = (
                "the run cannot go on within its tenant's quotas as they are now (lowered since it "
                f"was submitted): {error}"
            )
            self.store.set_status(run_id, "error", error=why, only_from=[was])
            return self._as_stored(run_id)
        try:
            self.store.hold_run(
                run_id=run_id, tenant=tenant.id, worker=self.name, cpus=share.cpus, memory_mb=share.memory_mb,
                quotas=tenant.quotas,
            )  # fmt: skip
        except exc.QuotaExceeded as full:
            # only as it was: a kill meanwhile is not written back over
            why = f"waiting for room in the tenant's quota: {full}"
            if why != row.error:  # written once, not each ask (a row written again is copied whole)
                self.store.set_status(run_id, was, error=why, only_from=[was])
            raise
        # The lease before the sandbox starts (the agent's run is given it): of two deliveries
        # that got this far at once, one runs the run, and the other starts no sandbox, counts
        # no attempt and leaves the run's worker as it is. The share it may have held is the
        # run's, which the winner holds too (one row per run): not dropped.
        try:
            # kept past the agent's run, to the status written at its end: a kill in between
            # (the artifacts packed, the sandbox removed) found no lease, ended the run "killed"
            # and freed its quota while its sandbox lived, and the end written then over it
            lease.enter_context(self.runs.claimed_ahead(run_id, new=not resume))
        except exc.RunConflict:
            return self._conflict(run_id)
        # Only from where it waited to run (or ran, delivered again): a kill of the queued run
        # between our read and now ended it, and "running" written over "killed" ran it all the
        # same; a run that paused or broke meanwhile waits for a person (``HELD``).
        if self.store.set_status(
            run_id, "running", worker=self.name, started=True, error=None, only_from=STARTABLE
        ):
            return None
        self.store.drop_hold(run_id)
        return self._as_stored(run_id)

    def _keep_artifacts(self, run_id: str, tenant: Tenant, session: AgentSession) -> None:
        """The final workspace, packed (what ``GET /v1/runs/{id}/artifacts`` returns), but what
        a copy on the host leaves out (``runs.handback``), named in ``LEFT_OUT`` inside it."""
        with scratch("artifacts", self.config.temp_dir) as tmp:
            out = Path(tmp) / "out"
            try:
                session.save_workspace(out)
                left = prune_folder(
                    out, seed=self.runs.seed_files(run_id), keep=session.owner.engine.hands_back
                )
                _name_left_out(out, left.lines())
            except (exc.StockadeError, OSError) as error:
                log.warning("run %s: its artifacts were not kept: %s", run_id, error)
                return
            self._put_artifacts(run_id, tenant, out)

    def _rebuild_artifacts(self, run_id: str, tenant: Tenant) -> None:
        """The artifacts of a run that ended without them: its last recorded workspace (each
        tool call records it, less what an export leaves out), or, a run that called no tool,
        the workspace it started from."""
        with scratch("artifacts", self.config.temp_dir) as tmp:
            out = Path(tmp) / "out"
            try:
                if self.runs.workspace_usage(run_id).versions:
                    exported = self.runs.export_workspace(run_id, out)
                    _name_left_out(out, exported.withheld.lines())
                else:
                    with self._seed(tenant, run_id, self._spec_workspace(run_id)) as seed:
                        if seed is None:
                            out.mkdir()
                        else:
                            shutil.copytree(seed, out, symlinks=True)
            except (exc.StockadeError, OSError) as error:
                log.warning("run %s: its artifacts were not rebuilt: %s", run_id, error)
                return
            self._put_artifacts(run_id, tenant, out)

    def _spec_workspace(self, run_id: str) -> str | None:
        workspace = (self.store.run_spec(run_id) or {}).get("workspace")
        return workspace if isinstance(workspace, str) else None

    def _put_artifacts(self, run_id: str, tenant: Tenant, folder: Path) -> None:
        try:
            seed = pack_workspace(folder, max_bytes=MAX_ARTIFACT_BYTES)
        except exc.StockadeError as error:
            log.warning("run %s: its artifacts were not kept: %s", run_id, error)
            return
        if not self.store.put_artifacts(
            run_id, seed.digest, seed.data, len(seed.data), max_bytes=tenant.quotas.storage_mb * MiB
        ):
            log.warning("run %s: its artifacts were not kept: its tenant's storage_mb quota is full", run_id)


def _name_left_out(out: Path, lines: list[str]) -> None:
    """Write ``LEFT_OUT`` into the artifacts' folder when anything was left out (over whatever
    the run's code put there)."""
    if not lines:
        return
    folder = out
    for part in Path(LEFT_OUT).parent.parts:  # never through a link the run's code left there
        folder = folder / part
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            folder.unlink()
        folder.mkdir(exist_ok=True)
    note = out / LEFT_OUT
    note.unlink(missing_ok=True)
    fd = os.open(note, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as file:
        file.write("\n".join(lines) + "\n")
