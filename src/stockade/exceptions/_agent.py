"""``ToolError`` and ``ModelError`` with their kinds: what an agent's calls fail with, a tool
it called or the LLM provider it asked.

Apart because the loop feeds a tool's failure back to the model, and a model's failure is
the provider's (its status code, its Retry-After).
"""

from __future__ import annotations

from stockade.exceptions._base import StockadeError


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
