"""The stockade error tree.

Every error says whether retrying the same call can help (``retryable``) and, when the
cause knows, after how long (``retry_after``, seconds). Native errors (bwrap, docker,
runsc, the OS) are translated once, at the backend boundary, to the most specific type.

    StockadeError
    ├── ConfigurationError            you called it wrong, or the policy file is wrong
    │   └── LimitNotEnforceable       this host cannot enforce a limit you asked for
    ├── TierUnavailable               no tier on this host satisfies the request (fails closed)
    ├── SandboxError                  something about one sandbox
    │   ├── SandboxStartError         [retryable] the sandbox did not come up
    │   ├── BackendUnavailable        [retryable] the engine (dockerd, ...) is unreachable
    │   ├── ResourceContention        [retryable] the host is out of a shared resource
    │   ├── SandboxCrashed            the sandbox died under us (killed, OOM of its supervisor)
    │   ├── SandboxClosed             the sandbox was closed; create a new one
    │   └── ProtocolError             the in-sandbox supervisor spoke nonsense (it is untrusted)
    ├── WorkspaceError                a files call was refused
    │   ├── PathEscapeError           the path leads outside the workspace
    │   ├── SandboxFileNotFound       nothing at that path
    │   ├── FileTypeError             a directory where a file was expected, a FIFO, ...
    │   ├── FileTooLarge              bigger than the transfer cap
    │   └── WorkspaceFull             the workspace's size or inode limit is reached
    └── PolicyDenied                  a guard refused the action (fed back to the model)

Errors pickle cleanly (they cross process boundaries in the distributed tier).
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "BackendUnavailable",
    "ConfigurationError",
    "FileTooLarge",
    "FileTypeError",
    "LimitNotEnforceable",
    "PathEscapeError",
    "PolicyDenied",
    "ProtocolError",
    "ResourceContention",
    "SandboxClosed",
    "SandboxCrashed",
    "SandboxError",
    "SandboxFileNotFound",
    "SandboxStartError",
    "StockadeError",
    "TierUnavailable",
    "WorkspaceError",
    "WorkspaceFull",
]


class StockadeError(Exception):
    """Root of every error stockade raises on purpose."""

    retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.__dict__.copy()))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[StockadeError], message: str, state: dict[str, Any]) -> StockadeError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class ConfigurationError(StockadeError):
    """The caller asked for something invalid; fix the call or the configuration."""


class LimitNotEnforceable(ConfigurationError):
    """This host cannot enforce a requested limit; pass ``allow_weaker=True`` to accept less."""

    def __init__(self, message: str, *, setting: str = "", fix: str = "") -> None:
        super().__init__(message)
        self.setting = setting
        self.fix = fix


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
    """The sandbox died: killed from outside, or its supervisor ran out of memory."""


class SandboxClosed(SandboxError):
    """The sandbox is closed; create a new one."""


class ProtocolError(SandboxError):
    """The in-sandbox supervisor sent something malformed; the sandbox is torn down."""


class WorkspaceError(StockadeError):
    """A files call was refused. ``path`` is the path as the caller gave it."""

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


class WorkspaceFull(WorkspaceError):
    """The workspace's size or inode limit is reached."""


class PolicyDenied(StockadeError):
    """A guard refused the action. The agent feeds this back to the model; it is not a crash."""

    def __init__(self, message: str, *, rule: str = "", action: str = "") -> None:
        super().__init__(message)
        self.rule = rule
        self.action = action
