"""``AgentConfig``: everything ``build_agent`` needs, each field checked when the value is made.

A value of its own, apart from the assembly: the command line, the service and replay build
and check one before anything is assembled from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from stockade._checks import check_choice
from stockade.agent.checkpoint import Checkpointer
from stockade.agent.events import Observer as AgentObserver
from stockade.agent.loop import DEFAULT_SYSTEM_PROMPT, RunLimits
from stockade.audit.log import AuditLog
from stockade.exceptions import InvalidArgument
from stockade.models.base import Model
from stockade.models.pricing import Price
from stockade.observability.telemetry import Telemetry
from stockade.policy.approval import Approver
from stockade.policy.approval_book import ApprovalBook
from stockade.policy.schema import Policy
from stockade.runtime.breaker import BreakerConfig
from stockade.runtime.clock import Clock
from stockade.runtime.events import Observer as RuntimeObserver
from stockade.runtime.failures import DEFAULT_FAILURES
from stockade.runtime.kill_sources import KillSource, check_kill_target
from stockade.runtime.limits import OnLimit, Window
from stockade.runtime.retry import RetryPolicy
from stockade.sandbox import _registry
from stockade.sandbox._registry import Preference
from stockade.sandbox.base import Backend
from stockade.sandbox.snapshots import SnapshotStore
from stockade.tools.base import Toolset
from stockade.types import Limits, Trust

__all__ = ["AgentConfig"]


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
