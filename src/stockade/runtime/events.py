"""What the runtime controls report: one frozen value per kind of decision.

Every control takes an ``observer`` (a plain callable); the audit trail, logs and traces
subscribe by passing one. Observers must not raise: a control never fails because its
reporting did.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "AnomalyAction",
    "AnomalyFlagged",
    "BreakerChanged",
    "BreakerState",
    "FlakyRerun",
    "KillRequested",
    "LimitHit",
    "Observer",
    "PromptFlagged",
    "RetryScheduled",
    "RuntimeEvent",
    "fan_out",
    "ignore",
]


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class AnomalyAction(enum.StrEnum):
    WARN = "warn"
    REQUIRE_APPROVAL = "require_approval"
    OPEN_BREAKER = "open_breaker"
    KILL = "kill"


@dataclass(frozen=True, kw_only=True)
class RetryScheduled:
    """``subject`` failed transiently on ``attempt``; it runs again after ``delay_s``."""

    subject: str
    attempt: int
    delay_s: float
    reason: str


@dataclass(frozen=True, kw_only=True)
class FlakyRerun:
    """A failing test command was run a second time because the caller accepts flakiness."""

    subject: str
    first_exit_code: int
    second_exit_code: int


@dataclass(frozen=True, kw_only=True)
class BreakerChanged:
    name: str
    old: BreakerState
    new: BreakerState
    failures: int
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class LimitHit:
    """A rate limit, spend limit or budget refused an action. ``action`` says what came of it:
    "refuse" (the caller was told), "wait" (the run waits for the window), "defer" (the run
    stops resumable and is run again once the window frees), "stop" (the run ends)."""

    kind: str
    key: str
    detail: str
    retry_after: float | None = None
    action: str = "refuse"


@dataclass(frozen=True, kw_only=True)
class AnomalyFlagged:
    rule: str
    detail: str
    action: AnomalyAction
    subject: str = ""


@dataclass(frozen=True, kw_only=True)
class PromptFlagged:
    """Prompt rules whose action is "flag" matched the task (``source`` "task") or a tool's
    output ("tool_output", ``tool``): recorded, logged and counted; the run goes on."""

    rules: tuple[str, ...]
    source: str
    tool: str = ""


@dataclass(frozen=True, kw_only=True)
class KillRequested:
    run_id: str
    reason: str
    killed_instances: int = 0
    interrupted: bool = False  # stopped to be resumed (Ctrl-C, SIGTERM), not killed for good


RuntimeEvent = (
    RetryScheduled | FlakyRerun | BreakerChanged | LimitHit | AnomalyFlagged | PromptFlagged | KillRequested
)
Observer = Callable[[RuntimeEvent], None]


def ignore(event: RuntimeEvent) -> None:
    """The default observer."""


def fan_out(observers: Sequence[Observer]) -> Observer:
    def observe(event: RuntimeEvent) -> None:
        for observer in observers:
            observer(event)

    return observe
