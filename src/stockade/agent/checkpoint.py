"""Where run state is saved after every step, so a run can resume in another process.

A ``Checkpointer`` is two methods. The loop calls ``save`` after each node (and after each
tool call within a step, so a resumed step does not repeat calls that already ran) and
``load`` when asked to resume a run by id. Run stores (SQLite, Postgres) implement the same
protocol. ``save`` is called on the event loop's thread and should be quick.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Protocol, runtime_checkable

from stockade.agent.state import RunState
from stockade.exceptions import ConfigurationError

__all__ = ["Checkpointer", "JsonFileCheckpointer", "MemoryCheckpointer"]


@runtime_checkable
class Checkpointer(Protocol):
    def save(self, state: RunState) -> None:
        """Persist ``state``, replacing the previous checkpoint of ``state.run_id``."""

    def load(self, run_id: str) -> RunState | None:
        """The last checkpoint of ``run_id``, or None."""


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
        self.directory.mkdir(parents=True, exist_ok=True)

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
