"""A saved sandbox (``Snapshot``) and what it keeps of one (``SnapshotKind``).

Apart because a snapshot is a sandbox's state at rest, kept in a store, not a call's outcome.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SnapshotKind(enum.StrEnum):
    """What a snapshot keeps of a sandbox.

    ``files``: the workspace, /tmp (where ``pip install --user`` puts packages, as ``$HOME``
    is /tmp) and the environment; a restored sandbox starts fresh processes on them.
    ``memory``: all of that and the memory of every process, so the interpreter's variables
    and its threads go on where they were (gVisor without Docker, the microVM).
    """

    FILES = "files"
    MEMORY = "memory"


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """A saved sandbox, kept in a snapshot store (``stockade.sandbox.SnapshotStore``) under
    ``id``, the hash of what it is made of: restoring checks every byte against it.

    ``Sandbox.create(snapshot=...)`` starts a new sandbox from it (as many as wanted);
    ``source`` is the sandbox it was taken from, ``store`` the folder that keeps it.
    """

    id: str
    kind: SnapshotKind
    tier: str
    source: str
    taken_at: float
    size_bytes: int
    store: str
