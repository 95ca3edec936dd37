"""A monitor over the stream of actions that flags what a healthy run does not do.

Each rule looks at the new action and the recent history and returns a reason when it fires;
each rule carries its action: warn, require approval (the next action waits for a human),
open the breaker of the action's subject, or kill the run. A rule that fired stays quiet for
its window, so a flood is reported once, not once per action.

An action failed when its tool raised or its result said so (code that raised, a failed
command or test run): ``ActionRecord.ok`` is False for both. Text that a prompt rule flagged
is fed in too (``flagged``), for ``FlaggedContent``. ``configured_rules`` builds the rules from
settings (thresholds, windows, actions, on/off), as the policy file's ``[anomaly]`` gives them.

A kill is an incident: ``on_kill`` (when given) isolates the run, keeping what must be kept for
review, and returns the reason the run is killed with; without it the kill switch is pulled.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from stockade.exceptions import ConfigurationError
from stockade.runtime.breaker import Breakers
from stockade.runtime.clock import Clock, SystemClock
from stockade.runtime.events import AnomalyAction, AnomalyFlagged, Observer, ignore
from stockade.runtime.killswitch import KillSwitch

__all__ = [
    "ANOMALY_RULE",
    "ActionRecord",
    "AnomalyMonitor",
    "Burst",
    "CostSpike",
    "Finding",
    "FlaggedContent",
    "OutputFlood",
    "RepeatedDenials",
    "RepeatedFailure",
    "Rule",
    "configured_rules",
    "default_rules",
]


@dataclass(frozen=True, kw_only=True)
class ActionRecord:
    """One action as the monitor sees it. ``fingerprint`` identifies "the same action"
    (tool and arguments); ``subject`` names its breaker (``tool:run_code``)."""

    subject: str
    fingerprint: str
    ok: bool = True
    denied: bool = False
    flagged: bool = False  # a prompt rule flagged the task or a tool's output (not an action)
    dollars: float = 0.0
    output_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class Seen:
    at: float
    record: ActionRecord


@dataclass(frozen=True, kw_only=True)
class Finding:
    rule: str
    detail: str
    action: AnomalyAction
    subject: str


@dataclass(frozen=True, kw_only=True)
class RepeatedFailure:
    """The same action failed ``times`` times in a row."""

    times: int = 3
    action: AnomalyAction = AnomalyAction.OPEN_BREAKER
    window_s: float = 600.0
    name: str = "repeated_failure"

    def check(self, new: Seen, history: Sequence[Seen]) -> str | None:
        if new.record.ok:
            return None
        same = [s for s in history if s.record.fingerprint == new.record.fingerprint]
        streak = 0
        for seen in reversed(same):
            if seen.record.ok:
                break
            streak += 1
        if streak >= self.times:
            return f"{new.record.subject} failed {streak} times in a row with the same arguments"
        return None


@dataclass(frozen=True, kw_only=True)
class Burst:
    """More than ``actions`` actions within ``window_s``."""

    actions: int = 30
    window_s: float = 10.0
    action: AnomalyAction = AnomalyAction.REQUIRE_APPROVAL
    name: str = "burst"

    def check(self, new: Seen, history: Sequence[Seen]) -> str | None:
        if new.record.flagged:
            return None  # a flag is no action
        recent = sum(1 for s in history if not s.record.flagged and s.at > new.at - self.window_s)
        if recent > self.actions:
            return f"{recent} actions within {self.window_s:g}s"
        return None


@dataclass(frozen=True, kw_only=True)
class CostSpike:
    """Spend within ``window_s`` above ``dollars``."""

    dollars: float = 1.0
    window_s: float = 60.0
    action: AnomalyAction = AnomalyAction.KILL
    name: str = "cost_spike"

    def check(self, new: Seen, history: Sequence[Seen]) -> str | None:
        spent = sum(s.record.dollars for s in history if s.at > new.at - self.window_s)
        if spent > self.dollars:
            return f"${spent:.2f} spent within {self.window_s:g}s (threshold ${self.dollars:.2f})"
        return None


@dataclass(frozen=True, kw_only=True)
class RepeatedDenials:
    """``times`` denied attempts within ``window_s``: probing the policy."""

    times: int = 3
    window_s: float = 300.0
    action: AnomalyAction = AnomalyAction.REQUIRE_APPROVAL
    name: str = "repeated_denials"

    def check(self, new: Seen, history: Sequence[Seen]) -> str | None:
        if not new.record.denied:
            return None
        denied = sum(1 for s in history if s.record.denied and s.at > new.at - self.window_s)
        if denied >= self.times:
            return f"{denied} denied attempts within {self.window_s:g}s"
        return None


@dataclass(frozen=True, kw_only=True)
class OutputFlood:
    """More than ``max_bytes`` of output within ``window_s``."""

    max_bytes: int = 16 * 1024 * 1024
    window_s: float = 60.0
    action: AnomalyAction = AnomalyAction.WARN
    name: str = "output_flood"

    def check(self, new: Seen, history: Sequence[Seen]) -> str | None:
        total = sum(s.record.output_bytes for s in history if s.at > new.at - self.window_s)
        if total > self.max_bytes:
            return f"{total} bytes of output within {self.window_s:g}s"
        return None


@dataclass(frozen=True, kw_only=True)
class FlaggedContent:
    """``times`` flags of prompt rules within ``window_s``: the task or the tools' outputs keep
    matching what the policy watches for (a prompt injection, data that should not be there)."""

    times: int = 3
    window_s: float = 600.0
    action: AnomalyAction = AnomalyAction.REQUIRE_APPROVAL
    name: str = "flagged_content"

    def check(self, new: Seen, history: Sequence[Seen]) -> str | None:
        if not new.record.flagged:
            return None
        flags = sum(1 for s in history if s.record.flagged and s.at > new.at - self.window_s)
        if flags >= self.times:
            return f"{flags} flags of prompt rules within {self.window_s:g}s"
        return None


Rule = RepeatedFailure | Burst | CostSpike | RepeatedDenials | OutputFlood | FlaggedContent


def default_rules() -> tuple[Rule, ...]:
    return (RepeatedFailure(), Burst(), CostSpike(), RepeatedDenials(), OutputFlood(), FlaggedContent())


def configured_rules(settings: Mapping[str, Mapping[str, object]]) -> tuple[Rule, ...]:
    """The default rules with ``settings[name]`` applied: ``enabled`` (False drops the rule) and
    any of the rule's own fields (``times``, ``window_s``, ``action``, ...)."""
    defaults = {rule.name: rule for rule in default_rules()}
    unknown = sorted(set(settings) - set(defaults))
    if unknown:
        known = ", ".join(defaults)
        raise ConfigurationError(f"no anomaly rule {', '.join(unknown)}; the rules are: {known}")
    rules: list[Rule] = []
    for name, rule in defaults.items():
        changes = dict(settings.get(name, {}))
        if not changes.pop("enabled", True):
            continue
        fields = {f.name for f in dataclasses.fields(rule)} - {"name"}
        wrong = sorted(set(changes) - fields)
        if wrong:
            raise ConfigurationError(f"anomaly rule {name} has no setting {', '.join(wrong)}")
        if "action" in changes:
            changes["action"] = AnomalyAction(str(changes["action"]))
        rules.append(dataclasses.replace(rule, **changes))  # type: ignore[arg-type]
    return tuple(rules)


ANOMALY_RULE = "anomaly"  # the rule an action the monitor holds for a human is asked under


@dataclass(kw_only=True)
class AnomalyMonitor:
    """Feed it every action (``observe``); it applies each firing rule's action."""

    rules: Sequence[Rule] = field(default_factory=default_rules)
    clock: Clock = field(default_factory=SystemClock)
    observer: Observer = ignore
    breakers: Breakers | None = None
    kill_switch: KillSwitch | None = None
    on_kill: Callable[[Finding], str] | None = None  # isolates the run; returns the kill's reason
    history_s: float = 600.0
    approval_reason: str | None = None
    # the actions it held for a human, by their words: asked again whenever they come again (a
    # resumed run's parked call runs under the decision, not freely)
    _held: dict[str, str] = field(default_factory=dict)
    _history: deque[Seen] = field(default_factory=deque)
    _quiet_until: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, record: ActionRecord) -> tuple[Finding, ...]:
        with self._lock:
            now = self.clock.monotonic()
            new = Seen(at=now, record=record)
            self._history.append(new)
            kept = max(self.history_s, *(rule.window_s for rule in self.rules))
            while self._history and self._history[0].at < now - kept:
                self._history.popleft()
            history = tuple(self._history)
            findings = []
            for rule in self.rules:
                key = f"{rule.name}:{record.fingerprint if rule.name == 'repeated_failure' else ''}"
                if self._quiet_until.get(key, float("-inf")) > now:
                    continue
                detail = rule.check(new, history)
                if detail is not None:
                    self._quiet_until[key] = now + rule.window_s
                    findings.append(
                        Finding(rule=rule.name, detail=detail, action=rule.action, subject=record.subject)
                    )
        for finding in findings:
            self._apply(finding)
        return tuple(findings)

    def _apply(self, finding: Finding) -> None:
        self.observer(
            AnomalyFlagged(
                rule=finding.rule, detail=finding.detail, action=finding.action, subject=finding.subject
            )
        )
        match finding.action:
            case AnomalyAction.REQUIRE_APPROVAL:
                self.approval_reason = f"{finding.rule}: {finding.detail}"
            case AnomalyAction.OPEN_BREAKER if self.breakers is not None:
                self.breakers.get(finding.subject).trip(f"anomaly {finding.rule}: {finding.detail}")
            case AnomalyAction.KILL if self.kill_switch is not None:
                reason = f"anomaly {finding.rule}: {finding.detail}"
                if self.on_kill is not None:
                    reason = self.on_kill(finding)
                self.kill_switch.kill(reason)
            case _:
                pass

    def take_approval_reason(self) -> str | None:
        """Why the next action needs a human (once)."""
        with self._lock:
            reason, self.approval_reason = self.approval_reason, None
            return reason

    def hold(self, action: str) -> str | None:
        """Why ``action`` needs a human: the flag a finding put on the next action (which this
        one takes), or the one an earlier finding put on this same action. The approval guard
        asks this of every action the policy allows."""
        reason = self.take_approval_reason()
        with self._lock:
            if reason is not None:
                self._held[action] = reason
                return reason
            return self._held.get(action)

    def recall(self, held: Mapping[str, str]) -> None:
        """Actions an earlier process of this run held (from its approval book), by their words."""
        with self._lock:
            self._held.update(held)
