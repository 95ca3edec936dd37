"""Approvals recorded in the audit trail, and the tool call they are asked under.

``AuditedApprovals`` records each approval asked, granted, refused or withdrawn, once, with
who decided. The context variables say which tool call is in progress, whether a human
approved it (its sandbox ops and what its code runs are then covered) and whether an exec is
being asked about (a yes to one exec covers that exec alone): the guards and the session set
them, the approvals read them.
"""

from __future__ import annotations

import contextvars
import threading

from stockade.audit.events import EventKind
from stockade.audit.log import AuditLog
from stockade.exceptions import ApprovalRequired, ApprovalsFull, ConfigurationError, PolicyDenied
from stockade.policy.approval import CLIENT_ACTOR, SYSTEM_ACTOR, Approvals
from stockade.policy.approval_book import ApprovalRequest, Choice

__all__ = ["AuditedApprovals", "asking_for_exec", "call_approved", "call_at"]

# Set while a tool call a human approved runs: its sandbox ops are covered by that approval.
call_approved: contextvars.ContextVar[bool] = contextvars.ContextVar("stockade_approved", default=False)
# Set while an exec its code started inside the sandbox is asked about: a yes to the call or to
# its op covers what its code runs, a yes to one exec covers that exec alone (one approved `cp`
# let the same call's `rm -r` run unasked, past a standing no).
asking_for_exec: contextvars.ContextVar[bool] = contextvars.ContextVar("stockade_exec_asks", default=False)
# The tool call being made (its step, its id): a denial or an approval of one of its ops is
# recorded under it, not at step 0 with no call (found from outside).
call_at: contextvars.ContextVar[tuple[int, str] | None] = contextvars.ContextVar(
    "stockade_call_at", default=None
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


class AuditedApprovals(Approvals):
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
        step, call = (call_at.get() or (0, None)) if outcome != "withdrawn" else (0, None)
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
        if not asking_for_exec.get():
            call_approved.set(True)
