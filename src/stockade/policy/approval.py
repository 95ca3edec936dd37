"""Human approval: an action that needs it waits for a person.

``Approvals.require(request)`` returns when the action is approved and raises
``PolicyDenied`` when it is denied. A decision comes from, in order: an earlier decision in
the ``ApprovalStore`` (the run was paused and is now resumed), then the ``approver``
callback (a function, or ``cli_approver`` which prompts on the terminal). When no one can
decide now, the request is saved as pending and ``ApprovalRequired`` pauses the run;
``stockade approve|deny RUN_ID REQUEST_ID`` decides later, and the resumed run finds the
decision under the same request id (it is derived from the run and the action).

The books keep a request's action and reason redacted (a command may carry a token: ``git push
https://ghp_...@github.com/...``), as the audit trail does; its id is derived from the action as
asked, so that two actions that differ only in a secret are two questions: for an action the
redactor changes, as an HMAC under the book's own secret key (``ApprovalBook.keyed``), so that
the id tells nothing of the secret.

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

import contextlib
import dataclasses
import enum
import fcntl
import functools
import hashlib
import hmac
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from stockade._config_file import read_config_text
from stockade._display import visible
from stockade._private import private_dir, write_private
from stockade.audit.redact import Redactor
from stockade.exceptions import (
    ApprovalDecided,
    ApprovalRequired,
    ApprovalsFull,
    ConfigurationError,
    InvalidArgument,
    PolicyDenied,
)
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


class Choice(enum.StrEnum):
    APPROVED = "approved"
    DENIED = "denied"


SPENT = "spent"  # the status of a yes that was applied: it answers nothing more
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


Approver = Callable[[ApprovalRequest], Choice | None]  # None: nobody can decide now


def not_pending(run_id: str, request_id: str, status: str) -> ApprovalDecided:
    """The error for a decision given to a request that does not wait for one."""
    now = "its yes was spent on the action it allowed" if status == SPENT else f"it was {status}"
    return ApprovalDecided(
        f"approval request {request_id!r} of run {run_id!r} waits for no decision: {now} (the same "
        "action asked again is a new pending request under the same id)",
        status=status,
    )


def _unknown(run_id: str, request_id: str, directory: Path) -> InvalidArgument:
    return InvalidArgument(
        f"no approval request {request_id!r} for run {run_id!r} in {str(directory)!r}",
        argument="request_id",
        fix="`stockade approvals` lists the requests waiting (with --dir, the folder the run asks in)",
    )


def default_approval_dir() -> Path:
    configured = os.environ.get("STOCKADE_APPROVAL_DIR")
    return Path(configured) if configured else Path.home() / ".stockade" / "approvals"


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


class ApprovalStore:
    """Pending requests and decisions as JSON files: ``<dir>/<run_id>/<request_id>.json``;
    actions and reasons redacted by ``redactor`` (credential shapes unless told)."""

    def __init__(self, directory: str | Path | None = None, *, redactor: Redactor | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_approval_dir()
        self.redactor = redactor if redactor is not None else Redactor()
        self._made_key = b""  # read (or made) at its first use

    def keyed(self, request: ApprovalRequest) -> ApprovalRequest:
        self._made_key = self._made_key or self._key()
        return keyed(request, self.redactor, self._made_key)

    def _key(self) -> bytes:
        """The book's secret key (``.key`` in its folder, 0600): made once, by whichever
        process asks first, whole before anyone reads it."""
        file = self.directory / ".key"
        with contextlib.suppress(FileNotFoundError):
            return bytes.fromhex(file.read_text())
        private_dir(self.directory)
        made = self.directory / f".key.{os.getpid()}.{secrets.token_hex(4)}"
        write_private(made, secrets.token_hex(32))
        try:
            with contextlib.suppress(FileExistsError):  # another process's, made first, stays
                os.link(made, file)
        finally:
            made.unlink()
        return bytes.fromhex(file.read_text())

    def _file(self, run_id: str, request_id: str) -> Path:
        for part in (run_id, request_id):
            if not part or "/" in part or part.startswith("."):
                raise InvalidArgument(
                    f"invalid run or request id {part!r}",
                    argument="run_id" if part is run_id else "request_id",
                    fix="give the ids `stockade approvals` lists",
                )
        return self.directory / run_id / f"{request_id}.json"

    def _write(self, file: Path, record: dict[str, str]) -> None:
        tmp = file.with_name(f".{file.name}.tmp")
        write_private(tmp, json.dumps(record, indent=2))  # a command and its arguments
        tmp.replace(file)

    @contextlib.contextmanager
    def _locked(self, file: Path) -> Iterator[None]:
        """One writer at a time in the run's folder (the processes of one machine): a yes is
        spent once, and a request asked anew is not lost to a spend in between."""
        private_dir(file.parent)
        fd = os.open(file.parent / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @staticmethod
    def _read(file: Path) -> dict[str, str] | None:
        """The record ``file`` holds; None when there is none. One that is no regular file (a
        FIFO hung the reader for ever), or no JSON object, is a ``ConfigurationError``."""
        try:
            text = read_config_text(file, what="the approval request")
        except InvalidArgument as error:  # a FIFO, a folder, a device: no request stockade wrote
            said = error.message.removesuffix(f"; {error.fix}")
            raise ConfigurationError(f"{said}: remove it, and ask for the action again") from None
        except ConfigurationError:
            if not os.path.lexists(file):
                return None
            raise
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise ConfigurationError(
                f"the approval request {str(file)!r} is damaged (no JSON object): remove it, "
                "and ask for the action again"
            )
        return record

    def submit(self, request: ApprovalRequest) -> None:
        file = self._file(request.run_id, request.id)
        with self._locked(file):
            kept = self._read(file)
            if kept is None or kept.get("status") == SPENT:
                record = {**redacted(request, self.redactor), "status": "pending"}
                self._write(file, {**record, "asked_ns": str(time.time_ns())})  # pending(): latest first

    def decide(self, run_id: str, request_id: str, choice: Choice, *, by: str = "") -> None:
        file = self._file(run_id, request_id)
        if not file.parent.is_dir():  # a mistyped run id leaves no folder behind
            raise _unknown(run_id, request_id, self.directory)
        with self._locked(file):
            record = self._read(file)
            if record is None:
                raise _unknown(run_id, request_id, self.directory)
            if record.get("status") != "pending":
                raise not_pending(run_id, request_id, str(record.get("status")))
            record.update(status=choice.value, by=by)
            self._write(file, record)

    def spend(self, run_id: str, request_id: str) -> bool:
        file = self._file(run_id, request_id)
        if not file.parent.is_dir():
            return False
        with self._locked(file):
            record = self._read(file)
            if record is None or record.get("status") != Choice.APPROVED:
                return False
            record.update(status=SPENT)
            self._write(file, record)
            return True

    def decision(self, request: ApprovalRequest) -> Choice | None:
        record = self._read(self._file(request.run_id, request.id))
        status = record.get("status") if record is not None else None
        return Choice(status) if status in (Choice.APPROVED, Choice.DENIED) else None

    def forget(self, run_id: str) -> None:
        """Every request and decision of ``run_id`` (a new run under that id starts afresh).

        Under the folder's lock, and the folder (with its lock) kept: a request asked meanwhile
        made the folder's removal fail ("Directory not empty"), and a writer waiting for the
        lock writes into it once it is its turn."""
        folder = self._file(run_id, "x").parent
        if not folder.is_dir() or folder.is_symlink():
            return
        with self._locked(folder / "x"):
            for entry in folder.iterdir():
                if entry.name == ".lock":
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink(missing_ok=True)

    def erase(self, run_id: str) -> None:
        """``forget``, and the run's folder too (its name is the run's id): for a run erased,
        that no request or decision will come for. A request asked meanwhile keeps it."""
        self.forget(run_id)
        folder = self._file(run_id, "x").parent
        if not folder.is_dir() or folder.is_symlink():
            return
        with contextlib.suppress(OSError):  # not empty: written to since
            (folder / ".lock").unlink(missing_ok=True)
            folder.rmdir()

    def pending(self, run_id: str | None = None) -> list[dict[str, str]]:
        runs = [run_id] if run_id else self._runs()
        found: list[dict[str, str]] = []
        for run in runs:
            waiting = [r for r in self.requests(run) if r.get("status") == "pending"]
            found += sorted(waiting, key=lambda r: int(r.get("asked_ns", 0)), reverse=True)
        return found

    def requests(self, run_id: str) -> list[dict[str, str]]:
        """The run's requests; a damaged file is left out (``damaged`` names it): one of them
        failed every run's listing."""
        return self._records(run_id)[0]

    def damaged(self, run_id: str | None = None) -> list[str]:
        """Why each request file of ``run_id`` (else of every run) cannot be read."""
        runs = [run_id] if run_id else self._runs()
        return [problem for run in runs for problem in self._records(run)[1]]

    def _runs(self) -> list[str]:
        return sorted(p.name for p in self.directory.glob("*") if p.name[0] != ".")

    def _records(self, run_id: str) -> tuple[list[dict[str, str]], list[str]]:
        folder = self._file(run_id, "x").parent
        records: list[dict[str, str]] = []
        problems: list[str] = []
        for file in sorted(folder.glob("*.json")):
            try:
                record = self._read(file)
            except ConfigurationError as error:
                problems.append(str(error))
                continue
            if record is not None:
                records.append(record)
        return records, problems


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
