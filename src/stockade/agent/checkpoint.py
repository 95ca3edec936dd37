"""Where run state is saved after every step, so a run can resume in another process.

A ``Checkpointer`` is two methods. The loop calls ``save`` after each node (and after each
tool call within a step, so a resumed step does not repeat calls that already ran) and
``load`` when asked to resume a run by id. The node that ends the run (a final answer, a
stop) is saved by the end's checkpoint, once the run's diff and the audit trail's last events
are kept: a checkpoint that says a run ended is never followed by a loss. Run stores
(SQLite, Postgres) implement the same protocol. ``save`` is called on the event loop's thread
and should be quick.

A ``DurableCheckpointer`` (the run stores) also makes a run survive its process: the loop
claims the run's lease before it runs (one owner per run), records each tool call before it
runs (``call_started``) and, when it returns, the call with the workspace as it left it
(``record_workspace``); a resume restores that workspace (``restore_workspace``). See
``stockade.runs.store`` for what each guarantees.

A ``SandboxKeeper`` (``stockade.runs.snapshots.RunSnapshots``) keeps the run's sandbox itself
(a snapshot: its memory where the tier can) when the run pauses, and after every tool call
when it is asked to; the run's state names it (``RunState.snapshot``) and the session that
resumes the run starts its sandbox from it.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from stockade._private import private_dir
from stockade.agent.state import RunState, ToolCallRecord
from stockade.exceptions import ConfigurationError
from stockade.models.messages import ToolCall

if TYPE_CHECKING:
    from stockade.sandbox.facade import Sandbox

__all__ = [
    "Checkpointer",
    "DurableCheckpointer",
    "JsonFileCheckpointer",
    "Lease",
    "MemoryCheckpointer",
    "SandboxKeeper",
]


@runtime_checkable
class Checkpointer(Protocol):
    def save(self, state: RunState) -> None:
        """Persist ``state``, replacing the previous checkpoint of ``state.run_id``."""

    def load(self, run_id: str) -> RunState | None:
        """The last checkpoint of ``run_id``, or None."""


class Lease(Protocol):
    """A run's lease, held while it runs."""

    @property
    def recovered(self) -> bool:
        """Whether the run's last process died while running it (this claim took it over)."""

    @property
    def unsaved_s(self) -> float:
        """How long that process ran the run past its last checkpoint (0 unless recovered):
        time the run spent, counted in its wall time on resume."""

    def release(self) -> None: ...


@runtime_checkable
class DurableCheckpointer(Checkpointer, Protocol):
    def claim(self, run_id: str, *, new: bool) -> Lease:
        """Own the run while it runs (``RunLeased`` if another process does; ``RunConflict``
        for a new run whose id is taken, or a run that ended)."""

    def call_started(self, run_id: str, step: int, call: ToolCall, key: str, *, idempotent: bool) -> None:
        """``call`` is about to run."""

    def call_parked(self, run_id: str, key: str) -> None:
        """The call ``key`` stopped at an approval, before what it asked about: not in flight."""

    def record_workspace(
        self, run_id: str, sandbox: Sandbox, *, call: tuple[int, ToolCallRecord] | None = None
    ) -> int:
        """Keep the workspace as it is now, with the call (step, record) that left it so."""

    def restore_workspace(self, run_id: str, sandbox: Sandbox) -> bool:
        """Put the run's last kept workspace into ``sandbox``; False when none was kept."""

    def record_diff(self, run_id: str, diff: str) -> None:
        """The run's diff as it ends (kept before the checkpoint that says it ended)."""


class SandboxKeeper(Protocol):
    """Keeps a run's sandbox between its process and the next one (snapshots)."""

    @property
    def each_call(self) -> bool:
        """Keep the sandbox after every tool call that returned too (a crash resumes from it)."""

    def keep(self, run_id: str, sandbox: Sandbox) -> str | None:
        """Keep ``sandbox`` as the run's, instead of what was kept before; its id, or None when
        it could not be kept (a dead sandbox, a full store): what was kept before stays."""

    def release(self, run_id: str) -> None:
        """The run no longer needs what was kept (it ended, or it resumed from it)."""


class MemoryCheckpointer:
    """Keeps the serialised JSON, so what is loaded is a copy exactly as another process would see."""

    def __init__(self) -> None:
        self.saved: dict[str, str] = {}
        self.saves = 0

    def save(self, state: RunState) -> None:
        self.saved[state.run_id] = state.model_dump_json()
        self.saves += 1

    def load(self, run_id: str) -> RunState | None:
        data = self.saved.get(run_id)
        return None if data is None else RunState.model_validate_json(data)


_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]+$")


class JsonFileCheckpointer:
    """One JSON file per run in ``directory``, replaced atomically (a crash leaves the old one)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        private_dir(self.directory)  # a run's messages (its files are mkstemp's, 0600)

    def _path(self, run_id: str) -> Path:
        if not _SAFE_ID.match(run_id):
            raise ConfigurationError(f"run id {run_id!r} cannot name a checkpoint file")
        return self.directory / f"{run_id}.json"

    def save(self, state: RunState) -> None:
        target = self._path(state.run_id)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{state.run_id}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(state.model_dump_json())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load(self, run_id: str) -> RunState | None:
        path = self._path(run_id)
        if not path.exists():
            return None
        return RunState.model_validate_json(path.read_bytes())
