"""One call from a policy file to a guarded, limited, audited agent.

    agent = build_agent(AgentConfig(
        model="openai:gpt-4.1", policy="policy.toml", audit="sqlite:///.stockade/audit.db",
        limits=RunLimits(max_steps=20, max_cost_usd=2.0), rate_per_minute=60,
        dollars_per_hour=5.0, approver=cli_approver,
    ))
    with agent:
        result = agent.run_sync("make the tests pass", workspace="project/")

or, to keep one sandbox across a pause for approval and its resumption:

    with agent.session(workspace="project/") as session:
        result = session.run_sync("make the tests pass")      # status "paused": someone decides
        result = session.resume_sync()                        # then it goes on where it stopped

The tier comes from trust: the stricter of ``AgentConfig.trust`` and the policy's
``[trust] level`` (a caller can tighten the policy, never loosen it) gives the tiers allowed
(the README's trust table); an explicit ``tier`` outside them, or none available on this host, fails
closed with ``TierUnavailable`` before any code runs.

The wrappers, outermost first, and why in this order:

    tool call   runtime guard       a killed run, or one whose breaker tripped, goes no further
                policy guard        deny (told to the model) or ask a human (the run pauses), before
                                    anything runs or is counted: a denied call costs no rate budget
                output filter       the policy sees the final output the model would get
                runtime controls    kill switch check, action rate limits (per run, per tenant: wait
                                    for the window, or stop the run), the tool's breaker (the
                                    run's own: caller errors such as a missing file count not)
                the tool
    sandbox op  policy guard again  every op, whatever tool issued it (defence in depth); an op of a
                                    call a human already approved is not asked about twice
                kill switch         the run's processes die the moment it is pulled
                audit               each op that reaches the tier, once, whatever retries did below
                backend breaker     counts an op as failed only after its retries
                retry               transient failures only (starts and reads; never commands)
                the tier
    model       registry check (ApprovedModel) -> spend limit ($/hour: stop, or wait) -> breaker ->
                retry -> adapter
    observers   audit first (a run refused at its start is still recorded), the prompt filter,
                the runtime controls (the kill switch between steps), then yours

Every decision lands in the audit trail: model calls, tool calls, denials at either level,
approvals (asked, granted, refused), retries, breaker changes, rate and spend refusals,
anomalies, kills, sandbox start and stop, commands and file writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import shlex
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from stockade._checks import check_choice, check_host_path, check_id
from stockade._display import visible
from stockade._offloop import run_within
from stockade._state import sqlite_files, within
from stockade.agent.checkpoint import Checkpointer
from stockade.agent.events import (
    AgentEvent,
    ModelRequested,
    ModelResponded,
    RunStarted,
    ToolCalled,
    ToolDenied,
    ToolRejected,
    ToolReturned,
)
from stockade.agent.events import Observer as AgentObserver
from stockade.agent.loop import DEFAULT_SYSTEM_PROMPT, Agent, Guard, GuardContext, RunLimits, RunResult
from stockade.agent.state import RunState
from stockade.audit.agent import AuditObserver
from stockade.audit.events import EventKind
from stockade.audit.log import AuditLog
from stockade.audit.redact import MIN_SECRET_LENGTH, Redactor
from stockade.audit.runtime_events import RuntimeAuditor
from stockade.audit.sandbox import CHECK_CALL, AuditedBackend, current_call, exec_word
from stockade.audit.stores import SQLiteStore, open_store
from stockade.exceptions import (
    ApprovalRequired,
    ApprovalsFull,
    ComplianceNotMet,
    ConfigurationError,
    InvalidArgument,
    PolicyDenied,
    SnapshotIncompatible,
    SnapshotNotFound,
    StockadeError,
    TierUnavailable,
)
from stockade.models.base import Model, resolve_model
from stockade.models.messages import ToolCall
from stockade.models.pricing import DEFAULT_PRICES, Price
from stockade.observability.agent import TelemetryObserver
from stockade.observability.sandbox import TracedBackend
from stockade.observability.telemetry import Telemetry
from stockade.policy.agent import ApprovedModel, FlagSink, filter_outputs, policy_guard, prompt_filter
from stockade.policy.approval import (
    CLIENT_ACTOR,
    SYSTEM_ACTOR,
    ApprovalBook,
    ApprovalRequest,
    Approvals,
    ApprovalStore,
    Approver,
    Choice,
)
from stockade.policy.compliance import Setup, check_compliance, kill_target_reachable, microvm_on_host
from stockade.policy.engine import PolicyEngine
from stockade.policy.guards import GuardedInstance, OpContext, OpGuard, describe, enforce, shown
from stockade.policy.load import load_policy, policy_digest
from stockade.policy.schema import Policy, TrustRules, Verdict
from stockade.runs.recorder import RunRecorder
from stockade.runs.snapshots import RunSnapshots
from stockade.runs.store import RunSetup, RunStore, open_run_store
from stockade.runtime.agent import RuntimeControls
from stockade.runtime.anomaly import ANOMALY_RULE, AnomalyMonitor, Finding, configured_rules
from stockade.runtime.breaker import BreakerConfig, Breakers, BreakingBackend, RunBreakers
from stockade.runtime.clock import Clock, SystemClock
from stockade.runtime.events import Observer as RuntimeObserver
from stockade.runtime.events import RuntimeEvent
from stockade.runtime.failures import DEFAULT_FAILURES, AgentBreaker
from stockade.runtime.killswitch import KillSource, KillSwitch, check_kill_target, kill_source_for
from stockade.runtime.limits import OnLimit, RateLimit, SpendLimit, Window, window_for
from stockade.runtime.models import BreakerModel, LimitedModel, RetryingModel
from stockade.runtime.retry import Retrier, RetryingBackend, RetryPolicy
from stockade.sandbox import _registry
from stockade.sandbox._registry import Preference
from stockade.sandbox.base import Backend
from stockade.sandbox.facade import Sandbox
from stockade.sandbox.ops import Op
from stockade.sandbox.snapshots import SnapshotStore
from stockade.tools.base import Toolset
from stockade.tools.builtin import default_toolset
from stockade.types import ExecRecord, Limits, SnapshotKind, Trust

__all__ = ["AgentConfig", "AgentSession", "GuardedAgent", "build_agent", "effective_trust"]

log = logging.getLogger(__name__)

# Weakest to strictest: a caller may tighten the policy's trust, never loosen it.
_TRUST_ORDER = (Trust.TRUSTED, Trust.INTERNAL, Trust.UNTRUSTED, Trust.MULTI_TENANT)

# Where runtime events go: the session in progress (the controls are shared by an agent's runs).
_session_observer: contextvars.ContextVar[RuntimeObserver | None] = contextvars.ContextVar(
    "stockade_session_observer", default=None
)
# Set while a tool call a human approved runs: its sandbox ops are covered by that approval.
_call_approved: contextvars.ContextVar[bool] = contextvars.ContextVar("stockade_approved", default=False)
# Set while an exec its code started inside the sandbox is asked about: a yes to the call or to
# its op covers what its code runs, a yes to one exec covers that exec alone (one approved `cp`
# let the same call's `rm -r` run unasked, past a standing no).
_asking_for_exec: contextvars.ContextVar[bool] = contextvars.ContextVar("stockade_exec_asks", default=False)
# The tool call being made (its step, its id): a denial or an approval of one of its ops is
# recorded under it, not at step 0 with no call (found from outside).
_call_at: contextvars.ContextVar[tuple[int, str] | None] = contextvars.ContextVar(
    "stockade_call_at", default=None
)


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Everything ``build_agent`` needs; each field is fixed before any code runs."""

    model: str | Model  # "openai:gpt-4.1", "scripted:turns.json", or a Model
    policy: str | Path | Policy | None = None  # a .toml/.yaml file or a Policy; None: the defaults
    role: str | None = None  # required when the policy defines roles
    trust: Trust | None = None  # tightens the policy's [trust] level
    tier: str | None = None  # None: the cheapest tier trust allows and this host has
    prefer: Preference | None = None  # "strongest" turns the choice round; None: the policy's
    backend: Backend | None = None  # replaces the tier's backend (tests, fault injection); its
    #                                 ``tier`` must still be one that trust allows
    sandbox_limits: Limits | None = None
    # The sandbox enforces the policy's command, write and read rules on any code it runs; a
    # tier that cannot refuses to start, unless this accepts the tool-call judging alone there.
    allow_weaker: bool = False
    audit: str | AuditLog = "memory:"  # a store URL (sqlite:///PATH, postgresql://...) or a log
    # HMAC key of the chain, when ``audit`` is a URL; the run store ``runs_url`` (or the audit
    # database) opens MACs the rows a resume acts on under a key derived from it
    audit_key: bytes | None = None
    # redact personal data (e-mails, phones, IPs, cards, ...) from the audit trail a URL opens;
    # None: when the policy declares the gdpr compliance profile
    redact_personal_data: bool | None = None
    limits: RunLimits = field(default_factory=RunLimits)  # per-run steps, wall time, tokens, dollars
    check: str | None = None  # the acceptance check: "success" only when this command passes at the end
    check_timeout_s: float | None = None  # its wall-clock limit (the sandbox default when None)
    tenant: str = "default"  # who shares the limits below (and whose runs a kill-all stops)
    rate_per_minute: int | None = None  # tool actions per rolling minute, over all runs of the tenant
    run_rate_per_minute: int | None = None  # tool actions per rolling minute, per run
    dollars_per_hour: float | None = None  # model spend per rolling hour, over all runs of the tenant
    limits_redis_url: str | None = None  # share the windows across processes and hosts (redis://...)
    # a window already shared (a service's, for every run of its process or, on Redis, of every
    # process): wins over limits_redis_url
    limits_window: Window | None = None
    rate_period_s: float = 60.0  # the rolling window of both rate limits (a minute unless shortened)
    on_rate_limit: OnLimit = OnLimit.WAIT  # a refused action waits for the window, or "stop"s the run
    on_spend_limit: OnLimit = OnLimit.STOP  # a full spend window stops the run, or "wait"s for it
    # a wait for a window longer than this stops the run resumable (``LimitWait``: status
    # "interrupted") instead of sleeping where it is; None waits in place however long
    limit_wait_in_place_s: float | None = None
    prices: Mapping[str, Price] | None = None  # None: DEFAULT_PRICES
    kill_target: str | None = None  # kill directory or redis://...; None: the default kill dir
    approver: Approver | None = None  # decides now (a function, cli_approver); None: always deferred
    approval_dir: str | Path | None = None  # deferred approvals; None: $STOCKADE_APPROVAL_DIR or default
    approval_store: ApprovalBook | None = None  # replaces approval_dir (a service's database)
    kill_source: KillSource | None = None  # replaces kill_target (a service's database)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)  # per provider, backend and tool
    # the agent's own breaker: this many failed actions in a row (errors, code that raised,
    # failed commands and test runs, denials) stop the run "broken", resumable; None: off
    max_consecutive_failures: int | None = DEFAULT_FAILURES
    anomaly: bool = True  # the anomaly monitor, with the policy's [anomaly] rules (False: off)
    # where a run an anomaly rule kills keeps its workspace for review (<dir>/<run id>/workspace);
    # None: in the run store, when there is one (stockade runs workspace RUN DEST)
    incident_dir: str | Path | None = None
    tools: Toolset | None = None  # None: default_toolset() (no raw shell)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    checkpointer: Checkpointer | None = None  # to resume in another process; a RunStore
    #                                          (open_run_store) also records retries, approvals, calls
    record_runs: bool = True  # without a checkpointer: record runs in a run store (`stockade runs`)
    # A run that pauses keeps its sandbox (a snapshot: its memory where the tier can, else its
    # files) and resumes from it in any process of this host; needs a checkpointer.
    keep_sandbox: bool = True
    # and after every tool call too, so that a crashed or killed run resumes from its last
    # call's sandbox; off: a microVM's memory snapshot costs seconds and its RAM in disk each time
    keep_sandbox_each_call: bool = False
    snapshot_store: SnapshotStore | None = None  # where they are kept; None: SnapshotStore.default()
    runs_url: str | None = None  # that run store; None: the audit database, when ``audit`` is a URL
    observers: Sequence[AgentObserver] = ()  # after the built-in ones
    runtime_observers: Sequence[RuntimeObserver] = ()  # retries, breakers, limits, kills, anomalies
    clock: Clock | None = None  # rolling windows, breakers, anomaly rules (tests pass a ManualClock)
    telemetry: Telemetry | None = None  # spans (run > model call / tool call > sandbox op), metrics

    def __post_init__(self) -> None:
        if self.trust is not None:  # "internal" is accepted for Trust.INTERNAL, and kept as the member
            object.__setattr__(self, "trust", check_choice(Trust, self.trust, argument="AgentConfig.trust"))
        if self.prefer is not None and self.prefer not in ("cheapest", "strongest"):
            raise InvalidArgument(
                f"AgentConfig.prefer is {self.prefer!r}",
                argument="AgentConfig.prefer",
                fix='give "cheapest" (the default) or "strongest"',
            )
        for name in ("on_rate_limit", "on_spend_limit"):
            chosen = check_choice(OnLimit, getattr(self, name), argument=f"AgentConfig.{name}")
            object.__setattr__(self, name, chosen)
        if self.rate_period_s <= 0:
            raise InvalidArgument(
                f"AgentConfig.rate_period_s is {self.rate_period_s!r}",
                argument="AgentConfig.rate_period_s",
                fix="give the rate limits' window in seconds, more than 0 (60: a minute)",
            )
        if self.kill_source is None:
            check_kill_target(self.kill_target)
        if self.tier is not None and self.tier not in _registry.TIERS:
            raise InvalidArgument(
                f"AgentConfig.tier is {self.tier!r}, which is no tier",
                argument="AgentConfig.tier",
                fix=f"give one of {', '.join(_registry.TIERS)}, or None to choose by trust",
            )


def effective_trust(policy: Policy, trust: Trust | None) -> Trust:
    """The stricter of the policy's trust and the caller's."""
    if trust is None:
        return policy.trust.level
    return max(policy.trust.level, check_choice(Trust, trust, argument="trust"), key=_TRUST_ORDER.index)


def _load(policy: str | Path | Policy | None, trust: Trust | None) -> Policy:
    if policy is None:  # no file: the caller's trust is the only word (default: untrusted)
        level = check_choice(Trust, trust, argument="trust") if trust is not None else Trust.UNTRUSTED
        return Policy(trust=TrustRules(level=level))
    loaded = policy if isinstance(policy, Policy) else load_policy(policy)
    level = effective_trust(loaded, trust)
    return loaded.model_copy(update={"trust": loaded.trust.model_copy(update={"level": level})})


def _choose_tier(
    engine: PolicyEngine, tier: str | None, backend: Backend | None, prefer: Preference | None = None
) -> tuple[str, str]:
    """The tier, and in words why it is that one."""
    asked = backend.tier if backend is not None else tier
    level = engine.policy.trust.level.value
    if asked is None:
        order = prefer or engine.policy.trust.prefer
        chosen = engine.select_tier(order)
        return chosen, f"the {order} tier trust {level!r} allows on this host"
    allowed = engine.allowed_tiers()
    if asked not in allowed:
        hint = (
            "a declared compliance profile needs the strongest isolation"
            if engine.policy.compliance.profiles
            else 'or, if your own team wrote the code this agent runs, set trust = "trusted" (the '
            "policy's [trust] level, or --trust trusted)"
        )
        raise TierUnavailable(
            f"tier {asked!r} is weaker than {engine.why_tiers()} allows (one of: "
            f"{', '.join(allowed) or 'none'}); use one of those tiers; {hint}"
        )
    return asked, f"{'the backend given' if backend is not None else 'asked for'}; trust {level!r} allows it"


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


def _decider_actor(by: str) -> str:
    """The trail's actor for a decision recorded as made by ``by``: a person, unless a program
    (an MCP client's elicitation) decided, or nobody did (a wait that ran out, a call its client
    gave up: ``system:timeout``, ``system:cancelled``); neither is recorded as a human."""
    if by.startswith(CLIENT_ACTOR):
        return by
    if by.startswith(SYSTEM_ACTOR):
        return SYSTEM_ACTOR + by.removeprefix(SYSTEM_ACTOR).partition(":")[0]
    if by.startswith("nobody"):  # a book written before ``unanswered``: no person either
        return SYSTEM_ACTOR + "unanswered"
    return "human:" + by if by else "human"


class _AuditedApprovals(Approvals):
    """Records each approval asked, granted or refused; a yes to the call or to one of its ops
    marks the call approved (what its code runs is covered by it), a yes to an exec does not."""

    def __init__(self, inner: Approvals, log: AuditLog) -> None:
        super().__init__(inner.approver, inner.store, max_pending=inner.max_pending)
        self.log = log
        # the runs whose trail has recorded that their requests were full: one event each, not
        # one per refused exec (2,000 refused execs were 2,000 "pending" events)
        self._full: set[str] = set()
        self._full_lock = threading.Lock()
        # the requests whose decision ``decide`` recorded, by run: the run asking again finds
        # it in the book, and records it no second time
        self._told: dict[str, set[str]] = {}

    def _decider(self, request: ApprovalRequest) -> str:
        """Who decided, as the approval book has it (``stockade approve --by``, the viewer, an
        MCP client's elicitation, an API token): the trail names them, not just "human"."""
        if self.store is None:
            return ""
        return next(
            (r.get("by", "") for r in self.store.requests(request.run_id) if r.get("id") == request.id), ""
        )

    def decide(self, request: ApprovalRequest, choice: Choice, *, by: str) -> None:
        """Write a decision to the book, and to the trail at once: a run that never asks for
        the request again (it ended, or the request was an exec refused on the spot) left it
        out of the trail (21 answered through MCP, 1 decision recorded)."""
        if self.store is None:
            raise ConfigurationError("no approval book to decide in: give the agent one")
        # Marked before the book has it: a run reading the decision as soon as it is written
        # (its require on another thread) finds it ours to record, and records it no second time.
        with self._full_lock:
            told = self._told.setdefault(request.run_id, set())
            mine = request.id not in told
            told.add(request.id)
        try:
            self.store.decide(request.run_id, request.id, choice, by=by)
        except BaseException:
            if mine:  # not decided: no decision for the run to leave to us
                with self._full_lock:
                    self._told.get(request.run_id, set()).discard(request.id)
            raise
        self._record(request, choice.value)

    def _recorded(self, request: ApprovalRequest) -> bool:
        """Whether ``decide`` recorded the decision the run now reads (once: a yes spent leaves
        the action to be asked anew, its next decision its own)."""
        with self._full_lock:
            told = self._told.get(request.run_id, set())
            found = request.id in told
            told.discard(request.id)
            return found

    def withdraw(self, run_id: str) -> list[ApprovalRequest]:
        closed = super().withdraw(run_id)
        for request in closed:
            self._record(request, "withdrawn")
        with self._full_lock:
            self._full.discard(run_id)
            self._told.pop(run_id, None)
        return closed

    def _record(self, request: ApprovalRequest, outcome: str, **more: object) -> None:
        decided = outcome not in ("pending", "withdrawn", "full")  # by a human, not asked or closed by us
        by = self._decider(request) if decided else ""
        # a withdrawal closes the run's requests after its calls: none of them is the one that
        # asked (its "pending" event names that one)
        step, call = (_call_at.get() or (0, None)) if outcome != "withdrawn" else (0, None)
        attributes: dict[str, object] = {
            "request_id": request.id,
            "action": request.action,
            "rule": request.rule,
            "reason": request.reason,
            "outcome": outcome,
            **more,
        }
        if call is not None:
            attributes["call_id"] = call
        actor = _decider_actor(by) if decided else "policy"
        if actor.startswith(SYSTEM_ACTOR):
            attributes["why"] = by  # what the actor leaves out: nobody answered within how long
        self.log.record(
            EventKind.APPROVAL,
            run_id=request.run_id,
            step=step,
            actor=actor,
            attributes=attributes,
        )

    def require(self, request: ApprovalRequest) -> None:
        request = self.keyed(request)  # the trail records the id the book keeps
        try:
            super().require(request)
        except ApprovalRequired:
            self._record(request, "pending")
            raise
        except ApprovalsFull:
            with self._full_lock:
                first = request.run_id not in self._full
                self._full.add(request.run_id)
            if first:  # the later ones are in the trail as the execs or calls refused
                self._record(request, "full", limit=self.max_pending)
            raise
        except PolicyDenied:
            if not self._recorded(request):
                self._record(request, "denied")
            raise
        if not self._recorded(request):
            self._record(request, "approved")
        if not _asking_for_exec.get():
            _call_approved.set(True)


def _record_denial(log: AuditLog, run_id: str, level: str, err: PolicyDenied, tool: str = "") -> None:
    attributes = {"decision": "deny", "level": level, "rule": err.rule, "reason": str(err), "tool": tool}
    if err.action:
        attributes["action"] = err.action
    step, call = (_call_at.get() or (0, None)) if level == "sandbox" else (0, None)
    if call is not None:
        attributes["call_id"] = call
    log.record(EventKind.POLICY_DECISION, run_id=run_id, step=step, actor="policy", attributes=attributes)


def _call_guard(inner: Guard) -> Guard:
    def guard(ctx: GuardContext, call: ToolCall) -> ToolCall:
        _call_approved.set(False)  # a new call: no approval yet (the loop records its denials)
        current_call.set(call.id)  # what its code runs inside the sandbox is recorded under it
        _call_at.set((ctx.step, call.id))
        return inner(ctx, call)

    return guard


def _op_guard(engine: PolicyEngine, approvals: Approvals, log: AuditLog) -> OpGuard:
    def guard(ctx: OpContext, op: Op[Any]) -> Op[Any]:
        decision = engine.op(op, tool=ctx.tool)
        if decision.verdict is Verdict.APPROVE and _call_approved.get():
            return op  # a human approved the tool call that issues this op
        try:
            enforce(decision, ctx, describe(op), approvals)
        except PolicyDenied as err:
            _record_denial(log, ctx.run_id, "sandbox", err, ctx.tool)
            raise
        return op

    return guard


def _audited_prompt_filter(engine: PolicyEngine, log: AuditLog, on_flag: FlagSink) -> AgentObserver:
    inner = prompt_filter(engine, on_flag=on_flag)

    def observe(event: AgentEvent) -> None:
        try:
            inner(event)
        except PolicyDenied as err:
            assert isinstance(event, RunStarted)
            _record_denial(log, event.run_id, "prompt", err)
            raise

    return observe


def _fan_out(observers: Sequence[RuntimeObserver]) -> RuntimeObserver:
    def observe(event: RuntimeEvent) -> None:
        for observer in observers:
            observer(event)

    return observe


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
        self.policy = _load(config.policy, config.trust)
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
        self.tier, self.tier_reason = _choose_tier(self.engine, config.tier, config.backend, config.prefer)
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
        self.runtime_observer = _fan_out((self._dispatch, *config.runtime_observers))
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
        self.approvals = _AuditedApprovals(
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
            _record_denial(log, "", "model", err)
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


class AgentSession:
    """One run id: its sandbox (wrapped as the module docstring says), its kill switch, its loop."""

    def __init__(self, owner: GuardedAgent, run_id: str, *, subject: str | None = None) -> None:
        config, log = owner.config, owner.audit_log
        check_id(run_id, argument="run_id")
        if log.redactor.text(run_id) != run_id:  # stored redacted, runs would share one id
            raise InvalidArgument(
                f"run id {run_id!r} holds what the audit trail's redactor removes (a secret, a token or "
                "personal data)",
                argument="run_id",
                fix="give an opaque id (leave it out for a random one)",
            )
        self.owner = owner
        self.run_id = run_id
        self.step = 0
        self.last: RunResult | None = None
        auditor = RuntimeAuditor(log, run_id=run_id)
        stored = isinstance(owner.checkpointer, RunStore)
        observers: list[AgentObserver] = [AuditObserver(log, stored=stored), auditor.track]
        runtime: list[RuntimeObserver] = [auditor]
        self.approvals: Approvals = owner.approvals
        self._recorder: RunRecorder | None = None
        if isinstance(owner.checkpointer, RunStore):  # retries, approvals and the ledger too
            recorder = self._recorder = RunRecorder(owner.checkpointer, run_id=run_id, subject=subject)
            recorder.setup = owner.run_setup()
            observers.append(recorder)
            runtime.append(recorder.runtime)
            self.approvals = recorder.approvals(owner.approvals)
        elif subject is not None:
            raise ConfigurationError(
                "a run's data subject is recorded in a run store: give audit= a database URL, or runs_url="
            )
        # A run about a data subject: its events' attributes sealed under a key of the run that
        # erasing the subject forgets (stockade.audit.sealing); a resumed one stays sealed.
        if subject is not None:
            log.seal_run(run_id, subject)
        else:
            log.continue_sealing(run_id)
        tools = owner.tools
        if config.telemetry is not None:  # a tool call's span is current while it runs
            traced = TelemetryObserver(config.telemetry)
            observers.append(traced)
            runtime.append(traced.runtime)
            tools = tools.wrapped(traced.tool_wrapper)
        self.runtime_observer = _fan_out(runtime)
        reported = _fan_out((*runtime, *config.runtime_observers))
        self.kill_switch = KillSwitch(
            run_id,
            [config.kill_source or kill_source_for(config.kill_target)],
            observer=reported,
            tenant=config.tenant,
        )
        # its tools' breakers its own (its sandbox's), the providers' and backends' shared
        self.breakers = RunBreakers.of(owner.breakers)
        monitor = self.monitor = (
            AnomalyMonitor(
                rules=owner.anomaly_rules,
                clock=owner.clock,
                observer=owner.runtime_observer,
                breakers=self.breakers,
                kill_switch=self.kill_switch,
                on_kill=self._isolate,
            )
            if config.anomaly and owner.policy.anomaly.enabled
            else None
        )
        self.controls = RuntimeControls(
            run_id=run_id,
            breakers=self.breakers,
            rate=owner.rate,
            rate_key=f"tenant:{config.tenant}",
            run_rate=owner.run_rate,
            on_rate_limit=config.on_rate_limit,
            limit_wait_in_place_s=config.limit_wait_in_place_s,
            clock=owner.clock,
            retrier=owner.retrier,
            observer=reported,
            kill_switch=self.kill_switch,
            monitor=monitor,
            failures=(
                AgentBreaker(threshold=config.max_consecutive_failures, observer=reported)
                if config.max_consecutive_failures is not None
                else None
            ),
        )
        self.agent = Agent(
            owner.model,
            tools=self.controls.wrap_tools(filter_outputs(owner.engine, tools, on_flag=self.controls.flag)),
            system_prompt=config.system_prompt,
            limits=config.limits,
            guards=[self.controls.guard, _call_guard(policy_guard(owner.engine, self.approvals, monitor))],
            observers=[
                *observers,
                _audited_prompt_filter(owner.engine, log, self.controls.flag),
                self.controls.observe,
                self._track_step,
                *config.observers,
            ],
            checkpointer=owner.checkpointer,
            prices=owner.prices,
            check=config.check,
            check_timeout_s=config.check_timeout_s,
            keeper=owner.keeper,
            hands_back=owner.engine.hands_back,
        )
        self._raw: Sandbox | None = None
        self._sandbox: Sandbox | None = None
        self._books: Sandbox | None = None
        self._state: RunState | None = None

    @property
    def baseline(self) -> str | None:
        """What identifies the run's diff baseline (``RunState.baseline``), once it started."""
        return self._state.baseline if self._state is not None else None

    def _isolate(self, finding: Finding) -> str:
        """An anomaly rule says kill: an incident. The workspace is kept for review first, then
        the monitor pulls the kill switch with the reason returned (the sandbox dies with it)."""
        return (
            f"incident: anomaly rule {finding.rule!r} fired ({finding.detail}); the run was "
            f"isolated: its sandbox killed, {self._keep_workspace()}"
        )

    def _keep_workspace(self) -> str:
        incident_dir = self.owner.config.incident_dir
        if incident_dir is not None and self._raw is not None:
            dest = Path(incident_dir) / self.run_id / "workspace"
            try:
                kept = self._raw.files.download_dir(dest)
            except StockadeError as err:
                return f"its workspace could not be kept in {dest} ({err})"
            if kept.skipped_count:  # the evidence is partial: say what it lacks
                named = ", ".join(f"{e.path!r} ({e.kind})" for e in kept.skipped[:5])
                more = " ..." if kept.skipped_count > 5 else ""
                return f"its workspace kept in {dest}, {kept.skipped_count} entries left out: {named}{more}"
            return f"its workspace kept in {dest}"
        if isinstance(self.owner.checkpointer, RunStore):  # as its last tool call left it
            return f"its workspace kept in the run store (stockade runs workspace {self.run_id} DEST)"
        return "its workspace not kept (no run store, no incident_dir)"

    def _track_step(self, event: AgentEvent) -> None:
        if isinstance(event, ModelRequested | ToolCalled):
            self.step = event.step
        if isinstance(event, ToolReturned):
            _call_approved.set(False)  # the approval covered that call's ops, and no others
        if isinstance(event, ModelRequested | ToolReturned | ToolDenied | ToolRejected):
            # the call is over: what runs next in the sandbox is no call's (it was recorded
            # under the last call's id: the acceptance check's execs, a later withdrawal)
            current_call.set(None)
            _call_at.set(None)
        elif isinstance(event, ModelResponded) and not event.response.tool_calls and self.agent.check:
            current_call.set(CHECK_CALL)  # a final answer: the acceptance check runs next

    @contextlib.contextmanager
    def open(self, workspace: str | Path | None) -> Iterator[AgentSession]:
        owner = self.owner
        rules = owner.engine.sandbox_rules()
        # what of the workspace the sandbox is not given: what the rules hide (paths.deny, data
        # classes above the role, a repository's history) and the agent's own records inside it
        hide = rules.hide
        if workspace is not None:  # checked before a sandbox starts, not after
            hide = (*hide, *within(check_host_path(workspace, argument="workspace"), owner.own_records()))
        if self._recorder is not None and workspace is not None:
            # kept with the run, for ``stockade replay``: what the sandbox was given, no more
            self._recorder.seed = workspace
            self._recorder.seed_hide, self._recorder.seed_read = hide, rules.read
        telemetry = owner.config.telemetry
        tier = owner.backend if telemetry is None else TracedBackend(owner.backend, telemetry)
        backend = AuditedBackend(
            BreakingBackend(RetryingBackend(tier, owner.retrier), owner.breakers),
            owner.audit_log,
            run_id=self.run_id,
            step=lambda: self.step,
        )
        with self._start(backend, workspace, hide) as raw:
            self._raw = raw
            killable = self.controls.protect(raw)
            guard = _op_guard(owner.engine, self.approvals, owner.audit_log)
            ctx = OpContext(run_id=self.run_id, role=owner.engine.role_name)
            self._sandbox = Sandbox(GuardedInstance(killable.instance, guard, ctx))
            # the run's own records (baseline, diff, saved outputs): killable and audited, but
            # not subject to the model's path rules; the sandbox confines them to the workspace
            self._books = killable
            with self.controls.watch():
                yield self

    def _start(self, backend: Backend, workspace: str | Path | None, hide: tuple[str, ...]) -> Sandbox:
        """The run's sandbox: from the snapshot the run kept when it paused, if a sandbox started
        from it is the one the run gets now (``RunSnapshots.restorable``: the policy's network
        and rules as they are now), else new (the run store puts its files back, as for a run
        without a snapshot), seeded with what the rules let it read of ``workspace`` but what
        ``hide`` names (``open``: the rules' hidden paths and the agent's own records)."""
        owner = self.owner
        limits, allow_weaker = owner.config.sandbox_limits, owner.config.allow_weaker
        network = owner.engine.network_policy()  # the role's hosts and credentials
        rules = owner.engine.sandbox_rules()
        keeper = owner.keeper
        kept = None
        if keeper is not None:
            wanted = limits or Limits()
            kept = keeper.restorable(
                self.run_id, tier=backend.tier, limits=wanted, network=network, rules=rules
            )
        if keeper is not None and kept is not None:
            # its files are the snapshot's, not the seed's; a memory snapshot's machine is as it
            # was (restorable checked that it is the one the run gets now)
            memory = kept.kind is SnapshotKind.MEMORY
            try:
                return Sandbox.create(
                    backend=backend,
                    snapshot=kept,
                    store=keeper.store,
                    limits=None if memory else limits,
                    network=None if memory else network,
                    rules=rules,
                    approver=self._approve_exec,
                    allow_weaker=allow_weaker,
                )
            except (SnapshotIncompatible, SnapshotNotFound) as err:  # another QEMU since, a gc
                log.warning("run %s: its kept sandbox was not restored (%s): files only", self.run_id, err)
        sandbox = Sandbox.create(
            backend=backend,
            limits=limits,
            network=network,
            rules=rules,
            approver=self._approve_exec,
            allow_weaker=allow_weaker,
        )
        if workspace is not None:
            try:
                sandbox.files.upload_dir(workspace, hide=hide, read=rules.read)
            except BaseException:
                sandbox.close()
                raise
        return sandbox

    def _approve_exec(self, record: ExecRecord) -> bool:
        """An exec inside the sandbox that the rules send for approval: the approvals of the
        run decide (a deferred approval refuses now and lets the same exec run once it is
        given). A human approving the tool call approves what its code runs for it, only where
        the sandbox says nothing else can have started the exec (``ExecRecord.own_code``): in
        an interpreter that earlier calls ran code in, what they left behind (a thread, a
        signal handler, a rebound name) runs during the call, and each exec is asked."""
        if _call_approved.get() and record.own_code:
            return True
        redactor = self.owner.audit_log.redactor

        def said(redact: Callable[[str], str]) -> str:
            argv = shlex.join(map(redact, record.argv))
            if record.runs:  # the code chose argv (exec -a, a copy renamed, a #! line): say what runs
                return f"run `{shlex.join(map(redact, record.runs))}` (started as `{argv}`)"
            return f"run `{argv}`"

        # Shown as the trail has the exec (a word the sandbox cut keeps no head of a credential),
        # asked as it is: the id stands for the exec, not for every exec masked alike.
        request = ApprovalRequest(
            run_id=self.run_id,
            action=shown(said(functools.partial(exec_word, redactor))),
            asked_as=shown(said(str)),
            rule=record.rule,
            reason=f"code in the sandbox starts {visible(record.path)}, which needs a human's approval",
        )
        asking = _asking_for_exec.set(True)
        try:
            self.approvals.require(request)
        except (PolicyDenied, ApprovalRequired):
            return False
        finally:
            _asking_for_exec.reset(asking)
        return True

    @property
    def sandbox(self) -> Sandbox:
        """The sandbox the agent's tools use (policy-guarded, killable, audited)."""
        if self._sandbox is None:
            raise ConfigurationError("the session is not open")
        return self._sandbox

    def save_workspace(self, dest: str | Path) -> None:
        """Copy the run's workspace to the host (to resume a paused run in another process)."""
        if self._raw is None:
            raise ConfigurationError("the session is not open")
        self._raw.files.download_dir(dest)

    async def _drive(self, task: str | None, resume: str | RunState | None) -> RunResult:
        async with self.agent.iter(
            task, sandbox=self.sandbox, resume=resume, run_id=self.run_id, bookkeeping=self._books
        ) as run:
            run.state.audit_id = self.run_id  # the audit trail files this run's events under its id
            self._state = run.state
            async for _ in run:
                pass
        assert run.result is not None
        self.last = run.result
        if not run.result.status.resumable:  # what nobody decided waits for nothing now
            self.approvals.withdraw(self.run_id)
        return run.result

    async def run(self, task: str) -> RunResult:
        store, kept = self.approvals.store, self.owner.checkpointer
        if isinstance(store, ApprovalStore) and (kept is None or kept.load(self.run_id) is None):
            # A new run under an id used before (one its run store has is refused instead): it
            # starts with no decision; the last one's approvals let the same calls run unasked.
            store.forget(self.run_id)
        return await self._drive(task, None)

    def interrupt(self, reason: str = "interrupted") -> None:
        """Stop the run now, from any thread (a signal handler, a UI): the sandbox is killed
        mid-command and the run ends "interrupted", resumable from its last state. Save the
        workspace first (``save_workspace``) to resume it in another sandbox."""
        self.kill_switch.interrupt(reason)

    async def resume(self) -> RunResult:
        """Continue the run after a pause or an interruption (from the checkpointer, else from
        the last result)."""
        book = self.approvals.store
        if self.monitor is not None and book is not None:  # what it held before is asked again
            held = book.requests(self.run_id)
            self.monitor.recall({r["action"]: r["reason"] for r in held if r.get("rule") == ANOMALY_RULE})
        if self.owner.checkpointer is not None:
            return await self._drive(None, self.run_id)
        if self.last is None or not self.last.status.resumable:
            raise ConfigurationError("nothing to resume: no paused run here and no checkpointer")
        return await self._drive(None, self.last.state)

    def run_sync(self, task: str) -> RunResult:
        return _sync(self.run(task))

    def resume_sync(self) -> RunResult:
        return _sync(self.resume())


def _sync(coro: Coroutine[object, object, RunResult]) -> RunResult:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise ConfigurationError("run_sync() inside a running event loop: use `await session.run(...)`")


def build_agent(config: AgentConfig) -> GuardedAgent:
    """Load the policy, choose the tier by trust (failing closed), open the audit trail, and
    assemble the wrappers in the order the module docstring gives. Close it (``with``) to flush
    the audit trail."""
    return GuardedAgent(config)
