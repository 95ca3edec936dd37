"""Provider failures mapped once to the ``ModelError`` family, by HTTP status.

429 is rate limiting and 5xx (and Anthropic's 529 "overloaded") are transient, as are
connection resets and timeouts; 400/404/422 mean the request is wrong and 401/403 the key
is: retrying those cannot help. Retry-After (seconds or an HTTP date) and OpenAI's
``retry-after-ms`` become ``retry_after``. A response's reported usage is read here too
(``reported_usage``): missing is counted by the estimate, anything but a count is refused.
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
    ModelResponseInvalid,
    ModelUnavailable,
)
from stockade.models.messages import Usage

__all__ = ["from_status", "parse_retry_after", "reported_usage", "unavailable"]


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


def reported_usage(provider: str, input_tokens: object, output_tokens: object) -> Usage:
    """The usage a provider reported: ``Usage()`` (none: ``counted_usage`` estimates it) when it
    left either count out, else the counts, which must be whole numbers of at least 0."""
    if input_tokens is None or output_tokens is None:
        return Usage()
    counts = (input_tokens, output_tokens)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        raise ModelResponseInvalid(
            f"{provider} reported usage that is not a count of tokens "
            f"(input {input_tokens!r}, output {output_tokens!r}): its answer is refused, "
            "since budgets are counted from it",
            provider=provider,
        )
    return Usage(input_tokens=int(str(input_tokens)), output_tokens=int(str(output_tokens)), requests=1)
