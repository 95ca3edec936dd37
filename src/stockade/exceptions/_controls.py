"""``PolicyDenied`` and ``RuntimeLimit`` with their kinds: a guard or a runtime control (a
breaker, a rate window, a quota, a busy session, a deferred run) refused an action.

Apart because the run goes on after these: the action is refused, for good or for now.
"""

from __future__ import annotations

from stockade.exceptions._base import StockadeError


class PolicyDenied(StockadeError):
    """A guard refused the action. The agent feeds this back to the model; it is not a crash."""

    caller_error = True

    def __init__(self, message: str, *, rule: str = "", action: str = "") -> None:
        super().__init__(message)
        self.rule = rule
        self.action = action


class ApprovalsFull(PolicyDenied):
    """An action that needs approval, asked while its run already has ``limit`` requests
    pending (``RunLimits.max_pending_approvals``): refused on the spot, and no request is kept
    (one run's code looping over distinct ``rm -r X$i`` kept 2,000 requests in 21 s, and
    every read of the run returned them all). The requests already pending wait as before."""

    def __init__(self, message: str, *, rule: str = "", action: str = "", limit: int = 0) -> None:
        super().__init__(message, rule=rule, action=action)
        self.limit = limit


class RuntimeLimit(StockadeError):
    """A runtime control (a circuit breaker, a rate limit) refused this action for now; the
    run goes on. Controls that end the run (budgets, the spend limit, the kill switch) raise
    ``RunStopped`` instead."""


class CircuitOpen(RuntimeLimit):
    """The breaker of ``name`` is open after repeated failures; it half-opens after ``retry_after``."""

    retryable = True

    def __init__(self, message: str, *, name: str = "", retry_after: float | None = None) -> None:
        super().__init__(message, retry_after=retry_after)
        self.name = name


class RateLimited(RuntimeLimit):
    """Too many actions in the rolling window; the next one fits after ``retry_after``."""

    retryable = True

    def __init__(self, message: str, *, key: str = "", retry_after: float | None = None) -> None:
        super().__init__(message, retry_after=retry_after)
        self.key = key


class QuotaExceeded(RuntimeLimit):
    """A tenant's quota is full: ``quota`` names it (``sandboxes``, ``cpus``, ``memory_mb``),
    ``limit`` is its size and ``used`` what is taken. Retrying helps only once something of
    the tenant's is deleted, so it is not ``retryable``."""

    def __init__(self, message: str, *, quota: str = "", limit: float = 0, used: float = 0) -> None:
        super().__init__(message)
        self.quota = quota
        self.limit = limit
        self.used = used


class SessionBusy(RuntimeLimit):
    """An MCP session has as many calls waiting behind its running one as it queues, or the
    server holds as many bytes of queued arguments as it keeps: the call is refused, not
    held; retry it once the session's calls have returned."""

    retryable = True


class RunDeferred(RuntimeLimit):
    """A service run stopped where it was to wait for its tenant's rate or spend window
    (``LimitWait``): its executor runs it again after ``retry_after``, holding no worker, thread
    or quota meanwhile. Not ``retryable`` in the generic sense: the executor schedules it."""

    def __init__(self, message: str, *, kind: str = "", retry_after: float | None = None) -> None:
        super().__init__(message, retry_after=retry_after)
        self.kind = kind
