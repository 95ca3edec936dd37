"""Errors as RFC 9457 problem responses, mapped from the error tree in this one place.

Every error the service answers is ``application/problem+json``:

    {"type": "/problems/path-escape", "title": "Path outside the workspace", "status": 422,
     "detail": "'../etc/passwd' leads outside the workspace", "instance": "/v1/sandboxes/…/files",
     "error": "PathEscapeError", "retryable": false, "field": "path",
     "fix": "give a path inside the workspace (relative, or under /workspace)"}

``error`` names the class of ``stockade.exceptions`` (the Python client raises that class
again), ``field`` names the argument at fault and ``fix`` what to give instead, when they
are known; a validation failure lists each field in ``errors``. ``Retry-After`` is set for
retryable errors that know when. ``GET /problems/{slug}`` describes a type.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stockade import exceptions as exc

__all__ = ["MAX_ERRORS", "Problem", "describe", "from_error", "from_validation", "problem_body"]

# the errors of a request that an answer lists; its detail counts the others
MAX_ERRORS = 20


@dataclass(frozen=True, kw_only=True)
class _Kind:
    status: int
    title: str
    fix: str = ""


# Most specific first: the first class an error is an instance of decides.
_KINDS: tuple[tuple[type[exc.StockadeError], _Kind], ...] = (
    (exc.AuthenticationError, _Kind(status=401, title="Not authenticated")),
    (exc.ResourceNotFound, _Kind(status=404, title="Not found")),
    (exc.ServiceUnavailable, _Kind(status=503, title="Service unavailable")),
    (exc.RequestTooLarge, _Kind(status=413, title="Request too large")),
    (exc.RequestTimeout, _Kind(status=408, title="Request timeout")),
    # the client's own (its wait for a run): never the server's answer, mapped for the tree's sake
    (exc.RunWaitTimeout, _Kind(status=503, title="Run still going", fix="wait again")),
    (exc.QuotaExceeded, _Kind(status=429, title="Quota exceeded", fix="delete something of yours first")),
    (exc.RateLimited, _Kind(status=429, title="Rate limited", fix="retry after Retry-After seconds")),
    (exc.CircuitOpen, _Kind(status=503, title="Circuit open", fix="retry after Retry-After seconds")),
    (exc.InvalidArgument, _Kind(status=422, title="Invalid argument")),
    (exc.LimitNotEnforceable, _Kind(status=422, title="Limit not enforceable on this host")),
    (exc.PolicyFileError, _Kind(status=422, title="Invalid policy")),
    (exc.ImageNotFound, _Kind(status=503, title="Sandbox image missing on the server")),
    (exc.SeedTooLarge, _Kind(status=413, title="Workspace too large")),
    (exc.RunConflict, _Kind(status=409, title="Run conflict")),
    (exc.ApprovalDecided, _Kind(status=409, title="Approval already decided")),
    (exc.ConfigurationError, _Kind(status=422, title="Invalid request")),
    (exc.TierUnavailable, _Kind(status=422, title="No tier satisfies the request")),
    (exc.SandboxStartError, _Kind(status=503, title="Sandbox did not start", fix="retry")),
    (exc.BackendUnavailable, _Kind(status=503, title="Sandbox engine unavailable", fix="retry")),
    (exc.ResourceContention, _Kind(status=503, title="Host busy", fix="retry")),
    (exc.SandboxCrashed, _Kind(status=502, title="Sandbox crashed", fix="create a new sandbox")),
    (exc.SandboxGone, _Kind(status=410, title="Sandbox gone", fix="create a new sandbox")),
    (exc.SandboxClosed, _Kind(status=410, title="Sandbox closed", fix="create a new sandbox")),
    (exc.ProtocolError, _Kind(status=502, title="Sandbox spoke nonsense", fix="create a new sandbox")),
    (exc.SnapshotNotFound, _Kind(status=404, title="No such snapshot")),
    # what the store holds under the id was modified, or needs another host: the caller's fix
    (exc.SnapshotCorrupt, _Kind(status=422, title="Snapshot modified: refused", fix="take a new snapshot")),
    (exc.SnapshotIncompatible, _Kind(status=422, title="Snapshot cannot be restored here")),
    (
        exc.SnapshotStoreFull,
        _Kind(status=507, title="Snapshot store full", fix="delete snapshots, or ask for more snapshot room"),
    ),
    # QEMU or runsc failed: the message says how
    (exc.SnapshotError, _Kind(status=500, title="Snapshot not taken, kept or restored")),
    (
        exc.PathEscapeError,
        _Kind(
            status=422,
            title="Path outside the workspace",
            fix="give a path inside the workspace (relative, or under /workspace)",
        ),
    ),
    (exc.SandboxFileNotFound, _Kind(status=404, title="No such file in the sandbox")),
    (exc.FileTypeError, _Kind(status=409, title="Wrong kind of file")),
    (exc.FileTooLarge, _Kind(status=413, title="File too large")),
    (
        exc.ListingTooLarge,
        _Kind(status=413, title="Listing too large", fix="list a folder inside it, or to a smaller depth"),
    ),
    (
        exc.WorkspaceFull,
        _Kind(status=507, title="Workspace full", fix="remove files, or ask for a larger disk_mb"),
    ),
    (exc.WorkspaceError, _Kind(status=422, title="Files call refused")),
    (exc.PolicyDenied, _Kind(status=403, title="Denied by policy")),
    (exc.ModelRateLimited, _Kind(status=429, title="Model provider rate limited")),
    (exc.ModelError, _Kind(status=502, title="Model provider failed")),
    (exc.RunLeased, _Kind(status=409, title="Run is running elsewhere")),
    (exc.RunStoreCorrupt, _Kind(status=500, title="Run store row unreadable")),
    (exc.RunStoreError, _Kind(status=503, title="Store unavailable", fix="retry")),
    (exc.AuditStoreError, _Kind(status=503, title="Store unavailable", fix="retry")),
    (exc.AuditIntegrityError, _Kind(status=500, title="Audit trail broken")),
    (exc.ToolError, _Kind(status=422, title="Tool call failed")),
    (exc.RuntimeLimit, _Kind(status=429, title="Refused by a runtime control")),
    (exc.StockadeError, _Kind(status=500, title="Internal error")),
)

# attributes of the error classes carried into the body (never the stack, never a secret)
_EXTRAS = ("path", "rule", "action", "quota", "limit", "used", "cause", "kind", "id", "request_id",
           "setting", "problems", "provider", "status_code", "name", "key", "tool")  # fmt: skip


def slug(name: str) -> str:
    """``PathEscapeError`` -> ``path-escape``."""
    words = re.sub(r"(?<!^)(?=[A-Z])", "-", name.removesuffix("Error")).lower()
    return words or "error"


def _kind(error: exc.StockadeError) -> _Kind:
    for cls, kind in _KINDS:
        if isinstance(error, cls):
            return kind
    return _KINDS[-1][1]


@dataclass(frozen=True, kw_only=True)
class Problem:
    status: int
    body: dict[str, Any]
    headers: Mapping[str, str]

    def content(self) -> bytes:
        return json.dumps(self.body, ensure_ascii=False, default=str).encode()


def problem_body(
    *, status: int, type_: str, title: str, detail: str, instance: str = "", **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"type": type_, "title": title, "status": status, "detail": detail}
    if instance:
        body["instance"] = instance
    body.update({k: v for k, v in extra.items() if v not in (None, "", (), [])})
    return body


# The longest wait a problem tells: a limit that says more (a window of inf, a nan from a bad
# configuration) made round() raise, and a rate-limited request was answered 500, not 429.
MAX_RETRY_AFTER_S = 366 * 86400.0


def _retry_after(seconds: float | None) -> float | None:
    if seconds is None:
        return None
    if not seconds <= MAX_RETRY_AFTER_S:  # inf and nan too
        return MAX_RETRY_AFTER_S
    return max(seconds, 0.0)


def from_error(error: exc.StockadeError, instance: str = "") -> Problem:
    kind = _kind(error)
    name = type(error).__name__
    extra: dict[str, Any] = {
        "error": name,
        "retryable": error.retryable,
        "retry_after": _retry_after(error.retry_after),
    }
    if isinstance(error, exc.InvalidArgument | exc.LimitNotEnforceable):
        extra["field"] = getattr(error, "argument", "") or getattr(error, "setting", "")
    extra["fix"] = getattr(error, "fix", "") or kind.fix
    for attribute in _EXTRAS:
        value = error.__dict__.get(attribute)
        if isinstance(value, str | int | float | bool | tuple) and value not in ("", ()):
            extra[attribute] = list(value) if isinstance(value, tuple) else value
    headers: dict[str, str] = {}
    if (retry_after := _retry_after(error.retry_after)) is not None:
        headers["Retry-After"] = str(max(1, round(retry_after)))
    if isinstance(error, exc.AuthenticationError):
        headers["WWW-Authenticate"] = 'Bearer realm="stockade"'
    body = problem_body(
        status=kind.status, type_=f"/problems/{slug(name)}", title=kind.title, detail=str(error),
        instance=instance, **extra,
    )  # fmt: skip
    return Problem(status=kind.status, body=body, headers=headers)


def _field(loc: Sequence[object]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def _fix(error: Mapping[str, Any]) -> str:
    kind = str(error.get("type", ""))
    if kind == "extra_forbidden":
        return "remove this field: it is not one the API takes (see /openapi.json)"
    if kind == "missing":
        return "give this field"
    if kind == "json_invalid":
        return "send a valid JSON document"
    if kind == "too_many_values":
        return "send fewer values: large data goes as a file (PUT /v1/sandboxes/{id}/files/content) or stdin"
    if kind == "model_attributes_type":
        return "send a JSON object, with Content-Type: application/json"
    context = error.get("ctx") or {}
    if "expected" in context:
        return f"give {context['expected']}"
    for key, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if key in context:
            return f"give a value {word} {context[key]}"
    return "see the schema in /openapi.json"


def from_validation(errors: Sequence[Mapping[str, Any]], instance: str = "") -> Problem:
    """A request that fails its schema: 400 when the body is not JSON, else 422, each field named,
    the first ``MAX_ERRORS`` of them (the detail counts the rest): 233,000 took ~3 s of the
    event loop and made a 27 MB answer."""
    shown = errors[:MAX_ERRORS]
    items = [
        {
            "field": "body" if e.get("type") == "json_invalid" else _field(e.get("loc", ())),
            "message": str(e.get("msg", "")),
            "fix": _fix(e),
        }
        for e in shown
    ]
    malformed = any(
        e.get("type") == "json_invalid"
        or (e.get("type") == "model_attributes_type" and tuple(e.get("loc", ())) == ("body",))
        for e in shown
    )
    first = items[0] if items else {"field": "body", "message": "invalid", "fix": ""}
    status = 400 if malformed else 422
    body = problem_body(
        status=status,
        type_="/problems/malformed-json" if malformed else "/problems/invalid-request",
        title="Malformed JSON" if malformed else "Invalid request",
        detail=f"{first['field']}: {first['message']}"
        + (f" (and {len(errors) - 1:,} more)" if len(errors) > 1 else ""),
        instance=instance,
        error="InvalidArgument",
        retryable=False,
        field=first["field"],
        fix=first["fix"],
        errors=items,
    )
    return Problem(status=status, body=body, headers={})


def describe(type_slug: str) -> dict[str, Any] | None:
    """What a problem type means: its status, title and the error class's own words."""
    for cls, kind in _KINDS:
        if slug(cls.__name__) == type_slug:
            return {"type": f"/problems/{type_slug}", "title": kind.title, "status": kind.status,
                    "error": cls.__name__, "retryable": cls.retryable,
                    "description": " ".join((cls.__doc__ or "").split())}  # fmt: skip
    return None
