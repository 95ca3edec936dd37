"""``TierUnavailable`` and ``SandboxError`` with its kinds: a sandbox that cannot start, died,
closed, spoke nonsense, or whose snapshot cannot be taken, kept or restored.

Apart because these are what a tier and one sandbox fail with, whatever the call was.
"""

from __future__ import annotations

from typing import ClassVar

from stockade.exceptions._base import StockadeError


class TierUnavailable(StockadeError):
    """No isolation tier on this host satisfies the request; stockade fails closed."""


class SandboxError(StockadeError):
    """Something went wrong with one sandbox."""


class SandboxStartError(SandboxError):
    retryable = True


class BackendUnavailable(SandboxError):
    retryable = True


class ResourceContention(SandboxError):
    retryable = True


class SandboxCrashed(SandboxError):
    """The sandbox died under a call.

    ``cause`` says why, when it is known: ``"out_of_memory"`` (its memory limit),
    ``"file_locks"`` (a process of it held more file locks than a sandbox may, 4,096),
    ``"killed"`` (from outside the sandbox), ``"unresponsive"`` (it stopped answering and the
    host took it down), ``"engine"`` (its container engine failed), ``"protocol"`` (its side
    of a channel to the host sent what stockade's supervisor never sends: it is no longer
    ours, and the host closed the sandbox), or ``"unknown"``.
    ``stdout``/``stderr`` hold what the call had printed before the sandbox died (capped like
    any output): what happened is seldom clear without them.
    """

    CAUSES: ClassVar[tuple[str, ...]] = (
        "out_of_memory", "file_locks", "killed", "unresponsive", "engine", "protocol", "unknown",
    )  # fmt: skip

    def __init__(self, message: str, *, cause: str = "unknown", stdout: str = "", stderr: str = "") -> None:
        super().__init__(message)
        self.cause = cause if cause in self.CAUSES else "unknown"
        self.stdout = stdout
        self.stderr = stderr

    def report(self, max_chars: int = 4000) -> str:
        """The error, its cause and the end of what the call printed, for a person or a model."""
        parts = [f"{self.message} (cause: {self.cause})"]
        for name, text in (("stdout", self.stdout), ("stderr", self.stderr)):
            if text:
                tail = text[-max_chars:]
                cut = f" (last {len(tail)} of {len(text)} characters)" if len(tail) < len(text) else ""
                parts.append(f"--- {name} before the crash{cut} ---\n{tail}")
        return "\n".join(parts)


class SandboxClosed(SandboxError):
    """The sandbox is closed; create a new one."""


class SandboxGone(SandboxClosed):
    """The service's API process that held the sandbox died (or stopped answering for longer
    than a node may), and the sandbox with it; its share of the tenant's quota is free again.
    Create a new one. ``id`` names the sandbox."""

    def __init__(self, message: str, *, id: str = "") -> None:
        super().__init__(message)
        self.id = id


class ProtocolError(SandboxError):
    """The in-sandbox supervisor sent something malformed; the sandbox is torn down."""

    # what is malformed, without who sent it: a caller whose archive came from elsewhere (a
    # service's, a client's upload) says so in its own words
    why: str = ""


class SnapshotError(SandboxError):
    """A snapshot could not be taken, kept or restored; the message says why (a full store
    names its limit)."""


class SnapshotStoreFull(SnapshotError):
    """The snapshot store has no room for the snapshot (its objects and the snapshots being
    written fill ``STOCKADE_SNAPSHOT_MAX_MB``, a tenant's ``snapshot_mb``): nothing of it was
    kept, and no more than the room was ever written."""


class SnapshotNotFound(SnapshotError):
    """The store has no snapshot with that id, or no paused sandbox with that id: never
    taken, deleted, already resumed, or collected."""

    caller_error = True


class SnapshotCorrupt(SnapshotError):
    """What the store holds under a snapshot's id does not hash to it: a file was modified
    or cut. Nothing was restored from it."""


class SnapshotIncompatible(SnapshotError):
    """The snapshot cannot be restored as asked: its memory needs the tier, kernel, QEMU and
    machine it was taken with, or the caller asked for limits or rules its memory does not have
    (its supervisor and kernel hold the rules it was taken with), or its
    files would not fit the sandbox's workspace or /tmp (refused at the first file that does
    not, before the rest is sent). Taking one is refused the same way when the sandbox's own
    workspace or /tmp holds more, by apparent size (a sparse file counts whole), than its
    ``disk_mb`` or ``tmp_mb``: nothing is kept and the sandbox runs on."""
