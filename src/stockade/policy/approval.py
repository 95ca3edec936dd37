"""Human approval: an action that needs it waits for a person.

``Approvals.require(request)`` returns when the action is approved and raises
``PolicyDenied`` when it is denied. A decision comes from, in order: an earlier decision in
the ``ApprovalStore`` (the run was paused and is now resumed), then the ``approver``
callback (a function, or ``cli_approver`` which prompts on the terminal). When no one can
decide now, the request is saved as pending and ``ApprovalRequired`` pauses the run;
``stockade approve|deny RUN_ID REQUEST_ID`` decides later, and the resumed run finds the
decision under the same request id (it is derived from the run and the action).

What a book keeps (the request, its id, the decision) and the interface every book implements
are ``approval_book``; the book of JSON files on one machine is ``approval_store``. Their names
are still importable from here.

A yes answers one question: it is spent when the action it allowed goes ahead
(``ApprovalBook.spend``, status ``spent``), and the same action asked again later in the run
is a new question under the same id, pending anew (one ``git push origin main`` approved
pushed every later commit unasked before). A no stands for the rest of the run.

A run keeps at most ``max_pending`` requests pending (``RunLimits.max_pending_approvals``, 100):
a new action asked past them is refused on the spot (``ApprovalsFull``) and kept nowhere, as
code in the sandbox looping over distinct ``rm -r X$i`` execs kept 2,000 requests in 21 s (47
MB of database, every read of the run returning them all). The same action asked again while
it is pending is no new request: it waits for its decision, as before.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable

from stockade._display import visible
from stockade.audit.redact import Redactor
from stockade.exceptions import ApprovalDecided, ApprovalRequired, ApprovalsFull, PolicyDenied
from stockade.policy.approval_book import (
    SPENT,
    ApprovalBook,
    ApprovalRequest,
    Choice,
    keyed,
)
from stockade.policy.approval_store import ApprovalStore, default_approval_dir
from stockade.types import MAX_PENDING_APPROVALS

__all__ = [
    "CLIENT_ACTOR",
    "MAX_PENDING",
    "NOT_A_DECISION",
    "SPENT",
    "SYSTEM_ACTOR",
    "ApprovalBook",
    "ApprovalRequest",
    "ApprovalStore",
    "Approvals",
    "Approver",
    "Choice",
    "cli_approver",
    "default_approval_dir",
    "unanswered",
]

# A decision's ``by`` that names a program, not a person: an MCP client's elicitation answer. The
# trail records it as it is, not as "human:" (the client's user may not have seen the question).
CLIENT_ACTOR = "mcp-client:"
# Ends a client's ``by`` when its answer decided nothing (``{"approve": "true"}``): denied, and
# the model told so, not that "a human denied" it, as the trail names the client's "accept"
NOT_A_DECISION = "not a decision"
WITHDRAWN = "stockade: the run ended before anyone decided"  # who closed a request (``withdraw``)
# A decision's ``by`` that is no one's: nobody answered in time, or nobody was left to ask
# (``unanswered``). The trail records its actor as ``system:timeout`` (or ``system:cancelled``),
# and the model is told nobody answered: "human:nobody within 8 s" and "a human denied" said
# a person had decided.
SYSTEM_ACTOR = "system:"


def unanswered(why: str, *, timeout: bool = True) -> str:
    """The ``by`` of a denial nobody decided: ``why`` (``"nobody answered within 8 s"``) after
    ``system:timeout: `` (``system:cancelled: `` when nobody was left to answer)."""
    return f"{SYSTEM_ACTOR}{'timeout' if timeout else 'cancelled'}: {why}"


def _denial(by: str) -> str:
    """How a denial recorded as ``by``'s is told: by a person, by nobody (and why), or by an
    MCP client's answer that decided nothing."""
    nobody = _nobody(by)
    if nobody is not None:
        return f"denied, as {nobody}"
    if by.startswith(CLIENT_ACTOR) and by.endswith(f"{NOT_A_DECISION})"):
        return (
            "denied, as the MCP client's answer was not a decision (an accept without approve: true or false)"
        )
    return "a human denied"


def _nobody(by: str) -> str | None:
    """Why nobody decided, when ``by`` is no one's (``unanswered``, or a book's "nobody ...")."""
    if by.startswith(SYSTEM_ACTOR):
        return by.partition(": ")[2] or by
    return by if by.startswith("nobody") else None


Approver = Callable[[ApprovalRequest], Choice | None]  # None: nobody can decide now


@functools.cache
def _unbooked() -> tuple[Redactor, bytes]:
    """With no book: the default redactor and a key of this process's, made at first use."""
    return Redactor(), secrets.token_bytes(32)


_TURNS = 8  # Approvals.require's reads of a decision others change under it
MAX_PENDING = MAX_PENDING_APPROVALS


class Approvals:
    def __init__(
        self,
        approver: Approver | None = None,
        store: ApprovalBook | None = None,
        *,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self.approver = approver
        self.store = store
        self.max_pending = max_pending

    def keyed(self, request: ApprovalRequest) -> ApprovalRequest:
        """``request`` under its book's id (``ApprovalBook.keyed``); with no book, under a key
        of this process's: no one could match the id to a decision anyway."""
        if self.store is not None:
            return self.store.keyed(request)
        return keyed(request, *_unbooked())

    def require(self, request: ApprovalRequest) -> None:
        request = self.keyed(request)
        store = self.store
        choice: Choice | None = None
        # Each turn after the first: another worker (a thread judging the same exec, a process
        # resuming the run) decided or spent first; its decision is read again, and a yes it
        # spent leaves this action to be asked anew. Bounded: then it waits, pending.
        for _ in range(_TURNS):
            choice = store.decision(request) if store is not None else None
            if choice is None and self.approver is not None:
                choice = self.approver(request)
                if choice is not None and not isinstance(choice, Choice):
                    # True, "approved", a coroutine: a decision by no Choice is none (a
                    # coroutine's truth ran execs unasked in the SDK's approver), and is
                    # refused, not booked (the book keeps Choices)
                    raise PolicyDenied(
                        f"{request.action} refused: {_not_a_choice(choice)} ({request.reason})",
                        rule=request.rule, action=request.action,
                    )  # fmt: skip
                if choice is not None and store is not None:
                    store.submit(request)
                    try:
                        store.decide(request.run_id, request.id, choice, by="approver")
                    except ApprovalDecided:
                        choice = None
                        continue
            if choice is not Choice.APPROVED or store is None or store.spend(request.run_id, request.id):
                break
            choice = None
        if choice is Choice.APPROVED:
            return
        if choice is Choice.DENIED:
            who = _denial(_decided_by(store, request) if store is not None else "")
            raise PolicyDenied(f"{who}: {request.action} ({request.reason})", rule=request.rule,
                               action=request.action)  # fmt: skip
        if self.store is None:
            raise PolicyDenied(
                f"{request.action} needs approval and no one can give it here ({request.reason})",
                rule=request.rule, action=request.action,
            )  # fmt: skip
        self._room(self.store, request)
        self.store.submit(request)
        raise ApprovalRequired(
            f"{request.action} waits for approval: stockade approve {request.run_id} {request.id}",
            rule=request.rule, action=request.action, request_id=request.id,
        )  # fmt: skip

    def _room(self, store: ApprovalBook, request: ApprovalRequest) -> None:
        """``ApprovalsFull`` when ``request`` would be one more pending request than its run may
        keep; one already pending is the same question, and waits on. (Two threads asking at
        once may both pass: the count may go one or two past, never on and on.)"""
        waiting = store.pending(request.run_id)
        if len(waiting) < self.max_pending or any(r.get("id") == request.id for r in waiting):
            return
        raise ApprovalsFull(
            f"{request.action} needs approval and was refused: run {request.run_id!r} already has "
            f"{len(waiting)} requests waiting for a decision (at most {self.max_pending}); decide "
            "those first",
            rule=request.rule, action=request.action, limit=self.max_pending,
        )  # fmt: skip

    def withdraw(self, run_id: str) -> list[ApprovalRequest]:
        """Close the requests of ``run_id`` that nobody decided, its run having ended for good
        (nothing would act on a yes: an exec asked about inside the sandbox was refused on the
        spot and its run went on to the end): each is denied in the book, by ``WITHDRAWN``, so
        that ``stockade approvals`` no longer offers it. Returns them."""
        if self.store is None:
            return []
        closed = []
        for kept in self.store.pending(run_id):
            request = ApprovalRequest.kept({**kept, "run_id": run_id})
            try:
                self.store.decide(run_id, request.id, Choice.DENIED, by=WITHDRAWN)
            except ApprovalDecided:
                continue  # decided meanwhile
            closed.append(request)
        return closed


def _not_a_choice(answer: object) -> str:
    """Why an approver's ``answer`` that is no ``Choice`` (nor None) decides nothing."""
    import inspect

    if inspect.iscoroutine(answer):
        answer.close()  # never run: no "was never awaited" warning
        return "the approver is async, and is not awaited here (give a plain function)"
    return f"the approver answered {visible(repr(answer))[:80]}, not Choice.APPROVED or Choice.DENIED"


def cli_approver(request: ApprovalRequest) -> Choice | None:
    """Ask on the terminal; with no terminal, nobody can decide now."""
    import sys

    if not sys.stdin.isatty():
        return None
    import typer

    # what is asked is what code chose: its terminal controls are shown, not acted on
    approved = typer.confirm(
        f"{visible(request.action)}\n  needs approval: {visible(request.reason)}. Allow it?",
        default=False,
    )
    return Choice.APPROVED if approved else Choice.DENIED


def _decided_by(store: ApprovalBook, request: ApprovalRequest) -> str:
    """Who decided ``request``, as its book has it ("" when it says nobody)."""
    return next((r.get("by", "") for r in store.requests(request.run_id) if r.get("id") == request.id), "")
