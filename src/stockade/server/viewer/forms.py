"""What a form posted to the viewer is checked for: its CSRF token (``csrf_token``), whether it
came from the viewer's own pages (``same_site``), the times a filter gives (``parse_time``).
Apart from the routes, which ask these before they act.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import UTC, datetime
from urllib.parse import urlsplit

from fastapi import Request

from stockade import exceptions as exc

__all__ = ["CROSS_SITE", "csrf_token", "parse_time", "same_site"]


def csrf_token(credential: str) -> str:
    return hmac.new(credential.encode(), b"stockade viewer form", hashlib.sha256).hexdigest()


def parse_time(value: str | None, field: str) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise exc.InvalidArgument(
            f"{field} {value!r} is not a date and time",
            argument=field,
            fix="give e.g. 2026-01-31T14:00 (UTC)",
        ) from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


CROSS_SITE = "a form of another site cannot sign this browser in or out: use this page's own form"


def same_site(request: Request) -> bool:
    """Whether a form was posted from the viewer itself. Browsers say where a request comes
    from (``Sec-Fetch-Site``; older ones only ``Origin``); a request that says neither is no
    browser's cross-site form (a script holding the token could sign in anyway)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = request.headers.get("origin")
    if origin is None:
        return True
    # the host as the browser asked it (a proxy in front changes the scheme, not the host)
    return urlsplit(origin).netloc == request.headers.get("host", "")
