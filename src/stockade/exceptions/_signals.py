"""``RunStopped`` and its kinds: the signals a control raises to end a run with a status
(budget, killed, interrupted, broken, paused).

Apart because they are control flow, not errors: they derive from ``BaseException``, so that
no ``except Exception`` swallows them on their way to the loop.
"""

from __future__ import annotations

from typing import ClassVar

from stockade.exceptions._base import _Raised


class RunStopped(_Raised):
    """Raised by a control (guard, observer, tool or model wrapper) to end an agent run.

    Not an error (it derives from ``BaseException``, not ``StockadeError``): the loop ends the
    run with ``status`` instead of crashing, and nothing on the way may take it for a failure
    to report, count or retry. Subclasses name new statuses.
    """

    status: ClassVar[str] = "killed"


class BudgetExceeded(RunStopped):
    """A budget is spent: ``kind`` is steps, wall_time, tokens, dollars or dollars_per_hour."""

    status = "budget"

    def __init__(self, message: str, *, kind: str = "", retry_after: float | None = None) -> None:
        super().__init__(message, retry_after=retry_after)
        self.kind = kind


class RunKilled(RunStopped):
    """The kill switch of ``run_id`` was pulled (CLI, Redis key, file or API)."""

    status = "killed"

    def __init__(self, message: str, *, run_id: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.run_id = run_id
        self.reason = reason


class RunInterrupted(RunStopped):
    """The run was stopped from outside its loop (Ctrl-C, SIGTERM, ``AgentSession.interrupt()``)
    mid-step: its sandbox was killed, its state kept; resume it to run the interrupted step again."""

    status = "interrupted"

    def __init__(self, message: str, *, run_id: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.run_id = run_id
        self.reason = reason


class CircuitBroken(RunStopped):
    """The agent's circuit breaker tripped: its last ``len(failures)`` actions all failed (each
    named in ``failures`` with its error). The run stops, resumable once a person has looked."""

    status = "broken"

    def __init__(self, message: str, *, failures: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.failures = failures


class LimitWait(RunStopped):
    """A rate or spend window is full for longer than the run waits in place (``kind``: "rate"
    or "spend", ``key`` the window's): the run stops where it is, its state kept and the call it
    was about to make not made, so that a worker is not held asleep; resume it after
    ``retry_after`` (the service's executors do)."""

    status = "interrupted"

    def __init__(
        self, message: str, *, kind: str = "", key: str = "", retry_after: float | None = None
    ) -> None:
        super().__init__(message, retry_after=retry_after)
        self.kind = kind
        self.key = key


class ApprovalRequired(RunStopped):
    """The action waits for a human decision: the run pauses (state saved) and is resumed once
    ``request_id`` is approved or denied (``stockade approve|deny RUN_ID REQUEST_ID``)."""

    status = "paused"

    def __init__(self, message: str, *, rule: str = "", action: str = "", request_id: str = "") -> None:
        super().__init__(message)
        self.rule = rule
        self.action = action
        self.request_id = request_id
