"""stockade: let autonomous agents write and run code without letting that code hurt anyone.

Importing this package has no side effects: no tier is probed, no optional dependency is
imported, nothing is started.
"""

from stockade.exceptions import (
    BackendUnavailable,
    ConfigurationError,
    FileTooLarge,
    FileTypeError,
    InvalidArgument,
    LimitNotEnforceable,
    PathEscapeError,
    PolicyDenied,
    ProtocolError,
    ResourceContention,
    SandboxClosed,
    SandboxCrashed,
    SandboxError,
    SandboxFileNotFound,
    SandboxStartError,
    StockadeError,
    TierUnavailable,
    WorkspaceError,
    WorkspaceFull,
)
from stockade.sandbox import AsyncSandbox, Sandbox
from stockade.types import (
    CommandResult,
    Enforcement,
    EntryInfo,
    EntryType,
    Execution,
    ExecutionError,
    Limits,
    Logs,
    Mechanism,
    NetworkPolicy,
    Result,
    TierReport,
    Trust,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncSandbox",
    "BackendUnavailable",
    "CommandResult",
    "ConfigurationError",
    "Enforcement",
    "EntryInfo",
    "EntryType",
    "Execution",
    "ExecutionError",
    "FileTooLarge",
    "FileTypeError",
    "InvalidArgument",
    "LimitNotEnforceable",
    "Limits",
    "Logs",
    "Mechanism",
    "NetworkPolicy",
    "PathEscapeError",
    "PolicyDenied",
    "ProtocolError",
    "ResourceContention",
    "Result",
    "Sandbox",
    "SandboxClosed",
    "SandboxCrashed",
    "SandboxError",
    "SandboxFileNotFound",
    "SandboxStartError",
    "StockadeError",
    "TierReport",
    "TierUnavailable",
    "Trust",
    "WorkspaceError",
    "WorkspaceFull",
    "__version__",
]
