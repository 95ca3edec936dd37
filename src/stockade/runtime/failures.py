"""The agent's own circuit breaker: a run whose actions keep failing stops.

An action fails when its tool raised, its result says so (code that raised, a command or a
test run that failed: ``ToolCallRecord.failed``), it was denied by the policy, or the model
called a tool wrongly. ``threshold`` failures in a row (any success resets the count) trip
the breaker: it reports ``BreakerChanged(name="agent", ...)`` at once (the audit trail files
it under the step), and the run stops before its next action (the next model request or tool
call) with ``CircuitBroken``, status "broken", naming each failed action and its error. A
broken run is kept resumable: a person looks at it, fixes what needs fixing, and resumes it,
which closes the breaker. A run resumed after a crash counts its last actions again.

The per-provider (``model:<name>``) and per-backend (``backend:<tier>``) breakers of
``stockade.runtime.breaker`` protect shared services across runs; this one judges one run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from stockade.agent.events import (
    AgentEvent,
    ModelRequested,
    RunResumed,
    RunStarted,
    ToolDenied,
    ToolRejected,
    ToolReturned,
)
from stockade.agent.state import RunState, RunStatus, ToolCallRecord
from stockade.audit.redact import Redactor
from stockade.exceptions import CircuitBroken, ConfigurationError
from stockade.runtime.events import BreakerChanged, BreakerState, Observer, ignore

__all__ = ["DEFAULT_FAILURES", "AgentBreaker", "describe_failure"]

DEFAULT_FAILURES = 5
_SHOWN = 200  # characters of each failure's error kept in the reason
_HEADS = Redactor()  # credential shapes only: what a run registered is redacted where it is recorded


def _cut(text: str) -> str:
    """``text`` on one line, at most ``_SHOWN`` characters. A reason goes to the trail and the
    run's error, whose redaction sees only what is kept: a credential the cut ends keeps no head
    (``Redactor.head``; a whole one is redacted there as anywhere)."""
    text = " ".join(text.split())
    return text if len(text) <= _SHOWN else _HEADS.head(text[: _SHOWN - 1]) + "…"


def describe_failure(step: int, record: ToolCallRecord) -> str:
    """One failed action in words: the tool, the step, and the error the model was shown."""
    lines = [line.strip() for line in record.observation.splitlines() if line.strip()]
    if record.denied or record.error_type is not None:
        why = lines[0] if lines else record.error_type or "failed"
    else:  # a result that reported failure: its error line, else its first (the exit code)
        errors = [line for line in lines if line.startswith("error:")]
        why = errors[-1] if errors else (lines[0] if lines else "failed")
    return f"{record.call.name} (step {step}): {_cut(why)}"


@dataclass(kw_only=True)
class AgentBreaker:
    """An agent observer (``observe``) and guard (``check`` before each action) for one run."""

    threshold: int = DEFAULT_FAILURES
    observer: Observer = ignore
    _failures: list[str] = field(default_factory=list)
    _tripped: bool = False

    def __post_init__(self) -> None:
        if self.threshold < 1:
            raise ConfigurationError(f"the agent breaker's threshold must be >= 1, got {self.threshold}")

    @property
    def tripped(self) -> bool:
        return self._tripped

    @property
    def failures(self) -> tuple[str, ...]:
        """The failed actions of the current streak, oldest first."""
        return tuple(self._failures)

    def observe(self, event: AgentEvent) -> None:
        match event:
            case RunResumed():
                self._resumed(event)
            case RunStarted() if not event.resumed:
                self._reset()
            case ToolReturned() | ToolRejected():
                self._count(event.step, event.record)
            case ToolDenied():
                self._failed(f"{event.call.name} (step {event.step}): {_cut('denied: ' + event.reason)}")
            case ModelRequested():
                self.check()
            case _:
                pass

    def check(self) -> None:
        """Before an action: raise ``CircuitBroken`` once the breaker has tripped."""
        if not self._tripped:
            return
        listed = "; ".join(f"{n}. {f}" for n, f in enumerate(self._failures, 1))
        raise CircuitBroken(
            f"the agent's last {len(self._failures)} actions failed in a row (circuit breaker, "
            f"threshold {self.threshold}): {listed}. Look at the run, then resume it",
            failures=tuple(self._failures),
        )

    def _count(self, step: int, record: ToolCallRecord) -> None:
        if record.failed:
            self._failed(describe_failure(step, record))
        elif not self._tripped:
            self._failures.clear()

    def _failed(self, what: str) -> None:
        if self._tripped:
            return  # calls already in flight in the same step: the streak is already reported
        self._failures.append(what)
        if len(self._failures) >= self.threshold:
            self._tripped = True
            self.observer(
                BreakerChanged(
                    name="agent",
                    old=BreakerState.CLOSED,
                    new=BreakerState.OPEN,
                    failures=len(self._failures),
                    reason="; ".join(self._failures),
                )
            )

    def _reset(self) -> None:
        self._failures.clear()
        self._tripped = False

    def _resumed(self, event: RunResumed) -> None:
        if event.previous_status == RunStatus.BROKEN.value:
            # a person resumed it: the breaker closes, the count starts again
            self._reset()
            self.observer(
                BreakerChanged(
                    name="agent",
                    old=BreakerState.OPEN,
                    new=BreakerState.CLOSED,
                    failures=0,
                    reason="the broken run was resumed",
                )
            )
            return
        # paused, interrupted or crashed: the streak it was in goes on
        self._reset()
        for step, record in _records(event.state):
            self._count(step, record)


def _records(state: RunState) -> Iterable[tuple[int, ToolCallRecord]]:
    for step in [*state.steps, *([state.current] if state.current is not None else [])]:
        for record in step.tool_calls:
            yield step.index, record
