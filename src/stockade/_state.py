"""stockade's own records in a folder it copies: never part of the copy.

stockade keeps its records in ``.stockade/`` of the folder it runs from (the audit trail with
its sealing keys, the run store, snapshots, paused runs), and that folder is often the very
workspace an agent works on. A copy of a workspace (a sandbox's seed, ``files.upload_dir``, a
run's kept seed, a workspace the service is sent) leaves them out, so that code in a sandbox
never reads earlier runs' trails or the keys that erasure destroys.

A folder named ``.stockade`` is left out at any depth, not only at the top: stockade writes
it wherever it was started, and it may have been started from any subfolder. Of such a folder
only what a run writes there inside its own sandbox is carried (the diff's baseline, saved
outputs, reports): a workspace saved from a paused run (``AgentSession.save_workspace``) holds
them, and the run resumed from that copy needs its baseline. stockade never writes those names
on the host, and a store a configuration puts under one of them is left out by its own path
(``GuardedAgent``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

__all__ = ["CARRIED", "STATE_DIR", "is_state", "sqlite_files", "sqlite_path", "within"]

STATE_DIR = ".stockade"
# What the run itself keeps in the sandbox's ``.stockade/`` (tools.workspace_diff.BASELINE,
# tools.observations.OUTPUT_DIR, tools.testrun.REPORT_DIR; a unit test keeps them in step).
CARRIED = frozenset({"baseline.json", "outputs", "reports"})


def is_state(path: str) -> bool:
    """Whether the relative POSIX ``path`` names stockade's records (or what they hold): an
    entry of a ``.stockade`` folder that is not the run's own bookkeeping."""
    parts = path.split("/")
    return any(part == STATE_DIR and parts[i + 1] not in CARRIED for i, part in enumerate(parts[:-1]))


def sqlite_path(url: str) -> Path | None:
    """The file of a database given as ``sqlite:///PATH`` or as a bare path (as the commands'
    ``--db`` takes it); None for another database's URL (``postgresql://...``)."""
    if "://" in url and not url.startswith("sqlite:///"):
        return None
    return Path(url.removeprefix("sqlite:///"))


def sqlite_files(database: Path) -> tuple[Path, ...]:
    """A SQLite database and the files beside it that hold its pages too."""
    return (database, *(database.with_name(database.name + end) for end in ("-wal", "-shm", "-journal")))


def within(folder: Path, paths: Iterable[Path]) -> tuple[str, ...]:
    """Those of ``paths`` that lie inside ``folder`` (strictly), as globs relative to it that
    name exactly them (a ``[``, ``*`` or ``?`` in a name is no wildcard)."""
    from stockade._globs import literal_glob

    root = folder.resolve()
    found: list[str] = []
    for path in paths:
        full = path.resolve()
        if full != root and full.is_relative_to(root):
            found.append(literal_glob(full.relative_to(root).as_posix()))
    return tuple(dict.fromkeys(found))
