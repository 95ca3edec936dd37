"""The values the run viewer's pages render (``RunRow``, ``RunView`` and what a view is made
of), what a page asks for (``Filters``, ``Window``) and what a source of runs answers
(``RunSource``). Apart from the stores and from the timeline: ``web`` renders these and
checks statuses against them without reading a store, and ``data`` builds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from stockade.agent.state import RunStatus
from stockade.policy.approval_book import Choice

__all__ = [
    "Entry",
    "Filters",
    "Pending",
    "RunRow",
    "RunSource",
    "RunView",
    "Step",
    "Verification",
    "Window",
]

# A run in one of these is done changing. A paused, interrupted or broken run is followed too: a
# decision (here, or anywhere else) or a restart sends it on.
SETTLED = frozenset(s.value for s in RunStatus if s.finished)
STATUSES = ("queued", *(s.value for s in RunStatus))
# audit events on one page of a run, and in one live update of it: a run of 10^5 events
# rendered whole was ~40 MiB and about a minute of the server's time, at every update
PAGE = 250


@dataclass(frozen=True, kw_only=True)
class Window:
    """Which of a run's audit events a page shows: the newest ``PAGE`` (before ``before``, when
    given), or the first ``PAGE`` after ``after`` (an earlier page read forwards, or a live
    page's update: what came after the last event it shows). ``step``: the step the events
    just before ``after`` are in (an event outside any step goes with it)."""

    before: int | None = None
    after: int | None = None
    step: int = 0


LATEST = Window()  # a run's page as it opens: its newest events


@dataclass(frozen=True, kw_only=True)
class Filters:
    status: str | None = None
    model: str | None = None  # a part of the model's name
    since: datetime | None = None  # UTC
    until: datetime | None = None
    limit: int = 100

    def keeps(self, row: RunRow) -> bool:
        if self.model and self.model.lower() not in row.model.lower():
            return False
        if self.since is not None and row.created < self.since.timestamp():
            return False
        return not (self.until is not None and row.created > self.until.timestamp())


@dataclass(frozen=True, kw_only=True)
class RunRow:
    run_id: str
    status: str
    model: str
    task: str
    created: float  # seconds since the epoch
    updated: float
    steps: int | None = None
    tokens: int | None = None
    cost_usd: float | None = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One line of the timeline. Every text here is untrusted (the model's, the code's): the
    templates escape it."""

    seq: int
    # run, model, tool, denial, approval, retry, kill, anomaly, exec, limit, breaker, check, sandbox, note
    kind: str
    title: str
    when: str
    facts: tuple[str, ...] = ()
    args: str | None = None
    text: str | None = None
    failed: bool = False


@dataclass(frozen=True, kw_only=True)
class Step:
    index: int  # 0: before the first step or after the last
    entries: tuple[Entry, ...]


@dataclass(frozen=True, kw_only=True)
class Pending:
    request_id: str
    action: str
    rule: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Verification:
    ok: bool | None  # None: nothing to verify (no events)
    summary: str


@dataclass(frozen=True, kw_only=True)
class RunView:
    row: RunRow
    steps: tuple[Step, ...]
    pending: tuple[Pending, ...]
    diff: str | None
    answer: str | None
    verification: Verification | None
    last_seq: int  # of the last event the page shows (of any kind, entry or not)
    first_seq: int = 0  # of the first it shows; 0: none
    earlier: bool = False  # the run has events before the page's (a link goes to them)
    later: bool = False  # and after them: the page is not the run's latest
    live: bool = field(default=False)


class RunSource(Protocol):
    """The runs one viewer session may see."""

    label: str  # who is looking ("tenant acme, role dev"; "this machine")
    can_decide: bool

    def runs(self, filters: Filters) -> list[RunRow]: ...

    def run(self, run_id: str, *, verified: bool = True, window: Window = LATEST) -> RunView | None: ...

    def changes(self, run_id: str, after_seq: int) -> tuple[int, str] | None:
        """(the last audit seq of the run, its status); None when there is no such run."""

    def decide(self, run_id: str, request_id: str, choice: Choice) -> None: ...
