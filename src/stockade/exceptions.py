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
"""

from __future__ import annotations

from typing import Any, ClassVar

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
    "StockadeError",
    "TierUnavailable",
    "ToolError",
    "ToolTimeout",
    "TreeTooDeep",
    "UntrustedPath",
    "WorkspaceError",
    "WorkspaceFull",
]


class _Raised(BaseException):
    """What errors and run signals share: a message, ``retry_after``, and pickling with state."""

    retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.__dict__.copy()))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[_Raised], message: str, state: dict[str, Any]) -> _Raised:
    err = cls.__new__(cls)
    BaseException.__init__(err, message)
    err.__dict__.update(state)
    return err


class StockadeError(_Raised, Exception):
    """Root of every error stockade raises on purpose."""

    # what was asked was wrong (a path that is not there, an argument, a denied action), not
    # the thing that served it: no circuit breaker counts it as that thing's failure
    caller_error: ClassVar[bool] = False


class ConfigurationError(StockadeError):
    """The caller asked for something invalid; fix the call or the configuration."""

    caller_error = True


class InvalidArgument(ConfigurationError):
    """One argument or field has a value stockade cannot use. ``argument`` names it (``Limits.pids``,
    ``trust``, ``--env``) and ``fix`` says what to give instead; the message holds both."""

    def __init__(self, message: str, *, argument: str = "", fix: str = "") -> None:
        super().__init__(f"{message}; {fix}" if fix else message)
        self.argument = argument
        self.fix = fix


class LimitNotEnforceable(ConfigurationError):
    """This host cannot enforce a requested limit; pass ``allow_weaker=True`` to accept less."""

    def __init__(self, message: str, *, setting: str = "", fix: str = "") -> None:
        super().__init__(message)
        self.setting = setting
        self.fix = fix


class ImageNotFound(ConfigurationError):
    """The container image a tier needs is missing; the message says how to build it."""


class UntrustedPath(ConfigurationError):
    """A file or folder stockade would run, load or mount from (its cache, its state folder)
    is, or sits under, one another user could change: owned by someone else, writable by a
    group or by others, or a symlink. Nothing of it was used. ``path`` is the one at fault,
    ``fix`` what to do about it."""

    def __init__(self, message: str, *, path: str = "", fix: str = "") -> None:
        super().__init__(f"{message}; {fix}" if fix else message)
        self.path = path
        self.fix = fix


class PolicyFileError(ConfigurationError):
    """The policy file is invalid. ``problems`` holds one ``file:line: field: what`` per mistake."""

    def __init__(self, message: str, *, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


class SeedTooLarge(ConfigurationError):
    """The workspace is over what the run store keeps of it (a run's seed, or a step's
    snapshot); the message says which cap, and how to raise it."""


class RunHistoryFull(SeedTooLarge):
    """The workspace contents one run has added to the run store, all its versions together,
    would pass the store's total per run (``RunStore(max_run_bytes=...)``): the call that
    would pass it is recorded without its workspace, and the run ends on it."""


class RunConflict(ConfigurationError):
    """A new run was given the id of a run the store already has, or a run that ended was
    asked to resume: runs are never reused or overwritten."""


class ApprovalDecided(ConfigurationError):
    """A decision for an approval request that no longer waits for one: it was decided, or
    its yes was spent on the action it allowed. A decision answers the question it was asked
    for, once (a repeated approve re-armed a spent yes: the same action went ahead unasked)."""

    def __init__(self, message: str, *, status: str = "") -> None:
        super().__init__(message)
        self.status = status  # what the request is now: approved, denied, spent


class ComplianceNotMet(ConfigurationError):
    """A compliance profile the policy declares has requirements the policy, the configuration
    or the host does not meet; nothing was started. ``unmet``: each, with how to fix it."""

    def __init__(self, message: str, *, unmet: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.unmet = unmet


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


class PolicyDenied(StockadeError):
    """A guard refused the action. The agent feeds this back to the model; it is not a crash."""

    caller_error = True

    def __init__(self, message: str, *, rule: str = "", action: str = "") -> None:
        super().__init__(message)
        self.rule = rule
        self.action = action


class ApprovalsFull(PolicyDenied):
    """An action that needs approval, asked while its run already has ``limit`` requests
    pending (``RunLimits.max_pending_approvals``): refused on the spot, and no request is kept
    (one run's code looping over distinct ``rm -r X$i`` kept 2,000 requests in 21 s, and
    every read of the run returned them all). The requests already pending wait as before."""

    def __init__(self, message: str, *, rule: str = "", action: str = "", limit: int = 0) -> None:
        super().__init__(message, rule=rule, action=action)
        self.limit = limit


class RuntimeLimit(StockadeError):
    """A runtime control (a circuit breaker, a rate limit) refused this action for now; the
    run goes on. Controls that end the run (budgets, the spend limit, the kill switch) raise
    ``RunStopped`` instead."""


class CircuitOpen(RuntimeLimit):
    """The breaker of ``name`` is open after repeated failures; it half-opens after ``retry_after``."""

    retryable = True

    def __init__(self, message: str, *, name: str = "", retry_after: float | None = None) -> None:
        super().__init__(message, retry_after=retry_after)
        self.name = name


class RateLimited(RuntimeLimit):
    """Too many actions in the rolling window; the next one fits after ``retry_after``."""

    retryable = True

    def __init__(self, message: str, *, key: str = "", retry_after: float | None = None) -> None:
        super().__init__(message, retry_after=retry_after)
        self.key = key


class QuotaExceeded(RuntimeLimit):
    """A tenant's quota is full: ``quota`` names it (``sandboxes``, ``cpus``, ``memory_mb``),
    ``limit`` is its size and ``used`` what is taken. Retrying helps only once something of
    the tenant's is deleted, so it is not ``retryable``."""

    def __init__(self, message: str, *, quota: str = "", limit: float = 0, used: float = 0) -> None:
        super().__init__(message)
        self.quota = quota
        self.limit = limit
        self.used = used


class SessionBusy(RuntimeLimit):
    """An MCP session has as many calls waiting behind its running one as it queues, or the
    server holds as many bytes of queued arguments as it keeps: the call is refused, not
    held; retry it once the session's calls have returned."""

    retryable = True


class RunDeferred(RuntimeLimit):
    """A service run stopped where it was to wait for its tenant's rate or spend window
    (``LimitWait``): its executor runs it again after ``retry_after``, holding no worker, thread
    or quota meanwhile. Not ``retryable`` in the generic sense: the executor schedules it."""

    def __init__(self, message: str, *, kind: str = "", retry_after: float | None = None) -> None:
        super().__init__(message, retry_after=retry_after)
        self.kind = kind


class ServiceError(StockadeError):
    """The HTTP service refused a request, or could not answer it."""


class AuthenticationError(ServiceError):
    """The request had no API token, or one the service does not know (or that was revoked)."""


class ResourceNotFound(ServiceError):
    """No such sandbox, run or approval request, for this caller: another tenant's ids are
    answered the same way, so that they cannot be probed."""

    caller_error = True

    def __init__(self, message: str, *, kind: str = "", id: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.id = id


class RequestTooLarge(ServiceError):
    """A request's body is over the service's cap (HTTP 413), refused before it is read
    whole; ``limit``: the cap in bytes, ``fix``: how to send that much instead."""

    caller_error = True

    def __init__(self, message: str, *, limit: int = 0, fix: str = "") -> None:
        super().__init__(message)
        self.limit = limit
        self.fix = fix


class RequestTimeout(ServiceError):
    """A request's body came slower than the service takes (HTTP 408): within its grace
    (``stockade serve --body-timeout``), then at its minimum rate (``--min-body-rate``); the
    connection is closed."""

    def __init__(self, message: str, *, fix: str = "") -> None:
        super().__init__(message)
        self.fix = fix


class RunWaitTimeout(ServiceError, TimeoutError):
    """``RemoteRun.wait`` ended before the run did (the run goes on: waiting again can help).
    Also a ``TimeoutError``, as it was before it had a class of its own."""

    retryable = True


class ServiceUnavailable(ServiceError):
    """The service could not be reached, or failed (HTTP 5xx); ``retry_after`` when it said."""

    retryable = True


class ToolError(StockadeError):
    """A tool could not do what the model asked; the loop shows the message to the model."""


class InvalidToolCall(ToolError):
    """The model named an unknown tool or passed arguments that fail the tool's schema."""

    caller_error = True


class PatchRejected(ToolError):
    """A unified diff does not apply. ``path`` and ``hunk`` (1-based) say where; nothing changed."""

    caller_error = True

    def __init__(self, message: str, *, path: str = "", hunk: int = 0) -> None:
        super().__init__(message)
        self.path = path
        self.hunk = hunk


class ToolTimeout(ToolError):
    """The call ran past its tool's ``timeout_s``: it was cancelled, its sandbox commands were
    bounded by the same deadline, and nothing it asks of the sandbox afterwards runs."""

    def __init__(self, message: str, *, tool: str = "", timeout_s: float = 0.0) -> None:
        super().__init__(message)
        self.tool = tool
        self.timeout_s = timeout_s


class CallCancelled(ToolError):
    """Whoever asked for the call (an MCP client's ``notifications/cancelled``) gave it up
    while it ran: what it ran in the sandbox was cut, and nothing it asks afterwards runs."""

    caller_error = True


class ModelError(StockadeError):
    """The LLM provider failed or refused. ``status_code`` is the HTTP status when there was one."""

    def __init__(
        self,
        message: str,
        *,
        provider: str = "",
        status_code: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, retry_after=retry_after)
        self.provider = provider
        self.status_code = status_code


class ModelUnavailable(ModelError):
    retryable = True


class ModelRateLimited(ModelError):
    retryable = True


class ModelAuthError(ModelError):
    """The API key is missing, wrong, or not allowed to use this model."""


class ModelRequestRejected(ModelError):
    """The provider rejected the request as malformed (400, 404, 422): retrying cannot help."""


class ModelResponseInvalid(ModelError):
    """The provider's answer reports what it cost as no count can be (negative, non-numeric):
    refused, not clamped, since budgets rest on it and a provider saying so is broken or
    hostile; asking again would not make it honest."""


class RunStopped(_Raised):
    """Raised by a control (guard, observer, tool or model wrapper) to end an agent run.

    Not an error (it derives from ``BaseException``, not ``StockadeError``): the loop ends the
    run with ``status`` instead of crashing, and nothing on the way may take it for a failure
    to report, count or retry. Subclasses name new statuses.
    """

    status: ClassVar[str] = "killed"


class BudgetExceeded(RunStopped):
    """A budget is spent: ``kind`` is steps, wall_time, tokens, dollars or dollars_per_hour."""

    status = "budget"

    def __init__(self, message: str, *, kind: str = "", retry_after: float | None = None) -> None:
        super().__init__(message, retry_after=retry_after)
        self.kind = kind


class RunKilled(RunStopped):
    """The kill switch of ``run_id`` was pulled (CLI, Redis key, file or API)."""

    status = "killed"

    def __init__(self, message: str, *, run_id: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.run_id = run_id
        self.reason = reason


class RunInterrupted(RunStopped):
    """The run was stopped from outside its loop (Ctrl-C, SIGTERM, ``AgentSession.interrupt()``)
    mid-step: its sandbox was killed, its state kept; resume it to run the interrupted step again."""

    status = "interrupted"

    def __init__(self, message: str, *, run_id: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.run_id = run_id
        self.reason = reason


class CircuitBroken(RunStopped):
    """The agent's circuit breaker tripped: its last ``len(failures)`` actions all failed (each
    named in ``failures`` with its error). The run stops, resumable once a person has looked."""

    status = "broken"

    def __init__(self, message: str, *, failures: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.failures = failures


class LimitWait(RunStopped):
    """A rate or spend window is full for longer than the run waits in place (``kind``: "rate"
    or "spend", ``key`` the window's): the run stops where it is, its state kept and the call it
    was about to make not made, so that a worker is not held asleep; resume it after
    ``retry_after`` (the service's executors do)."""

    status = "interrupted"

    def __init__(
        self, message: str, *, kind: str = "", key: str = "", retry_after: float | None = None
    ) -> None:
        super().__init__(message, retry_after=retry_after)
        self.kind = kind
        self.key = key


class ApprovalRequired(RunStopped):
    """The action waits for a human decision: the run pauses (state saved) and is resumed once
    ``request_id`` is approved or denied (``stockade approve|deny RUN_ID REQUEST_ID``)."""

    status = "paused"

    def __init__(self, message: str, *, rule: str = "", action: str = "", request_id: str = "") -> None:
        super().__init__(message)
        self.rule = rule
        self.action = action
        self.request_id = request_id


class AuditError(StockadeError):
    """The audit trail could not record or prove what happened."""


class AuditStoreError(AuditError):
    """The audit store is unreachable, locked or failing; the events are kept for the next try."""

    retryable = True


class AuditStoreChanged(AuditStoreError):
    """A writer wrote into the audit store's file while it was read: nothing read is proven;
    reading it again (``after_seq`` the last event seen) gives what was written."""


class AuditIntegrityError(AuditError):
    """``verify`` found the chain edited, truncated, reordered, or not signed with the given key."""


class RunStoreError(StockadeError):
    """The run store (checkpoints, step traces) is unreachable, locked or failing. It may share
    a database with the audit trail, but it is not the trail: a run store that fails leaves the
    trail as it was."""

    retryable = True


class RunLeased(RunStoreError):
    """Another process holds the run's lease (it runs the run); ``retry_after`` is when the
    lease expires if that process stops renewing it."""


class RunStoreCorrupt(RunStoreError):
    """A stored row cannot be read back (the message names its table and key), or a store
    opened read-only lacks a table or column (a reader makes none): retrying reads the same."""

    retryable = False
