"""What an approval book keeps, and the interface every book implements.

A request (``ApprovalRequest``) and the id it is kept by, a decision (``Choice``, and ``SPENT``
for a yes applied), the record a book keeps of it and the error for a decision given twice are
values both books share: ``ApprovalStore`` (JSON files, ``approval_store``) and the service's
database (``DatabaseApprovals``), which ``Approvals`` asks through ``ApprovalBook`` without
knowing which.

The books keep a request's action and reason redacted (a command may carry a token: ``git push
https://ghp_...@github.com/...``), as the audit trail does; its id is derived from the action as
asked, so that two actions that differ only in a secret are two questions: for an action the
redactor changes, as an HMAC under the book's own secret key (``ApprovalBook.keyed``), so that
the id tells nothing of the secret.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
from dataclasses import dataclass
from typing import Protocol

from stockade.audit.redact import Redactor
from stockade.exceptions import ApprovalDecided

__all__ = ["SPENT", "ApprovalBook", "ApprovalRequest", "Choice", "keyed", "not_pending", "redacted"]


class Choice(enum.StrEnum):
    APPROVED = "approved"
    DENIED = "denied"


SPENT = "spent"  # the status of a yes that was applied: it answers nothing more


@dataclass(frozen=True, kw_only=True)
class ApprovalRequest:
    run_id: str
    action: str  # what would happen, in words ("run `git push origin main`")
    rule: str
    reason: str
    # A request read back from a book: its id as kept (derived from the action as asked, which
    # the book keeps redacted: the id cannot be derived again from what it kept).
    kept_id: str = ""
    # The action as asked, when ``action`` is only what a human is shown of it, masked already
    # (an exec's words, redacted as the trail has them): the id is derived from this, never
    # kept or shown. Derived from the masked text, `rm -r keep_token=A` and `rm -r
    # keep_token=B` were one question, and a yes to the one was spent by the other.
    asked_as: str = dataclasses.field(default="", repr=False)

    @property
    def id(self) -> str:
        if self.kept_id:
            return self.kept_id
        return hashlib.sha256(self.asked).hexdigest()[:16]

    @property
    def asked(self) -> bytes:
        """What its id is derived from: the run, the action as asked and the rule."""
        return f"{self.run_id}\0{self.asked_as or self.action}\0{self.rule}".encode("utf-8", "surrogatepass")

    @property
    def masked(self) -> bool:
        """Whether ``action`` hides some of what was asked (``asked_as``)."""
        return bool(self.asked_as) and self.asked_as != self.action

    @classmethod
    def kept(cls, record: dict[str, str]) -> ApprovalRequest:
        """The request a book's record (``ApprovalBook.requests``) is of."""
        return cls(
            run_id=record["run_id"],
            action=record["action"],
            rule=record["rule"],
            reason=record["reason"],
            kept_id=record["id"],
        )


def keyed(request: ApprovalRequest, redactor: Redactor, key: bytes) -> ApprovalRequest:
    """``request`` under the id a book keeps it by. An action the redactor changes gets an
    HMAC of the book's ``key`` for its id: the sha256 of the action as asked, kept beside the
    action redacted, let a reader of the book or the trail test guesses of the secret offline
    (a password recovered at 2.1 M guesses a second). Two actions that differ only in a secret
    are still two questions. Others keep their ids, derived from the action alone.

    An action shown masked already (``ApprovalRequest.asked_as``) is keyed by what was asked:
    the redactor finds nothing left to mask in what is shown."""
    if request.kept_id or (not request.masked and redactor.text(request.action) == request.action):
        return request
    return dataclasses.replace(request, kept_id=hmac.new(key, request.asked, hashlib.sha256).hexdigest()[:16])


def redacted(request: ApprovalRequest, redactor: Redactor) -> dict[str, str]:
    """What a book keeps of ``request``: its action and reason redacted, its id as asked."""
    return {
        "run_id": request.run_id,
        "action": redactor.text(request.action),
        "rule": request.rule,
        "reason": redactor.text(request.reason),
        "id": request.id,
    }


def not_pending(run_id: str, request_id: str, status: str) -> ApprovalDecided:
    """The error for a decision given to a request that does not wait for one."""
    now = "its yes was spent on the action it allowed" if status == SPENT else f"it was {status}"
    return ApprovalDecided(
        f"approval request {request_id!r} of run {run_id!r} waits for no decision: {now} (the same "
        "action asked again is a new pending request under the same id)",
        status=status,
    )


class ApprovalBook(Protocol):
    """Where pending requests and decisions are kept: ``ApprovalStore`` (JSON files, one
    machine), or a database shared by the workers of a service (``stockade.distributed``)."""

    def keyed(self, request: ApprovalRequest) -> ApprovalRequest:
        """``request`` under the id this book keeps it by (``approval.keyed``, with the book's
        own secret key): what every other method is given."""

    def submit(self, request: ApprovalRequest) -> None:
        """Keep ``request`` as pending (a request already kept is left as it is, unless its yes
        was spent: then it is asked anew)."""

    def decide(self, run_id: str, request_id: str, choice: Choice, *, by: str = "") -> None:
        """Record a decision for a pending request; ``ConfigurationError`` when there is no
        such request, ``ApprovalDecided`` when it is not pending (a stale or repeated decision
        re-armed a spent yes: the same action went ahead unasked)."""

    def decision(self, request: ApprovalRequest) -> Choice | None:
        """The request's decision; None while pending, and once its yes was spent."""

    def spend(self, run_id: str, request_id: str) -> bool:
        """The approved action goes ahead: its yes answers nothing more. Whether this caller
        spent it (False: it was not approved, or another worker spent it first)."""

    def pending(self, run_id: str | None = None) -> list[dict[str, str]]:
        """The requests waiting for a decision, a run's latest first: the one a paused run waits
        on (an exec refused on the spot, which paused nothing, stays pending behind it)."""

    def requests(self, run_id: str) -> list[dict[str, str]]:
        """Every request of ``run_id``, pending or decided (``action``, ``rule``, ``reason``,
        ``status``, ...)."""
