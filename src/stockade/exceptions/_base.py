"""The root of the tree: what every error and run signal shares (a message, ``retry_after``,
``retryable``, pickling with their state) and ``StockadeError``.

Apart because every other module of the tree builds on it and on nothing else.
"""

from __future__ import annotations

from typing import Any, ClassVar


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
