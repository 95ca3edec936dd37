"""Provider failures mapped once to the ``ModelError`` family, by HTTP status.

429 is rate limiting and 5xx (and Anthropic's 529 "overloaded") are transient, as are
connection resets and timeouts; 400/404/422 mean the request is wrong and 401/403 the key
is: retrying those cannot help. Retry-After (seconds or an HTTP date) and OpenAI's
``retry-after-ms`` become ``retry_after``.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Mapping

from stockade.exceptions import (
    ModelAuthError,
    ModelError,
    ModelRateLimited,
    ModelRequestRejected,
    ModelUnavailable,
)

__all__ = ["from_status", "parse_retry_after", "unavailable"]


def parse_retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    lowered = {k.lower(): v for k, v in headers.items()}
    millis = lowered.get("retry-after-ms")
    if millis:
        try:
            return max(float(millis) / 1000, 0.0)
        except ValueError:
            pass
    value = lowered.get("retry-after")
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(value) if value.strip() else None
        if parsed is None:
            return None
        return max(parsed.timestamp() - (time.time() if now is None else now), 0.0)


def from_status(provider: str, status: int, message: str, headers: Mapping[str, str]) -> ModelError:
    text = f"{provider} returned HTTP {status}: {message}"
    if status == 429:
        return ModelRateLimited(
            text, provider=provider, status_code=status, retry_after=parse_retry_after(headers)
        )
    if status >= 500 or status in (408, 409):
        return ModelUnavailable(
            text, provider=provider, status_code=status, retry_after=parse_retry_after(headers)
        )
    if status in (401, 403):
        return ModelAuthError(
            f"{text} (check the API key and its access to this model)", provider=provider, status_code=status
        )
    return ModelRequestRejected(text, provider=provider, status_code=status)


def unavailable(provider: str, err: Exception) -> ModelError:
    return ModelUnavailable(f"cannot reach {provider}: {type(err).__name__}: {err}", provider=provider)
