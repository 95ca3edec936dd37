"""What the tool call running now has asked a human: a decision answers one question of one
call, never a later identical one.

The loop opens a ``CallQuestions`` for each tool call (``asking_in(key)``, the call's
idempotency key); an approval asked during it (the call's guard, an op's guard, an exec its
code starts inside the sandbox) is that call's n-th question about that action. The key and n
go into the request's id: a resumed run that runs the same call again asks the same questions
in the same order and finds their decisions, and a later call that does the same thing asks
afresh. A question nobody can answer while the call runs (an exec, refused then and there) is
held here, and the loop pauses the run on it when the call returns.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from stockade.exceptions import ApprovalRequired

__all__ = ["CallQuestions", "asking_in", "current_questions"]


@dataclass(eq=False)
class CallQuestions:
    """One tool call's questions so far (mutable: an op's thread adds to the call's count)."""

    key: str
    _asked: dict[tuple[str, str], int] = field(default_factory=dict)
    _held: ApprovalRequired | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def scope(self, action: str, rule: str) -> str:
        """This question's place: the call's key and how many times the call asked it before."""
        with self._lock:
            n = self._asked.get((action, rule), 0)
            self._asked[(action, rule)] = n + 1
        return f"{self.key}#{n}"

    def hold(self, waiting: ApprovalRequired) -> None:
        """A question that waits for a decision while the call went on without its action."""
        with self._lock:
            if self._held is None:
                self._held = waiting

    def held(self) -> ApprovalRequired | None:
        with self._lock:
            return self._held


_current: contextvars.ContextVar[CallQuestions | None] = contextvars.ContextVar(
    "stockade_questions", default=None
)


def current_questions() -> CallQuestions | None:
    """The questions of the tool call running now; None outside one."""
    return _current.get()


@contextlib.contextmanager
def asking_in(key: str) -> Iterator[CallQuestions]:
    """The tool call ``key`` runs: what is asked until this ends is its."""
    questions = CallQuestions(key)
    token = _current.set(questions)
    try:
        yield questions
    finally:
        _current.reset(token)
