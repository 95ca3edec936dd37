"""Human approval: an action that needs it waits for a person.

``Approvals.require(request)`` returns when the action is approved and raises
``PolicyDenied`` when it is denied. A decision comes from, in order: an earlier decision in
the ``ApprovalStore`` (the run was paused and is now resumed), then the ``approver``
callback (a function, or ``cli_approver`` which prompts on the terminal). When no one can
decide now, the request is saved as pending and ``ApprovalRequired`` pauses the run;
``stockade approve|deny RUN_ID REQUEST_ID`` decides later, and the resumed run finds the
decision under the same request id (it is derived from the run and the action).
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from stockade._display import visible
from stockade._private import private_dir, write_private
from stockade.exceptions import ApprovalRequired, ConfigurationError, PolicyDenied

__all__ = [
    "ApprovalBook",
    "ApprovalRequest",
    "ApprovalStore",
    "Approvals",
    "Approver",
    "Choice",
    "cli_approver",
    "default_approval_dir",
]


class Choice(enum.StrEnum):
    APPROVED = "approved"
    DENIED = "denied"


@dataclass(frozen=True, kw_only=True)
class ApprovalRequest:
    run_id: str
    action: str  # what would happen, in words ("run `git push origin main`")
    rule: str
    reason: str

    @property
    def id(self) -> str:
        digest = hashlib.sha256(f"{self.run_id}\0{self.action}\0{self.rule}".encode()).hexdigest()
        return digest[:16]


Approver = Callable[[ApprovalRequest], Choice | None]  # None: nobody can decide now


def default_approval_dir() -> Path:
    configured = os.environ.get("STOCKADE_APPROVAL_DIR")
    return Path(configured) if configured else Path.home() / ".stockade" / "approvals"


class ApprovalBook(Protocol):
    """Where pending requests and decisions are kept: ``ApprovalStore`` (JSON files, one
    machine), or a database shared by the workers of a service (``stockade.distributed``)."""

    def submit(self, request: ApprovalRequest) -> None:
        """Keep ``request`` as pending (a request already kept is left as it is)."""

    def decide(self, run_id: str, request_id: str, choice: Choice, *, by: str = "") -> None:
        """Record a decision; ``ConfigurationError`` when there is no such request."""

    def decision(self, request: ApprovalRequest) -> Choice | None: ...

    def pending(self, run_id: str | None = None) -> list[dict[str, str]]: ...

    def requests(self, run_id: str) -> list[dict[str, str]]:
        """Every request of ``run_id``, pending or decided (``action``, ``rule``, ``reason``,
        ``status``, ...)."""


class ApprovalStore:
    """Pending requests and decisions as JSON files: ``<dir>/<run_id>/<request_id>.json``."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_approval_dir()

    def _file(self, run_id: str, request_id: str) -> Path:
        for part in (run_id, request_id):
            if not part or "/" in part or part.startswith("."):
                raise ConfigurationError(f"invalid run or request id {part!r}")
        return self.directory / run_id / f"{request_id}.json"

    def _write(self, file: Path, record: dict[str, str]) -> None:
        private_dir(file.parent)
        tmp = file.with_name(f".{file.name}.tmp")
        write_private(tmp, json.dumps(record, indent=2))  # a command and its arguments
        tmp.replace(file)

    def submit(self, request: ApprovalRequest) -> None:
        file = self._file(request.run_id, request.id)
        if not file.exists():
            self._write(file, {**asdict(request), "id": request.id, "status": "pending"})

    def decide(self, run_id: str, request_id: str, choice: Choice, *, by: str = "") -> None:
        file = self._file(run_id, request_id)
        try:
            record = json.loads(file.read_text())
        except FileNotFoundError:
            raise ConfigurationError(f"no approval request {request_id!r} for run {run_id!r}") from None
        record.update(status=choice.value, by=by)
        self._write(file, record)

    def decision(self, request: ApprovalRequest) -> Choice | None:
        try:
            status = json.loads(self._file(request.run_id, request.id).read_text()).get("status")
        except FileNotFoundError:
            return None
        return Choice(status) if status in (Choice.APPROVED, Choice.DENIED) else None

    def forget(self, run_id: str) -> None:
        """Every request and decision of ``run_id`` (a new run under that id starts afresh)."""
        folder = self._file(run_id, "x").parent
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder)

    def pending(self, run_id: str | None = None) -> list[dict[str, str]]:
        runs = [run_id] if run_id else sorted(p.name for p in self.directory.glob("*"))
        return [r for run in runs for r in self.requests(run) if r.get("status") == "pending"]

    def requests(self, run_id: str) -> list[dict[str, str]]:
        folder = self._file(run_id, "x").parent
        return [json.loads(file.read_text()) for file in sorted(folder.glob("*.json"))]


class Approvals:
    def __init__(self, approver: Approver | None = None, store: ApprovalBook | None = None) -> None:
        self.approver = approver
        self.store = store

    def require(self, request: ApprovalRequest) -> None:
        choice = self.store.decision(request) if self.store is not None else None
        if choice is None and self.approver is not None:
            choice = self.approver(request)
            if choice is not None and self.store is not None:
                self.store.submit(request)
                self.store.decide(request.run_id, request.id, choice, by="approver")
        if choice is Choice.APPROVED:
            return
        if choice is Choice.DENIED:
            raise PolicyDenied(f"a human denied: {request.action} ({request.reason})", rule=request.rule,
                               action=request.action)  # fmt: skip
        if self.store is None:
            raise PolicyDenied(
                f"{request.action} needs approval and no one can give it here ({request.reason})",
                rule=request.rule, action=request.action,
            )  # fmt: skip
        self.store.submit(request)
        raise ApprovalRequired(
            f"{request.action} waits for approval: stockade approve {request.run_id} {request.id}",
            rule=request.rule, action=request.action, request_id=request.id,
        )  # fmt: skip


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
