"""``WorkspaceError`` and its kinds: a files call refused (a path outside the workspace or
not there, the wrong kind of file, too large, too deep, a tampered diff baseline, a full
workspace).

Apart because these are about the path the caller gave, not about the sandbox serving it.
"""

from __future__ import annotations

from stockade.exceptions._base import StockadeError


class WorkspaceError(StockadeError):
    """A files call was refused. ``path`` is the path as the caller gave it."""

    caller_error = True

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class PathEscapeError(WorkspaceError):
    """The path (or a symlink on it) leads outside the workspace."""


class SandboxFileNotFound(WorkspaceError):
    pass


class FileTypeError(WorkspaceError):
    """The path exists but is the wrong kind of thing (directory, FIFO, socket, ...)."""


class FileTooLarge(WorkspaceError):
    pass


class TreeTooDeep(WorkspaceError):
    """The tree holds folders more than 128 deep, what an archive of it takes: a snapshot is
    refused, as is an upload (``files.upload_dir``, the service's archive and workspace
    uploads, a run's seed); ``files.download_dir`` leaves such folders out and reports them."""


class PathTooLong(WorkspaceError):
    """The tree holds a path longer than an archive of it takes (4,096 bytes, what Linux
    takes in one path): ``files.download_dir`` and a snapshot (``pause`` too) are refused, and
    the message names the path; shorten or remove it. No store's room is at fault: retrying
    the same call cannot help."""


class BaselineTampered(WorkspaceError):
    """The workspace's diff baseline (``.stockade/baseline.json``) is not the file the run wrote:
    code in the sandbox rewrote or removed it. The host kept its SHA-256 and size, so a forged
    one is refused, read no further than the real one's size, and no diff is made from it."""


class BaselineUnreadable(WorkspaceError):
    """The workspace's diff baseline does not parse as one: the file the run wrote (its hash
    matched) past a bound it should have fit, or, for a caller that kept no hash, a file that
    is not a baseline. No diff is made from it: an empty baseline in its place showed every
    file as new and hid the run's real changes."""


class ListingTooLarge(WorkspaceError):
    """A listing's paths are over what one answer carries (``protocol.MAX_LIST_JSON``): list
    a folder inside it, or to a smaller depth."""


class WorkspaceFull(WorkspaceError):
    """The workspace's size or inode limit is reached."""
