"""``ServiceError`` and its kinds: the HTTP service (``stockade serve``) refused a request
or could not answer it, as its clients see it.

Apart because these describe the service's requests, not the sandboxes or runs behind them.
"""

from __future__ import annotations

from stockade.exceptions._base import StockadeError


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
