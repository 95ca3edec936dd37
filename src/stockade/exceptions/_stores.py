"""``AuditError`` and ``RunStoreError`` with their kinds: the audit trail or the run store
could not record, read or prove what happened.

Apart because these are the stores' failures, which the trail and the run store keep
apart from each other.
"""

from __future__ import annotations

from stockade.exceptions._base import StockadeError


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
