"""A monitor over the stream of actions that flags what a healthy run does not do.

Each rule looks at the new action and the recent history and returns a reason when it fires;
each rule carries its action: warn, require approval (the next action waits for a human),
open the breaker of the action's subject, or kill the run. A rule that fired stays quiet for
its window, so a flood is reported once, not once per action.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from stockade.runtime.breaker import Breakers
from stockade.runtime.clock import Clock, SystemClock
from stockade.runtime.events import AnomalyAction, AnomalyFlagged, Observer, ignore
from stockade.runtime.killswitch import KillSwitch

__all__ = [
    "ActionRecord",
    "AnomalyMonitor",
    "Burst",
    "CostSpike",
    "Finding",
    "OutputFlood",
    "RepeatedDenials",
    "RepeatedFailure",
    "Rule",
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
        recent = sum(1 for s in history if s.at > new.at - self.window_s)
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


Rule = RepeatedFailure | Burst | CostSpike | RepeatedDenials | OutputFlood


def default_rules() -> tuple[Rule, ...]:
    return (RepeatedFailure(), Burst(), CostSpike(), RepeatedDenials(), OutputFlood())


@dataclass(kw_only=True)
class AnomalyMonitor:
    """Feed it every action (``observe``); it applies each firing rule's action."""

    rules: Sequence[Rule] = field(default_factory=default_rules)
    clock: Clock = field(default_factory=SystemClock)
    observer: Observer = ignore
    breakers: Breakers | None = None
    kill_switch: KillSwitch | None = None
    history_s: float = 600.0
    approval_reason: str | None = None
    _history: deque[Seen] = field(default_factory=deque)
    _quiet_until: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, record: ActionRecord) -> tuple[Finding, ...]:
        with self._lock:
            now = self.clock.monotonic()
            new = Seen(at=now, record=record)
            self._history.append(new)
            while self._history and self._history[0].at < now - self.history_s:
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
                self.kill_switch.kill(f"anomaly {finding.rule}: {finding.detail}")
            case _:
                pass

    def take_approval_reason(self) -> str | None:
        """Why the next action needs a human (once): the approval guard asks this."""
        with self._lock:
            reason, self.approval_reason = self.approval_reason, None
            return reason
