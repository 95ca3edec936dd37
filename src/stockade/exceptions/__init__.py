"""The stockade error tree, and the signals that stop a run.

Every error says whether retrying the same call can help (``retryable``) and, when the
cause knows, after how long (``retry_after``, seconds). Native errors (bwrap, docker,
runsc, the OS) are translated once, at the backend boundary, to the most specific type.

    StockadeError
    ├── ConfigurationError            you called it wrong, or the policy file is wrong
    │   ├── InvalidArgument           one argument is wrong: ``argument`` names it, ``fix`` says what to give
    │   ├── LimitNotEnforceable       this host cannot enforce a limit you asked for
    │   ├── PolicyFileError           the policy file is invalid; ``problems`` lists each, with its line
    │   ├── ImageNotFound             the sandbox image is not on this host (build it)
    │   ├── UntrustedPath             a cache or state folder another user could change: ``path``, ``fix``
    │   ├── SeedTooLarge              the workspace is bigger than the run store keeps (a seed, a snapshot)
    │   │   └── RunHistoryFull        the run's recorded workspaces reached the store's total per run
    │   ├── ComplianceNotMet          a declared compliance profile is not met; ``unmet``: what, and the fix
    │   ├── RunConflict               a new run's id is taken, or the run ended and is kept as it is
    │   └── ApprovalDecided           a decision for an approval request that is not pending (decided, spent)
    ├── TierUnavailable               no tier on this host satisfies the request (fails closed)
    ├── SandboxError                  something about one sandbox
    │   ├── SandboxStartError         [retryable] the sandbox did not come up
    │   ├── BackendUnavailable        [retryable] the engine (dockerd, ...) is unreachable
    │   ├── ResourceContention        [retryable] the host is out of a shared resource
    │   ├── SandboxCrashed            the sandbox died under a call; ``cause`` and the output so far
    │   ├── SandboxClosed             the sandbox was closed; create a new one
    │   │   └── SandboxGone           the service's process that held it died; its quota is free
    │   ├── ProtocolError             the in-sandbox supervisor spoke nonsense (it is untrusted)
    │   └── SnapshotError             a snapshot cannot be taken, kept or restored
    │       ├── SnapshotStoreFull     no room in the store: nothing kept, no more than the room written
    │       ├── SnapshotNotFound      no snapshot (or paused sandbox) with that id in the store
    │       ├── SnapshotCorrupt       its bytes do not match its hash (modified, truncated): refused
    │       └── SnapshotIncompatible  not restorable here (another tier, kernel, QEMU; files past its limits)
    ├── WorkspaceError                a files call was refused
    │   ├── PathEscapeError           the path leads outside the workspace
    │   ├── SandboxFileNotFound       nothing at that path
    │   ├── FileTypeError             a directory where a file was expected, a FIFO, ...
    │   ├── FileTooLarge              bigger than the transfer cap
    │   ├── ListingTooLarge           a listing over what one answer carries: list less of it
    │   ├── TreeTooDeep               folders deeper than an archive takes (128): snapshots, uploads
    │   ├── PathTooLong               a path longer than an archive takes (4,096 bytes): downloads, snapshots
    │   ├── BaselineTampered          the run's diff baseline is not the one the host recorded
    │   ├── BaselineUnreadable        the run's diff baseline does not parse: no diff is made from it
    │   └── WorkspaceFull             the workspace's size or inode limit is reached
    ├── PolicyDenied                  a guard refused the action (fed back to the model)
    │   └── ApprovalsFull             the run has as many requests pending as it may: refused, not kept
    ├── ModelError                    the LLM provider failed or refused (``status_code``)
    │   ├── ModelUnavailable          [retryable] 5xx, overloaded, connection reset
    │   ├── ModelRateLimited          [retryable] 429; ``retry_after`` from Retry-After
    │   ├── ModelAuthError            401/403: the key is missing, wrong or not allowed
    │   ├── ModelRequestRejected      400/404/422: the request itself is wrong
    │   └── ModelResponseInvalid      the answer cannot be counted (negative or non-numeric usage)
    ├── AuditError                    the audit trail could not do its job
    │   ├── AuditStoreError           [retryable] the audit store is unreachable or locked
    │   │   └── AuditStoreChanged     [retryable] a writer wrote into the file while it was read
    │   └── AuditIntegrityError       verify found the chain edited, cut or reordered
    ├── RunStoreError                 [retryable] the run store (checkpoints, traces) is unreachable
    │   ├── RunLeased                 [retryable] another process runs this run; ``retry_after``: its lease
    │   └── RunStoreCorrupt           a stored row does not parse, or a reader finds a table missing
    ├── ToolError                     a tool could not do what the model asked (fed back to it)
    │   ├── InvalidToolCall           unknown tool or arguments that fail its schema
    │   ├── PatchRejected             a diff does not apply; nothing was changed
    │   ├── ToolTimeout               the call ran past the tool's ``timeout_s``; its sandbox work was cut
    │   └── CallCancelled             its caller (an MCP client) cancelled the call; its sandbox work was cut
    ├── RuntimeLimit                  a runtime control refused the action for now
    │   ├── CircuitOpen               [retryable] too many consecutive failures; retry after cool-down
    │   ├── RateLimited               [retryable] too many actions in the window; retry after
    │   ├── QuotaExceeded             a tenant's quota (live sandboxes, CPUs, memory) is full; free some
    │   ├── SessionBusy               [retryable] an MCP session (or server) holds all the queued calls it may
    │   └── RunDeferred               a service run waits queued for its window; run it after ``retry_after``
    └── ServiceError                  the HTTP service (``stockade serve``) refused or could not answer
        ├── AuthenticationError       no API token, or one the service does not know (HTTP 401)
        ├── ResourceNotFound          no such sandbox, run or request, or not the caller's (HTTP 404)
        ├── RequestTooLarge           a request's body is over the service's cap (HTTP 413)
        ├── RequestTimeout            a request's body came too slowly (HTTP 408)
        ├── RunWaitTimeout            [retryable] a run still going when a client's wait ended
        └── ServiceUnavailable        [retryable] the service cannot be reached, or answered 5xx

An error that is the caller's (``caller_error``: a ConfigurationError, WorkspaceError,
PolicyDenied, InvalidToolCall, PatchRejected, CallCancelled, SnapshotNotFound, ResourceNotFound
or RequestTooLarge) says what was asked was wrong, not that what served it failed: no circuit
breaker counts it (a run reading missing files opened ``tool:read_file`` for every run).

A control that ends a run does not fail anything: it raises a ``RunStopped``, control flow
apart from the error tree, as ``asyncio.CancelledError`` is. It derives from ``BaseException``,
so that no ``except Exception`` (a tool's, a wrapper's) can swallow a kill or a pause on its
way to the loop, which ends the run with its ``status``:

    RunStopped                        a control ends the run with a status
    ├── BudgetExceeded                status "budget": steps, wall time, tokens, dollars, $/hour spent
    ├── RunKilled                     status "killed": someone pulled the kill switch
    ├── RunInterrupted                status "interrupted": stopped from outside (Ctrl-C, SIGTERM); resumable
    ├── CircuitBroken                 status "broken": the agent's actions failed N times in a row; resumable
    ├── LimitWait                     status "interrupted": a rate or spend window is full for long; resumable
    └── ApprovalRequired              status "paused": a human must decide; resume the run after

Both pickle cleanly with their state (they cross process boundaries in the distributed tier).

Each branch of the tree is defined in a private module named for its concern (``_configuration``,
``_sandbox``, ``_workspace``, ``_controls``, ``_service``, ``_agent``, ``_signals``, ``_stores``,
all on ``_base``). Every name is imported from here, ``stockade.exceptions``, which is also each
one's ``__module__``, as before the split: tracebacks and reprs name a class where users import it,
and a pickle names it so too, so that one made by an older or newer stockade loads the same.
"""

from __future__ import annotations

from stockade.exceptions._agent import (
    CallCancelled,
    InvalidToolCall,
    ModelAuthError,
    ModelError,
    ModelRateLimited,
    ModelRequestRejected,
    ModelResponseInvalid,
    ModelUnavailable,
    PatchRejected,
    ToolError,
    ToolTimeout,
)
from stockade.exceptions._base import StockadeError
from stockade.exceptions._base import _Raised as _Raised
from stockade.exceptions._base import _rebuild as _rebuild
from stockade.exceptions._configuration import (
    ApprovalDecided,
    ComplianceNotMet,
    ConfigurationError,
    ImageNotFound,
    InvalidArgument,
    LimitNotEnforceable,
    PolicyFileError,
    RunConflict,
    RunHistoryFull,
    SeedTooLarge,
    UntrustedPath,
)
from stockade.exceptions._controls import (
    ApprovalsFull,
    CircuitOpen,
    PolicyDenied,
    QuotaExceeded,
    RateLimited,
    RunDeferred,
    RuntimeLimit,
    SessionBusy,
)
from stockade.exceptions._sandbox import (
    BackendUnavailable,
    ProtocolError,
    ResourceContention,
    SandboxClosed,
    SandboxCrashed,
    SandboxError,
    SandboxGone,
    SandboxStartError,
    SnapshotCorrupt,
    SnapshotError,
    SnapshotIncompatible,
    SnapshotNotFound,
    TierUnavailable,
)
from stockade.exceptions._sandbox import SnapshotStoreFull as SnapshotStoreFull
from stockade.exceptions._service import (
    AuthenticationError,
    RequestTimeout,
    RequestTooLarge,
    ResourceNotFound,
    RunWaitTimeout,
    ServiceError,
    ServiceUnavailable,
)
from stockade.exceptions._signals import (
    ApprovalRequired,
    BudgetExceeded,
    CircuitBroken,
    LimitWait,
    RunInterrupted,
    RunKilled,
    RunStopped,
)
from stockade.exceptions._stores import (
    AuditError,
    AuditIntegrityError,
    AuditStoreChanged,
    AuditStoreError,
    RunLeased,
    RunStoreCorrupt,
    RunStoreError,
)
from stockade.exceptions._workspace import (
    BaselineTampered,
    BaselineUnreadable,
    FileTooLarge,
    FileTypeError,
    ListingTooLarge,
    PathEscapeError,
    PathTooLong,
    SandboxFileNotFound,
    TreeTooDeep,
    WorkspaceError,
    WorkspaceFull,
)

__all__ = [
    "ApprovalDecided",
    "ApprovalRequired",
    "ApprovalsFull",
    "AuditError",
    "AuditIntegrityError",
    "AuditStoreChanged",
    "AuditStoreError",
    "AuthenticationError",
    "BackendUnavailable",
    "BaselineTampered",
    "BaselineUnreadable",
    "BudgetExceeded",
    "CallCancelled",
    "CircuitBroken",
    "CircuitOpen",
    "ComplianceNotMet",
    "ConfigurationError",
    "FileTooLarge",
    "FileTypeError",
    "ImageNotFound",
    "InvalidArgument",
    "InvalidToolCall",
    "LimitNotEnforceable",
    "LimitWait",
    "ListingTooLarge",
    "ModelAuthError",
    "ModelError",
    "ModelRateLimited",
    "ModelRequestRejected",
    "ModelResponseInvalid",
    "ModelUnavailable",
    "PatchRejected",
    "PathEscapeError",
    "PathTooLong",
    "PolicyDenied",
    "PolicyFileError",
    "ProtocolError",
    "QuotaExceeded",
    "RateLimited",
    "RequestTimeout",
    "RequestTooLarge",
    "ResourceContention",
    "ResourceNotFound",
    "RunConflict",
    "RunDeferred",
    "RunHistoryFull",
    "RunInterrupted",
    "RunKilled",
    "RunLeased",
    "RunStopped",
    "RunStoreCorrupt",
    "RunStoreError",
    "RunWaitTimeout",
    "RuntimeLimit",
    "SandboxClosed",
    "SandboxCrashed",
    "SandboxError",
    "SandboxFileNotFound",
    "SandboxGone",
    "SandboxStartError",
    "SeedTooLarge",
    "ServiceError",
    "ServiceUnavailable",
    "SessionBusy",
    "SnapshotCorrupt",
    "SnapshotError",
    "SnapshotIncompatible",
    "SnapshotNotFound",
    "SnapshotStoreFull",
    "StockadeError",
    "TierUnavailable",
    "ToolError",
    "ToolTimeout",
    "TreeTooDeep",
    "UntrustedPath",
    "WorkspaceError",
    "WorkspaceFull",
]

# what the private modules define is named here (see above), the function pickles call included
for _value in list(globals().values()):
    if getattr(_value, "__module__", "").startswith(f"{__name__}."):
        _value.__module__ = __name__
del _value
