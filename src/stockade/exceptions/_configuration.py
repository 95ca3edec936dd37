"""``ConfigurationError`` and its kinds: the caller asked for something invalid (an argument,
a limit this host cannot enforce, the policy file, an untrusted path, a run's id or seed).

Apart because these are the caller's to fix before anything runs: each is ``caller_error``.
"""

from __future__ import annotations

from stockade.exceptions._base import StockadeError


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
