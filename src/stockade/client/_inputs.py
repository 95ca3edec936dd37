"""What the clients check before a request: the local SDK's own checks (``stockade._checks``
and the ``_requests`` builders, called, not copied), and what the wire adds. The service's API
carries text as UTF-8 (JSON bodies, query strings, URL paths), so a lone surrogate, which the
local SDK passes to the sandbox as the byte it stands for, cannot be sent: it is refused here,
as ``InvalidArgument`` naming the argument, never a ``UnicodeEncodeError`` from the HTTP
library. A wrong value fails before any request, so a caller's mistake is never mistaken for
an unreachable service (``ServiceUnavailable`` is retryable; a mistake is not)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import quote

from stockade._checks import check_id, check_number
from stockade.exceptions import InvalidArgument
from stockade.sandbox._requests import check_path

__all__ = [
    "argv",
    "byte_data",
    "folder",
    "host_path",
    "offset",
    "path",
    "segment",
    "sendable",
    "service_url",
    "stdin_text",
    "text",
    "token",
]

_UTF8_FIX = "give UTF-8 text: the service's API carries text as UTF-8, and a lone surrogate is none"


def _shown(value: object) -> str:
    shown = ascii(value) if isinstance(value, str) else type(value).__name__
    return shown if len(shown) <= 60 else shown[:57] + "..."


def utf8(value: str, argument: str) -> str:
    """``value`` if it encodes as UTF-8 (a ``str`` holding a lone surrogate does not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidArgument(
            f"{argument} holds {value[error.start]!a}, a lone surrogate, at {error.start}",
            argument=argument,
            fix=_UTF8_FIX,
        ) from None
    return value


def text(value: object, argument: str) -> str:
    """A ``str`` that can be sent."""
    if not isinstance(value, str):
        raise InvalidArgument(
            f"{argument} must be a str, got {_shown(value)}", argument=argument, fix="give it as text"
        )
    return utf8(value, argument)


def sendable(value: object, where: str) -> None:
    """Refuse, naming where it is, what JSON or a query string cannot carry to the service:
    text that is no UTF-8, a float that is not finite, a value of no JSON type. The last
    guard before every request: what a call's own checks let through never fails inside the
    HTTP library."""
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgument(
                f"{where} must be finite, got {value!r}", argument=where, fix="give a finite number"
            )
    elif isinstance(value, str):
        utf8(value, where)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            sendable(text(key, f"a key of {where}"), f"a key of {where}")
            sendable(item, f"{where}[{key!r}]")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            sendable(item, f"{where}[{index}]")
    else:
        raise InvalidArgument(
            f"{where} cannot be sent to the service: {_shown(value)}",
            argument=where,
            fix="give text, a number, a bool, or a list or dict of them",
        )


# The longest workspace path sent: what the kernel takes (PATH_MAX). Percent-encoded in a
# query it is at most 12 KiB, inside the 16 KiB the service reads of a request's head; a
# 64 KiB path was an httpx2.InvalidURL ("query too long"), a StockadeError of none.
MAX_PATH_BYTES = 4096


def path(value: object, argument: str = "path") -> str:
    """A workspace path: the local SDK's ``check_path`` (a str, no NUL, inside the workspace),
    UTF-8, which a name must be to travel in a query string, and at most ``MAX_PATH_BYTES``."""
    checked = utf8(check_path(value, argument=argument), argument)
    size = len(checked.encode("utf-8"))
    if size > MAX_PATH_BYTES:
        raise InvalidArgument(
            f"{argument} is {size} bytes long (as UTF-8), past the {MAX_PATH_BYTES} a path may hold",
            argument=argument,
            fix=f"give a workspace path of at most {MAX_PATH_BYTES} bytes",
        )
    return checked


def segment(value: object, argument: str) -> str:
    """An id as one segment of a URL path: ``check_id`` (text of 1 to 256 characters, no control
    character, UTF-8), not a dot segment (a URL resolves those away), percent-encoded, so that
    ``/``, ``?`` or ``#`` stay in the id instead of leading to another resource."""
    checked = check_id(value, argument=argument)
    if checked in (".", ".."):
        raise InvalidArgument(
            f"{argument} {checked!r} names no resource in a URL", argument=argument, fix="give the id itself"
        )
    return quote(checked, safe="")


def argv(cmd: object) -> str | list[str]:
    """A command as the service takes it: a shell line, or an argv of text."""
    if isinstance(cmd, str):
        return utf8(cmd, "cmd")
    if isinstance(cmd, Sequence) and not isinstance(cmd, bytes | bytearray):
        return [text(word, f"cmd[{index}]") for index, word in enumerate(cmd)]
    raise InvalidArgument(
        f"cmd must be a shell line (str) or an argv (a list of str), got {_shown(cmd)}",
        argument="cmd",
        fix='give "echo hi" or ["echo", "hi"]',
    )


def _bytes_like(value: object) -> bytes | None:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    return None


def stdin_text(stdin: object) -> str | None:
    """Standard input as the service takes it: text. Bytes (``bytes``, ``bytearray``,
    ``memoryview``, as the local SDK takes) are sent when they are UTF-8; other bytes cannot be."""
    if stdin is None or isinstance(stdin, str):
        return None if stdin is None else utf8(stdin, "stdin")
    raw = _bytes_like(stdin)
    if raw is None:
        raise InvalidArgument(
            f"stdin must be str or bytes, got {_shown(stdin)}", argument="stdin", fix="give text or bytes"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(
            "stdin is bytes that are not UTF-8, and the service carries a command's stdin as text",
            argument="stdin",
            fix="write the bytes into the workspace (files.write) and redirect the command from it",
        ) from None


def byte_data(data: object) -> bytes:
    """A file's content: ``str`` (as UTF-8), ``bytes``, ``bytearray`` or ``memoryview``."""
    if isinstance(data, str):
        return utf8(data, "data").encode("utf-8")
    raw = _bytes_like(data)
    if raw is None:
        raise InvalidArgument(
            f"data must be str or bytes, got {_shown(data)}", argument="data", fix="give text or bytes"
        )
    return raw


def offset(value: object, argument: str) -> int:
    """A byte offset or count sent in a query: a whole number >= 0."""
    check_number(value, argument=argument, integer=True, low=0, high=2**63 - 1, unit="bytes")
    assert isinstance(value, int)
    return value


def host_path(value: object, argument: str) -> str | os.PathLike[str]:
    """A path on this host (a folder to upload, a download's destination)."""
    if isinstance(value, str | os.PathLike) and "\x00" not in str(value):
        return value
    raise InvalidArgument(
        f"{argument} must be a path on this host (str or Path, no NUL), got {_shown(value)}",
        argument=argument,
        fix="give a folder such as 'project/' or Path('out')",
    )


def service_url(url: object, argument: str = "url") -> str:
    """The service's URL: http(s), a host, a port that can exist; refused (not retryable) here
    rather than failing on connect as an unreachable service (retryable)."""
    import httpx2

    fix = "give the service's address, such as http://127.0.0.1:8080"
    if not isinstance(url, str) or any(c <= " " or c == "\x7f" or 0xD800 <= ord(c) <= 0xDFFF for c in url):
        raise InvalidArgument(
            f"{argument} must be a URL (text without spaces or control characters), got {_shown(url)}",
            argument=argument,
            fix=fix,
        )
    try:
        parsed = httpx2.URL(url)
        port = parsed.port
    except httpx2.InvalidURL as error:
        raise InvalidArgument(f"{argument} {url!r} is no URL: {error}", argument=argument, fix=fix) from None
    if parsed.scheme not in ("http", "https") or not parsed.host or not 0 < (port or 80) < 65536:
        raise InvalidArgument(
            f"{argument} {url!r} is no http(s) URL of a host and port", argument=argument, fix=fix
        )
    return url.rstrip("/")


def token(value: object, argument: str = "token") -> str:
    """An API token: printable ASCII without spaces (what ``stockade token new`` makes), which an
    ``Authorization`` header can carry as it is."""
    if not isinstance(value, str) or not all("!" <= c <= "~" for c in value):
        raise InvalidArgument(
            f"{argument} is not a token: it must be printable ASCII without spaces",
            argument=argument,
            fix="give the token `stockade token new` printed (stk_...)",
        )
    return value


def folder(value: object, argument: str) -> Path:
    """A host folder to send, as a ``Path``."""
    return Path(host_path(value, argument))
