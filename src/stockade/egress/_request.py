"""What a request says, read and checked before the proxy forwards it.

Its target (an absolute ``http://`` URL, or a path inside a tunnel) as host, port and path;
the shapes the proxy refuses (two framings, ``CONNECT`` inside a tunnel, a ``Host`` that is
not the tunnel's, a method-override header past the rule's methods, a head ``h11`` would
not read); and the headers that go on to the server. Pure functions of a request's parts,
no I/O: apart from the exchange (``_http``) that sends what they allow.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import replace
from typing import Any

from stockade.egress._feed import HEAD_LIMIT, HEAD_LINES
from stockade.egress._gate import Refused
from stockade.egress._rules import Verdict, ip_literal

__all__ = [
    "HOP_BY_HOP",
    "authority",
    "check_override",
    "checked_path",
    "forwarded_headers",
    "has_body",
    "head_size",
    "header",
    "request_line",
    "target_parts",
    "tunnel_path",
    "unreadable_verdict",
]


HOP_BY_HOP = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"proxy-authenticate",
     b"te", b"trailer", b"transfer-encoding", b"upgrade")
)  # fmt: skip


REQUEST_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+) ([\x21-\x7e]+) HTTP/\d\.\d\r?\n")


def request_line(data: bytes) -> tuple[str, str]:
    """(method, target) of ``data``'s first line if it is a request line, else (``""``, ``""``)."""
    found = REQUEST_LINE.match(data)
    if found is None:
        return "", ""
    return found[1].decode("ascii").upper(), found[2].decode("ascii")


def target_parts(target: str, tunnel: tuple[str, int, str] | None) -> tuple[str, int, str]:
    """(host, port, path) a request's target names: an absolute ``http://`` URL (port 0 for
    another scheme), or a path inside the ``tunnel`` (host, port, address)."""
    if tunnel is not None:
        return tunnel[0], tunnel[1], target
    if not target:
        return "", 0, ""
    try:
        parsed = urllib.parse.urlsplit(target)
    except ValueError:  # brackets that hold no IPv6 address, and the like: no URL, a 400
        return "", 0, target
    host = (parsed.hostname or "").lower().rstrip(".")
    literal = ip_literal(host)
    host = str(literal) if literal is not None else host
    try:
        port = (parsed.port or 80) if parsed.scheme == "http" else 0
    except ValueError:
        port = 0
    path = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
    return host, port, path


def checked_path(
    request: Any, method: str, host: str, port: int, path: str, *, tunnel: tuple[str, int, str] | None
) -> str:
    """The path to send ``request`` to, once its shape is one the proxy forwards; else
    ``Refused`` (``400``, ``403`` for a ``Host`` that is not the tunnel's)."""
    framings = [k for k, _ in request.headers if k in (b"transfer-encoding", b"content-length")]
    if len(set(framings)) > 1:
        # Two framings: read one way here and the other by a server, the bytes after the
        # body would be a request nobody judged (RFC 9112, 6.3: "ought to be handled as
        # an error"). No client sends both.
        raise Refused(400, Verdict(
            allowed=False, rule="request (framing)",
            reason="a request with both Content-Length and Transfer-Encoding",
        ))  # fmt: skip
    if method == "CONNECT":  # a tunnel is opened on the proxy's own connection, not inside one
        raise Refused(400, Verdict(
            allowed=False, rule="request (method)",
            reason="CONNECT inside a tunnel: open each tunnel through the proxy itself",
        ))  # fmt: skip
    if tunnel is not None:
        # Inside a tunnel the server reads the host from an absolute target, not from
        # Host (RFC 9112, 3.2.2): only the tunnel's own origin, sent as a path.
        inside = tunnel_path(request.target.decode("ascii", "replace"), tunnel)
        if inside is None:
            raise Refused(400, Verdict(
                allowed=False, rule="request (target)",
                reason=f"inside a tunnel to {host}:{port} the target must be a path (or https://{host}:{port}/...)",
            ))  # fmt: skip
        path = inside
    if tunnel is None and (not host or not port):  # port 0: not an http:// URL
        raise Refused(400, Verdict(
            allowed=False, rule="request",
            reason="send http:// URLs (that parse) as absolute URLs, and https:// through CONNECT",
        ))  # fmt: skip
    if tunnel is not None:
        said = header(request.headers, b"host")
        if said is not None and authority(said, default_port=port)[0] != host:
            raise Refused(403, Verdict(
                allowed=False, rule="request (host)",
                reason=f"the Host header names {said}; this tunnel is for {host}",
            ))  # fmt: skip
    return path


# Headers by which many servers (and frameworks: Rails, Laravel, Google and Azure APIs) let a
# request say it is another method, for clients that can only send GET and POST.
METHOD_OVERRIDES = (b"x-http-method-override", b"x-http-method", b"x-method-override")


def check_override(headers: Any, verdict: Verdict, host: str) -> None:
    """``Refused`` (``403``, the rule's) for a request to a host whose rule names methods
    that says, in a method-override header, it is a method the rule does not name."""
    if not verdict.methods:
        return
    for key, value in headers:
        name = bytes(key).lower()
        if name not in METHOD_OVERRIDES:
            continue
        for part in bytes(value).decode("latin-1").upper().split(","):
            said = part.strip()
            if said and said not in verdict.methods:
                # only a method's name is quoted: a header's value could be anything, a secret too
                shown = said if said.isalpha() and len(said) <= 16 else "another method"
                raise Refused(403, replace(verdict, allowed=False, reason=(
                    f"{shown} (said by {name.decode()}) to {host} is not allowed "
                    f"(allowed: {', '.join(verdict.methods)})"
                )))  # fmt: skip


def tunnel_path(target: str, tunnel: tuple[str, int, str]) -> str | None:
    """The origin-form target (a path) for a request inside ``tunnel``: ``target`` itself if
    it is one, the path of an absolute ``https://`` target naming the tunnel's own host and
    port; ``None`` for anything else (another host, another scheme, ``*``, a bare name)."""
    if target.startswith("/"):
        return target
    try:
        parsed = urllib.parse.urlsplit(target)
        port = parsed.port or 443
    except ValueError:
        return None
    host = (parsed.hostname or "").lower().rstrip(".")
    literal = ip_literal(host)
    host = str(literal) if literal is not None else host
    if parsed.scheme.lower() != "https" or parsed.username is not None or parsed.password is not None:
        return None
    if (host, port) != (tunnel[0], tunnel[1]) or parsed.fragment:
        return None
    return (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")


def unreadable_verdict(err: Any) -> tuple[int, Verdict]:
    """The status and the reason for a request head h11 refused (``None``: one that did not
    come whole in time). h11's own message quotes
    the bytes it refused (a header's value could be anything, a secret too): only its kind
    is kept."""
    message = str(err).lower()
    if err is None:
        status, rule, reason = 408, "request (timeout)", "the request's head did not end in time"
    elif getattr(err, "error_status_hint", 400) == 431 and "lines" in message:
        status, rule, reason = 431, "request (size)", f"a request head of more than {HEAD_LINES} lines"
    elif getattr(err, "error_status_hint", 400) == 431:
        status, rule, reason = 431, "request (size)", f"a request head longer than {HEAD_LIMIT} bytes"
    elif "content-length" in message:
        status, rule, reason = 400, "request (framing)", "two Content-Length values, or one that is no number"
    elif "transfer-encoding" in message:
        status, rule, reason = 400, "request (framing)", "a Transfer-Encoding other than chunked"
    elif "closed" in message:
        status, rule, reason = 400, "request (syntax)", "the connection ended inside the request's head"
    else:
        status, rule, reason = 400, "request (syntax)", "not HTTP/1.1 (the request line or a header)"
    return status, Verdict(allowed=False, rule=rule, reason=reason)


def authority(text: str, default_port: int = 0) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) as (host, port); (``""``, 0) when it does not parse."""
    text = text.strip()
    try:
        parsed = urllib.parse.urlsplit("//" + text)
        host = (parsed.hostname or "").lower().rstrip(".")
        port = parsed.port or default_port
    except ValueError:
        return "", 0
    literal = ip_literal(host)
    return (str(literal) if literal is not None else host), port


def header(headers: Any, name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def forwarded_headers(headers: Any, host: str, port: int, scheme: str) -> list[tuple[bytes, bytes]]:
    default = 443 if scheme == "https" else 80
    name = (f"[{host}]" if ":" in host else host) + (f":{port}" if port != default else "")
    out = [(b"Host", name.encode())]
    for key, value in headers:
        lower = key.lower()
        if lower in HOP_BY_HOP or lower in (b"host", b"content-length"):
            continue
        if lower == b"expect" and bytes(value).strip().lower() == b"100-continue":
            continue  # answered by the proxy (``Exchange._send_request``)
        out.append((bytes(key), bytes(value)))
    # One framing, the one h11 read the body by (Transfer-Encoding beats Content-Length; a
    # request with both is refused before this), and h11 re-frames the body it forwards.
    if any(k.lower() == b"transfer-encoding" for k, _ in headers):
        out.append((b"Transfer-Encoding", b"chunked"))
        return out
    for key, value in headers:
        if key.lower() == b"content-length":
            out.append((b"Content-Length", bytes(value)))
            break
    return out


def head_size(event: Any) -> int:
    """About the bytes of a request's or a response's head as it came (h11 keeps its parts,
    not its bytes): its first line, and each header line with its ``": "`` and line end (so
    a head within ``HEAD_LIMIT`` has at most 16,384 header lines)."""
    first = 15 + len(event.reason) if hasattr(event, "reason") else 12 + len(event.method) + len(event.target)
    return first + sum(len(k) + len(v) + 4 for k, v in event.headers)


def has_body(headers: Any) -> bool:
    """Whether a request comes with a body (h11 has checked its framing headers)."""
    for key, value in headers:
        lower = key.lower()
        if lower == b"transfer-encoding" or (lower == b"content-length" and bytes(value).strip() != b"0"):
            return True
    return False
