"""``GuardedAgent`` and ``build_agent``: what an agent's runs share, assembled once from an
``AgentConfig``: the policy (its compliance profiles checked first), the tier, the model
behind its wrappers, the audit trail and run store, the rate and spend windows, the breakers
and the approvals. Each run is an ``AgentSession`` (``session``).
"""

from __future__ import annotations

import contextlib
import contextvars
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

from stockade._offloop import run_within
from stockade._state import sqlite_files
from stockade.agent.checkpoint import Checkpointer
from stockade.agent.loop import RunResult
from stockade.assembly.approvals import AuditedApprovals
from stockade.assembly.config import AgentConfig
from stockade.assembly.guards import record_denial
from stockade.assembly.session import AgentSession, fan_out
from stockade.assembly.trust import choose_tier, load_with_trust
from stockade.audit.log import AuditLog
from stockade.audit.redact import MIN_SECRET_LENGTH, Redactor
from stockade.audit.runtime_events import RuntimeAuditor
from stockade.audit.stores import SQLiteStore, open_store
from stockade.exceptions import ComplianceNotMet, PolicyDenied
from stockade.models.base import Model, resolve_model
from stockade.models.pricing import DEFAULT_PRICES
from stockade.policy.agent import ApprovedModel
from stockade.policy.approval import Approvals
from stockade.policy.approval_store import ApprovalStore
from stockade.policy.compliance import Setup, check_compliance, kill_target_reachable, microvm_on_host
from stockade.policy.engine import PolicyEngine
from stockade.policy.load import policy_digest
from stockade.policy.schema import Policy
from stockade.runs.snapshots import RunSnapshots
from stockade.runs.store import RunSetup, RunStore, open_run_store
from stockade.runtime.anomaly import configured_rules
from stockade.runtime.breaker import Breakers
from stockade.runtime.clock import SystemClock
from stockade.runtime.events import Observer as RuntimeObserver
from stockade.runtime.events import RuntimeEvent
from stockade.runtime.limits import RateLimit, SpendLimit, window_for
from stockade.runtime.models import BreakerModel, LimitedModel, RetryingModel
from stockade.runtime.retry import Retrier
from stockade.sandbox import _registry
from stockade.sandbox.snapshots import SnapshotStore
from stockade.tools.builtin import default_toolset

__all__ = ["GuardedAgent", "build_agent"]

# Where runtime events go: the session in progress (the controls are shared by an agent's runs).
_session_observer: contextvars.ContextVar[RuntimeObserver | None] = contextvars.ContextVar(
    "stockade_session_observer", default=None
)


def _compliance_setup(agent: GuardedAgent, runs_url: str | None) -> Setup:
    """What the compliance requirements see of this configuration and host."""
    config = agent.config
    log = config.audit if isinstance(config.audit, AuditLog) else None
    telemetry = config.telemetry
    asked = config.backend.tier if config.backend is not None else config.tier
    return Setup(
        audit_url=log.store.url if log is not None else str(config.audit),
        audit_keyed=log.chain.keyed if log is not None else config.audit_key is not None,
        audit_redacts_personal_data=(
            log.redactor.redacts_personal_data if log is not None else agent.redacts_personal_data
        ),
        telemetry_redacts_personal_data=telemetry.redactor.redacts_personal_data if telemetry else None,
        runs_erasable=isinstance(config.checkpointer, RunStore)
        or (config.checkpointer is None and config.record_runs and runs_url is not None),
        kill_switch=kill_target_reachable(config.kill_target),
        anomaly_monitor=config.anomaly,
        failure_breaker=config.max_consecutive_failures,
        microvm=microvm_on_host(asked) if asked is not None else microvm_on_host(),
    )


def _require_compliance(agent: GuardedAgent, runs_url: str | None) -> None:
    report = check_compliance(agent.policy, _compliance_setup(agent, runs_url), role=agent.config.role)
    if report.ok:
        return
    unmet = tuple(
        f"{f.requirement.control}: {f.requirement.text}: {f.detail} (fix: {f.requirement.fix})"
        for f in report.unmet
    )
    raise ComplianceNotMet(
        f"the policy declares compliance profiles {', '.join(report.profiles)}, and "
        f"{len(unmet)} of their {len(report.findings)} requirements are not met (checkpoints, not "
        "certifications; stockade policy check --compliance lists them all):\n  " + "\n  ".join(unmet),
        unmet=unmet,
    )


def _register_credentials(model: Model, redactors: Sequence[Redactor]) -> None:
    """The model's API keys are never written: a gateway's error may quote the key it was sent."""
    for secret in model.credentials():
        if len(secret) >= MIN_SECRET_LENGTH:  # shorter: no real key, and it would redact words
            for redactor in redactors:
                redactor.add_secret(secret)


class GuardedAgent:
    """The agent ``build_agent`` assembles: shared controls, and one ``AgentSession`` per run."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.policy = load_with_trust(config.policy, config.trust)
        # the file the policy was read from, and its bytes' digest: a replay says when they changed
        source = config.policy
        self._policy_file = None if isinstance(source, Policy | None) else Path(source).resolve()
        self._policy_digest = policy_digest(self._policy_file) if self._policy_file is not None else None
        self.engine = PolicyEngine(self.policy, role=config.role)
        self.anomaly_rules = configured_rules(self.policy.anomaly.settings())
        runs_url = config.runs_url or (
            config.audit if isinstance(config.audit, str) and config.audit != "memory:" else None
        )
        pii = config.redact_personal_data
        self.redacts_personal_data = pii if pii is not None else "gdpr" in self.policy.compliance.profiles
        if self.policy.compliance.profiles:  # configuration is enforced before anything starts
            _require_compliance(self, runs_url)
        self.tier, self.tier_reason = choose_tier(self.engine, config.tier, config.backend, config.prefer)
        # what can be wrong with the configuration fails here, before any file is created
        base = resolve_model(config.model)
        self.backend = config.backend or _registry.backend(self.tier)
        self.tools = config.tools if config.tools is not None else default_toolset()
        if isinstance(config.audit, AuditLog):
            self.audit_log, self._owns_log = config.audit, False
        else:
            redactor = Redactor(personal_data=self.redacts_personal_data)
            store = open_store(config.audit)
            try:  # a key that is not the trail's is refused here: the store must not stay open
                self.audit_log = AuditLog(store, key=config.audit_key, redactor=redactor)
            except BaseException:
                store.close()
                raise
            self._owns_log = True
        self.checkpointer: Checkpointer | None = config.checkpointer
        self._owned_runs: RunStore | None = None
        if self.checkpointer is None and config.record_runs and runs_url is not None:
            try:  # the runs go where the audit trail goes, so `stockade runs list` finds them
                self.checkpointer = self._owned_runs = open_run_store(runs_url, key=config.audit_key)
            except BaseException:
                self.close()
                raise
        self.keeper = (
            RunSnapshots(
                config.snapshot_store or SnapshotStore.default(), each_call=config.keep_sandbox_each_call
            )
            if config.keep_sandbox and self.checkpointer is not None
            else None
        )
        log = self.audit_log
        _register_credentials(base, self._redactors())
        clock = config.clock or SystemClock()
        self._unattached = RuntimeAuditor(log)  # events outside any session (none expected)
        self.runtime_observer = fan_out((self._dispatch, *config.runtime_observers))
        self.retrier = Retrier(
            policy=config.retry, observer=self.runtime_observer, clock=clock, redact=log.redactor.text
        )
        self.breakers = Breakers(config=config.breaker, clock=clock, observer=self.runtime_observer)
        window = (
            config.limits_window
            if config.limits_window is not None
            else window_for(config.limits_redis_url, clock=clock)
        )

        def rate(per_minute: int | None) -> RateLimit | None:
            if per_minute is None:
                return None
            return RateLimit(
                per_minute=per_minute,
                window=window,
                observer=self.runtime_observer,
                period_s=config.rate_period_s,
            )

        self.rate, self.run_rate = rate(config.rate_per_minute), rate(config.run_rate_per_minute)
        spend = (
            SpendLimit(
                dollars_per_hour=config.dollars_per_hour, window=window, observer=self.runtime_observer
            )
            if config.dollars_per_hour is not None
            else None
        )
        self.clock = clock
        self.prices = config.prices if config.prices is not None else DEFAULT_PRICES
        self.approvals = AuditedApprovals(
            Approvals(
                config.approver,
                # the book keeps what the trail keeps: the run's registered secrets redacted too
                config.approval_store or ApprovalStore(config.approval_dir, redactor=log.redactor),
                max_pending=config.limits.max_pending_approvals,
            ),
            log,
        )
        limited = LimitedModel(
            BreakerModel(RetryingModel(base, self.retrier), self.breakers),
            spend=spend,
            prices=self.prices,
            key=f"tenant:{config.tenant}",
            on_spend_limit=config.on_spend_limit,
            wait_in_place_s=config.limit_wait_in_place_s,
            clock=clock,
        )
        try:
            self.model: Model = ApprovedModel(limited, self.engine)  # refuses an unapproved model now
        except PolicyDenied as err:  # refused before any run: recorded under no run id
            record_denial(log, "", "model", err)
            self.close()
            raise

    def run_setup(self) -> RunSetup:
        """What a run of this agent runs under (its policy with the trust merged in, its role,
        tier, budgets and acceptance check), kept with the run so that ``stockade replay`` runs
        it again under the same."""
        return RunSetup(
            policy=self.policy,
            role=self.config.role,
            tier=self.tier,
            policy_file=None if self._policy_file is None else str(self._policy_file),
            policy_digest=self._policy_digest,
            limits=self.config.limits,
            check=self.config.check,
            check_timeout_s=self.config.check_timeout_s,
        )

    def own_records(self) -> tuple[Path, ...]:
        """The files and folders of this host that hold this agent's records (its audit trail
        with the sealing keys, its run store, kept sandboxes, approvals, incidents): where one
        lies inside a run's workspace, it is left out of the copy a sandbox gets, wherever the
        configuration put it (``.stockade/`` folders always are: ``stockade._state``)."""
        found: list[Path] = []
        if isinstance(self.audit_log.store, SQLiteStore):
            found += sqlite_files(self.audit_log.store.path)
        runs = self.checkpointer
        if isinstance(runs, RunStore) and runs.url.startswith("sqlite:///"):
            found += sqlite_files(Path(runs.url.removeprefix("sqlite:///")))
        if self.keeper is not None:
            found.append(self.keeper.store.root)
        if isinstance(self.approvals.store, ApprovalStore):
            found.append(self.approvals.store.directory)
        if self.config.incident_dir is not None:
            found.append(Path(self.config.incident_dir))
        return tuple(found)

    def _redactors(self) -> list[Redactor]:
        """Every redactor between this agent and what it writes (trail, run store, telemetry)."""
        found = [self.audit_log.redactor]
        if isinstance(self.checkpointer, RunStore):
            found.append(self.checkpointer.redactor)
        if self.config.telemetry is not None:
            found.append(self.config.telemetry.redactor)
        return found

    def _dispatch(self, event: RuntimeEvent) -> None:
        (_session_observer.get() or self._unattached)(event)

    # -- runs -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def session(
        self, *, workspace: str | Path | None = None, run_id: str | None = None, subject: str | None = None
    ) -> Iterator[AgentSession]:
        """A sandbox (seeded with a copy of ``workspace``) and everything one run needs.
        ``subject``: whose personal data the run holds, recorded so that it can be erased."""
        session = AgentSession(self, run_id or uuid.uuid4().hex, subject=subject)
        token = _session_observer.set(session.runtime_observer)
        try:
            with session.open(workspace):
                yield session
        finally:
            _session_observer.reset(token)
            self.audit_log.flush()

    def run_sync(
        self,
        task: str,
        *,
        workspace: str | Path | None = None,
        run_id: str | None = None,
        subject: str | None = None,
    ) -> RunResult:
        with self.session(workspace=workspace, run_id=run_id, subject=subject) as session:
            return session.run_sync(task)

    async def run(
        self,
        task: str,
        *,
        workspace: str | Path | None = None,
        run_id: str | None = None,
        subject: str | None = None,
    ) -> RunResult:
        """As ``run_sync``, from a coroutine: the session's blocking parts (the sandbox started
        and seeded with ``workspace``, closed, the audit trail flushed) run in worker threads."""
        opened = self.session(workspace=workspace, run_id=run_id, subject=subject)
        return await run_within(opened, lambda session: session.run(task))

    def resume_sync(self, run_id: str, *, workspace: str | Path | None = None) -> RunResult:
        """Continue a paused run from the checkpointer, in a new sandbox: the one the run kept when
        it paused (``keep_sandbox``), else one seeded with ``workspace`` (the run's workspace as
        it was when it paused: ``AgentSession.save_workspace``)."""
        with self.session(workspace=workspace, run_id=run_id) as session:
            return session.resume_sync()

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Flush the audit trail (and close it, and the run store, when this agent opened them)."""
        if self._owned_runs is not None:
            self._owned_runs.close()
            self._owned_runs = None
        if self._owns_log:
            self.audit_log.close()
            self.audit_log.store.close()
        else:
            self.audit_log.flush()

    def __enter__(self) -> GuardedAgent:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def build_agent(config: AgentConfig) -> GuardedAgent:
    """Load the policy, choose the tier by trust (failing closed), open the audit trail, and
    assemble the wrappers in the order the ``stockade.assembly`` docstring gives. Close it
    (``with``) to flush the audit trail."""
    return GuardedAgent(config)
