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

What a run's spec makes of its model, budgets and tools is ``run_spec``; how a run waits off
its worker is ``run_waits``; its seed and its artifacts are ``run_artifacts``: the last two
are bases of ``Runner``, which keeps the start, the drive and the end of a run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
from dataclasses import dataclass

from pydantic import ValidationError

from stockade import exceptions as exc
from stockade.agent import RunStatus
from stockade.assembly import AgentConfig, AgentSession, build_agent
from stockade.assembly.guards import record_denial
from stockade.audit.events import EventKind
from stockade.policy.engine import PolicyEngine
from stockade.runs.snapshots import release_run_snapshots
from stockade.runs.store import RunStore
from stockade.runtime.events import LimitHit
from stockade.server.authz import check_acceptance_check
from stockade.server.context import AuditLogs, ServiceConfig, TenantLimits, gave_up
from stockade.server.run_artifacts import RunArtifacts
from stockade.server.run_spec import build_model, load_toolset, run_limits, scripted_model
from stockade.server.run_waits import DEFERRED, QUOTA_POLL_S, Deferral, RunWaits, quota_wait_s
from stockade.server.schemas import RunSubmit
from stockade.server.scratch import collect as collect_scratch
from stockade.server.state.approvals import DatabaseApprovals
from stockade.server.state.kills import DatabaseKillSource
from stockade.server.state.rows import HELD, STARTABLE, TERMINAL, WAITING, RunRow
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore
from stockade.server.tenants import Tenant, check_share
from stockade.server.wakes import Wakes
from stockade.types import Limits

__all__ = [
    "QUOTA_POLL_S", "RunOutcome", "Runner", "load_toolset", "quota_wait_s", "scripted_model",
]  # fmt: skip

log = logging.getLogger("stockade.runner")


def described(error: exc.StockadeError) -> str:
    """A run's error as the loop words one (``RunResult.error``): the class, then what it says."""
    return f"{type(error).__name__}: {error}"


# how the agent loop words a pause: a local command, which does nothing to a service's run
_LOCAL_APPROVE = re.compile(r"stockade approve (\S+) (\S+)")


def _service_words(error: str | None) -> str | None:
    """A paused run's error as the service's user decides it: its approvals route, or the viewer."""
    if error is None:
        return None
    return _LOCAL_APPROVE.sub(
        r'POST /v1/runs/\1/approvals/\2 {"decision": "approve"} (or "deny"; or the run viewer)', error
    )


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    run_id: str
    status: str
    error: str | None = None


class Runner(RunArtifacts, RunWaits):
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
        deferral = Deferral()
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
        deferral: Deferral,
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
        self, run_id: str, row: RunRow, tenant: Tenant, deferral: Deferral
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

    def _defer(self, run_id: str, hit: LimitHit) -> RunOutcome:
        """The run stopped at its tenant's full window (``LimitWait``): it waits queued, its
        quota and its worker free, and the executor runs it again after the wait."""
        wait = max(hit.retry_after or 0.0, 1.0)
        why = f"{DEFERRED} {hit.kind} window ({hit.detail}); again in {wait:.0f} s"
        if not self.store.set_status(run_id, "queued", error=why, only_from=["running"]):
            return self._as_stored(run_id)  # killed meanwhile: as it is
        raise exc.RunDeferred(why, kind=hit.kind, retry_after=wait)

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
