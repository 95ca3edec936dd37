"""The approval book of one machine: pending requests and decisions as JSON files.

``ApprovalStore`` keeps ``<dir>/<run_id>/<request_id>.json`` (``STOCKADE_APPROVAL_DIR``, else
``~/.stockade/approvals``), one writer at a time per run under a file lock, with its secret key
beside them. Apart from ``Approvals``, which asks any ``ApprovalBook``: the command line, the
viewer and a run's erasure read and write these files without asking anyone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from stockade._config_file import read_config_text
from stockade._private import private_dir, write_private
from stockade.audit.redact import Redactor
from stockade.exceptions import ConfigurationError, InvalidArgument
from stockade.policy.approval_book import SPENT, ApprovalRequest, Choice, keyed, not_pending, redacted

__all__ = ["ApprovalStore", "default_approval_dir"]


def _unknown(run_id: str, request_id: str, directory: Path) -> InvalidArgument:
    return InvalidArgument(
        f"no approval request {request_id!r} for run {run_id!r} in {str(directory)!r}",
        argument="request_id",
        fix="`stockade approvals` lists the requests waiting (with --dir, the folder the run asks in)",
    )


def default_approval_dir() -> Path:
    configured = os.environ.get("STOCKADE_APPROVAL_DIR")
    return Path(configured) if configured else Path.home() / ".stockade" / "approvals"


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
