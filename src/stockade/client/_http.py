"""The HTTP side of the client: one ``httpx2`` client, and problem documents raised as the
SDK's own errors (a 404 of a file is ``SandboxFileNotFound``, a 422 of a path is
``PathEscapeError``, ...).

Whatever the service answers, the client's memory and time stay bounded and every failure is
a ``StockadeError``: a problem document is read up to ``PROBLEM_MAX_BYTES``, a JSON answer (and
a line of a stream) up to ``ANSWER_MAX_BYTES`` unless the call knows it may be larger (a
listing, a command's result: ``LIST_MAX_BYTES``, ``sandbox.result_max_bytes``), a file's
content up to ``ReadFile.max_bytes``: what a parsed answer holds in memory is several times
its size (a 256 MiB ``[0,0,...]`` took 1.5 GiB); an answer's head comes by ``timeout_s``, a
non-streamed call ends by it however slowly the body drips, and a bulk body (a file's
content, a download, a run's artifacts: up to gigabytes) must keep coming at ``PACE_BYTES``
per ``timeout_s`` (``ServiceUnavailable``, as an unreachable service); a body that is not what
the call expects (not JSON, a redirect, a field missing) is a ``ServiceError``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

from stockade import exceptions as exc
from stockade._checks import check_timeout
from stockade._gather import Gathered
from stockade.client import _inputs
from stockade.client._deadlines import read_by, reads_by, with_deadlines
from stockade.sandbox.ops import ReadFile
from stockade.sandbox.supervisor.protocol import MAX_LIST_JSON
from stockade.tools.workspace_diff import MAX_DIFF_BYTES

try:
    import httpx2 as httpx
except ModuleNotFoundError:  # pragma: no cover - the extra is missing
    httpx = None  # type: ignore[assignment]

__all__ = [
    "ANSWER_MAX_BYTES", "DIFF_MAX_BYTES", "LIST_MAX_BYTES", "PACE_BYTES", "PROBLEM_MAX_BYTES", "Answer",
    "AsyncHttp", "Http", "Lines", "Pace", "araise_for_problem", "bad_answer", "error_from",
    "malformed_archive", "raise_for_problem",
]  # fmt: skip

PROBLEM_MAX_BYTES = 64 * 1024  # of a problem document: its detail and fields are a few lines
# Of a JSON answer of one thing (a run: its task up to 100,000 characters, a sandbox, an
# entry, a snapshot), an event of a run's stream, a line of a command's output stream.
ANSWER_MAX_BYTES = 8 * 1024 * 1024
# Of a listing: a folder's (the supervisor's listing is at most MAX_LIST_JSON, the service's
# entries about as long again), up to 1,000 runs, a tenant's sandboxes, snapshots, uploads.
LIST_MAX_BYTES = 2 * MAX_LIST_JSON
# Of a run's diff (text, not parsed): at most MAX_DIFF_BYTES, redacted.
DIFF_MAX_BYTES = 4 * MAX_DIFF_BYTES
# What a bulk body must bring per timeout_s: 546 B/s at the default 120 s, so a slow link's
# gigabyte goes on, and a body that drips a byte a second ends within about timeout_s.
PACE_BYTES = 64 * 1024

# attributes a problem carries back into the error object
_ATTRIBUTES = ("path", "rule", "action", "quota", "limit", "used", "cause", "kind", "id", "request_id",
               "setting", "provider", "status_code", "name", "key", "tool", "fix")  # fmt: skip


def _error_class(name: str, status: int) -> type[exc.StockadeError]:
    found = getattr(exc, name, None) if name in exc.__all__ else None
    if isinstance(found, type) and issubclass(found, exc.StockadeError):
        return found
    if status == 401:
        return exc.AuthenticationError
    if status == 404:
        return exc.ResourceNotFound
    if status == 429:
        return exc.RateLimited
    if status >= 500:
        return exc.ServiceUnavailable
    return exc.ServiceError


def _seconds(value: object) -> float | None:
    """A ``retry_after`` the service sent, or None when it is no number of seconds a caller
    can wait (a 5,000-digit one, ``1e400``, negative)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        seconds = float(value)
    except (ValueError, OverflowError):
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def error_from(body: Mapping[str, Any], status: int) -> exc.StockadeError:
    """The SDK error a problem document stands for."""
    cls = _error_class(str(body.get("error", "")), status)
    error = cls.__new__(cls)
    exc.StockadeError.__init__(
        error, str(body.get("detail") or body.get("title") or f"HTTP {status}"),
        retry_after=_seconds(body.get("retry_after")),
    )  # fmt: skip
    for attribute in _ATTRIBUTES:
        if attribute in body:
            setattr(error, attribute, body[attribute])
    if "field" in body:
        error.argument = body["field"]  # type: ignore[attr-defined]
    if isinstance(body.get("problems"), list):
        error.problems = tuple(body["problems"])  # type: ignore[attr-defined]
    error.problem = dict(body)  # type: ignore[attr-defined]
    return error


def bad_answer(url: str, why: str) -> exc.ServiceError:
    """An answer the client cannot use: not retryable, as the same request gets the same."""
    return exc.ServiceError(f"the service at {url} sent an answer the client cannot use: {why}")


def _problem(url: str, status: int, headers: Mapping[str, str], content: bytes) -> exc.StockadeError:
    if status < 400:  # a redirect: not followed, the token goes to this service only
        where = headers.get("location", "")[:200]
        return bad_answer(url, f"HTTP {status} to {where!r} (the client follows no redirect)")
    try:
        body = json.loads(content)
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    if not body.get("retry_after"):
        waited = headers.get("retry-after", "")
        body["retry_after"] = int(waited) if waited.isdigit() and len(waited) <= 12 else None
    return error_from(body, status)


def raise_for_problem(response: httpx.Response, url: str = "") -> None:
    if response.status_code >= 300:
        body = _Body(url, PROBLEM_MAX_BYTES, cut=True)
        for piece in response.iter_bytes():
            if body.add(piece):
                break
        raise _problem(url, response.status_code, response.headers, body.take())


async def araise_for_problem(response: httpx.Response, url: str = "") -> None:
    if response.status_code >= 300:
        body = _Body(url, PROBLEM_MAX_BYTES, cut=True)
        async for piece in response.aiter_bytes():
            if body.add(piece):
                break
        raise _problem(url, response.status_code, response.headers, body.take())


def malformed_archive(url: str, error: exc.ProtocolError) -> exc.ServiceError:
    """An archive the service made (a run's artifacts) that does not unpack: the service's
    answer, not a sandbox's."""
    return bad_answer(url, f"a malformed archive: {error.why or error}")


def _late(url: str, timeout_s: float | None) -> exc.ServiceUnavailable:
    return exc.ServiceUnavailable(f"the service at {url} did not answer within {timeout_s} s (timeout_s)")


def _slow(url: str, timeout_s: float | None) -> exc.ServiceUnavailable:
    return exc.ServiceUnavailable(
        f"the service at {url} sent less than {PACE_BYTES:,} bytes in {timeout_s} s (a body must keep "
        f"coming at {PACE_BYTES:,} bytes per timeout_s)"
    )


class Pace:
    """Whether a bulk body keeps coming: each ``PACE_BYTES`` of it within ``timeout_s`` of the
    ones before (checked as each piece comes; httpx's read timeout bounds the wait for one).
    A large body on a slow link goes on; one that drips ends."""

    def __init__(self, url: str, timeout_s: float | None) -> None:
        self.url, self.timeout_s = url, timeout_s
        self._deadline = _deadline(timeout_s)
        self._come = 0

    def check(self, piece: bytes) -> bytes:
        if self._deadline is None or self.timeout_s is None:
            return piece
        now = time.monotonic()
        if now > self._deadline:
            raise _slow(self.url, self.timeout_s)
        self._come += len(piece)
        if self._come >= PACE_BYTES:
            self._come %= PACE_BYTES
            self._deadline = now + self.timeout_s
        return piece


class _Body:
    """A body gathered as it arrives, up to ``limit`` bytes and by ``deadline`` (monotonic):
    over the limit it is ``cut`` (a problem document: what came is enough to name the error)
    or refused; past the deadline, refused. httpx's read timeout is per piece: a body that
    drips a byte a second never trips it."""

    def __init__(self, url: str, limit: int, *, cut: bool = False, deadline: float | None = None,
                 timeout_s: float | None = None, declared: int = 0) -> None:  # fmt: skip
        self.url, self.limit, self.cut = url, limit, cut
        self.deadline, self.timeout_s = deadline, timeout_s
        self._gathered = Gathered(min(declared, limit))

    def add(self, piece: bytes) -> bool:
        """Whether the body is full (cut at its limit)."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise _late(self.url, self.timeout_s)
        room = self.limit - self._gathered.size
        if len(piece) > room:
            if not self.cut:
                raise bad_answer(self.url, f"a body over {self.limit:,} bytes")
            self._gathered.add(piece[:room])
            return True
        self._gathered.add(piece)
        return False

    def take(self) -> bytes:
        return self._gathered.take()


@dataclass(frozen=True)
class Answer:
    """A whole answer, read within the call's limits."""

    url: str
    status_code: int
    headers: Any  # httpx2.Headers: looked up without regard to case
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        try:
            return json.loads(self.content)
        except ValueError as error:
            raise bad_answer(self.url, f"a body that is not JSON ({error})") from None


class Lines:
    """A stream's lines (``\n`` or ``\r\n`` ended), each at most ``limit`` bytes: a line
    that never ends is refused at the limit, not gathered until memory runs out."""

    def __init__(self, url: str, limit: int = ANSWER_MAX_BYTES) -> None:
        self.url, self.limit = url, limit
        self._pending = bytearray()

    def feed(self, piece: bytes) -> list[str]:
        start = len(self._pending)
        self._pending += piece
        lines: list[str] = []
        begin = 0
        while (end := self._pending.find(b"\n", start)) >= 0:
            lines.append(self._pending[begin:end].rstrip(b"\r").decode("utf-8", "replace"))
            begin = start = end + 1
        del self._pending[:begin]
        if len(self._pending) > self.limit:
            raise bad_answer(self.url, f"a line of a stream over {self.limit:,} bytes")
        return lines

    def end(self) -> list[str]:
        rest, self._pending = bytes(self._pending), bytearray()
        return [rest.rstrip(b"\r").decode("utf-8", "replace")] if rest else []


def _settings(url: str | None, token: str | None) -> tuple[str, str]:
    """The service's URL and the token, from the arguments or the environment, checked: a
    mistake in either is ``InvalidArgument`` here, not an unreachable service (retryable)
    on the first request."""
    if httpx is None:
        raise exc.ConfigurationError('the client needs httpx2: pip install "stockade[server]"')
    url_from, token_from = ("url", "token")
    if not url:
        url, url_from = os.environ.get("STOCKADE_URL"), "url (STOCKADE_URL)"
    if not token:
        token, token_from = os.environ.get("STOCKADE_TOKEN"), "token (STOCKADE_TOKEN)"
    if not url:
        raise exc.InvalidArgument(
            "no service URL",
            argument="url",
            fix="pass url=... or set STOCKADE_URL (e.g. http://127.0.0.1:8080)",
        )
    if not token:
        raise exc.InvalidArgument(
            "no API token",
            argument="token",
            fix="pass token=... or set STOCKADE_TOKEN (stockade token new)",
        )
    return _inputs.service_url(url, url_from), _inputs.token(token, token_from)


def _checked(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A request's arguments, once its JSON body and query can be sent (``_inputs.sendable``);
    a field is named as the argument it came from (the bodies' fields are the calls' names)."""
    for key in ("json", "params"):
        value = kwargs.get(key)
        if isinstance(value, Mapping):
            for field, item in value.items():
                _inputs.sendable(item, str(field))
        else:
            _inputs.sendable(value, key)
    return kwargs


def _timeout(timeout_s: float | None) -> Any:
    return httpx.Timeout(check_timeout(timeout_s), connect=10.0)


def _declared(response: httpx.Response) -> int:
    """The size a body says it has, up to a file's cap (what a read returns at most): what
    is set aside for it up front (``Gathered``)."""
    declared = response.headers.get("content-length", "")
    return min(int(declared), ReadFile.max_bytes) if declared.isdigit() and len(declared) <= 12 else 0


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def _headers(token: str) -> dict[str, str]:
    # identity: a compressed answer would be inflated by httpx before any of our caps sees it
    return {"Authorization": f"Bearer {token}", "Accept-Encoding": "identity"}


def _unreachable(url: str, error: Exception) -> exc.ServiceUnavailable:
    return exc.ServiceUnavailable(f"the service at {url} cannot be reached: {error}")


class Http:
    """Requests to one service with one token; connection failures are ``ServiceUnavailable``.
    An answer's head comes by ``timeout_s`` (with a ``transport`` of the caller's that is no
    ``httpx2.HTTPTransport``, by httpx's per-read timeout alone)."""

    def __init__(self, url: str | None, token: str | None, *, timeout_s: float | None = 120.0,
                 transport: Any = None) -> None:  # fmt: skip
        self.url, token = _settings(url, token)
        self.timeout_s = check_timeout(timeout_s)
        self._client = with_deadlines(httpx.Client(
            base_url=self.url, headers=_headers(token), timeout=_timeout(timeout_s), transport=transport,
        ))  # fmt: skip

    def request(self, method: str, path: str, *, limit: int = ANSWER_MAX_BYTES, **kwargs: Any) -> Answer:
        """One call, its answer read whole: at most ``limit`` bytes, by ``timeout_s``."""
        deadline = _deadline(self.timeout_s)
        with reads_by(deadline), self.stream(method, path, **kwargs) as response:
            body = _Body(self.url, limit, deadline=deadline, timeout_s=self.timeout_s,
                         declared=_declared(response))  # fmt: skip
            for piece in response.iter_bytes():
                body.add(piece)
        return Answer(self.url, response.status_code, response.headers, body.take())

    @contextmanager
    def stream(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx.Response]:
        """A call whose body is read as it comes: its head (and a problem's body) by
        ``timeout_s``, or the call's ``timeout`` (None: an event stream's, that waits)."""
        head_s = kwargs.get("timeout", self.timeout_s)
        outer = read_by()  # a whole answer's (``request``): the head's too
        deadline = _deadline(head_s) if outer is None else outer
        heading = True
        try:
            with ExitStack() as stack:
                with reads_by(deadline):
                    response = stack.enter_context(self._client.stream(method, path, **_checked(kwargs)))
                    raise_for_problem(response, self.url)
                heading = False
                yield response
        except httpx.TransportError as error:
            if (heading or outer is not None) and deadline is not None and time.monotonic() >= deadline:
                raise _late(self.url, head_s if outer is None else self.timeout_s) from None
            raise _unreachable(self.url, error) from None

    def lines(self, response: httpx.Response, limit: int = ANSWER_MAX_BYTES) -> Iterator[str]:
        """A streamed answer's lines, each at most ``limit`` bytes."""
        lines = Lines(self.url, limit)
        for piece in response.iter_bytes():
            yield from lines.feed(piece)
        yield from lines.end()

    def bulk(self, response: httpx.Response) -> Iterator[bytes]:
        """A bulk body's pieces (a file's content, a download, artifacts), at ``Pace``."""
        pace = Pace(self.url, self.timeout_s)
        for piece in response.iter_bytes():
            yield pace.check(piece)

    def content(self, path: str, params: Mapping[str, Any]) -> bytes:
        """A GET's body, gathered into one buffer as it arrives: about its size in memory,
        not twice (a response's ``content`` keeps the pieces, then joins them); at most a
        file read's cap (``ReadFile.max_bytes``), as the local SDK's; at ``Pace``."""
        with self.stream("GET", path, params=params) as response:
            body = _Body(self.url, ReadFile.max_bytes, declared=_declared(response))
            for piece in self.bulk(response):
                body.add(piece)
        return body.take()

    def close(self) -> None:
        self._client.close()


class AsyncHttp:
    """``Http`` on asyncio: the same requests, the same errors, on ``httpx2.AsyncClient``."""

    def __init__(self, url: str | None, token: str | None, *, timeout_s: float | None = 120.0,
                 transport: Any = None) -> None:  # fmt: skip
        self.url, token = _settings(url, token)
        self.timeout_s = check_timeout(timeout_s)
        self._client = httpx.AsyncClient(
            base_url=self.url, headers=_headers(token), timeout=_timeout(timeout_s), transport=transport,
        )  # fmt: skip

    async def request(
        self, method: str, path: str, *, limit: int = ANSWER_MAX_BYTES, **kwargs: Any
    ) -> Answer:
        """``Http.request``'s twin."""
        deadline = _deadline(self.timeout_s)
        # on asyncio the deadline holds for the head too (a head that drips is cut at it)
        timer = asyncio.timeout(self.timeout_s)
        try:
            async with timer, self.stream(method, path, **kwargs) as response:
                body = _Body(self.url, limit, deadline=deadline, timeout_s=self.timeout_s,
                             declared=_declared(response))  # fmt: skip
                async for piece in response.aiter_bytes():
                    body.add(piece)
        except TimeoutError:
            if not timer.expired():
                raise
            raise _late(self.url, self.timeout_s) from None
        return Answer(self.url, response.status_code, response.headers, body.take())

    @asynccontextmanager
    async def stream(self, method: str, path: str, **kwargs: Any) -> AsyncIterator[httpx.Response]:
        """``Http.stream``'s twin: the head (and a problem's body) by ``timeout_s``, or the
        call's ``timeout``."""
        head_s = kwargs.get("timeout", self.timeout_s)
        timer = asyncio.timeout(head_s)
        try:
            async with AsyncExitStack() as stack:
                async with timer:
                    response = await stack.enter_async_context(
                        self._client.stream(method, path, **_checked(kwargs))
                    )
                    await araise_for_problem(response, self.url)
                yield response
        except TimeoutError:
            if not timer.expired():
                raise
            raise _late(self.url, head_s) from None
        except httpx.TransportError as error:
            raise _unreachable(self.url, error) from None

    async def lines(self, response: httpx.Response, limit: int = ANSWER_MAX_BYTES) -> AsyncIterator[str]:
        """``Http.lines``'s twin."""
        lines = Lines(self.url, limit)
        async for piece in response.aiter_bytes():
            for line in lines.feed(piece):
                yield line
        for line in lines.end():
            yield line

    async def bulk(self, response: httpx.Response) -> AsyncIterator[bytes]:
        """``Http.bulk``'s twin."""
        pace = Pace(self.url, self.timeout_s)
        async for piece in response.aiter_bytes():
            yield pace.check(piece)

    async def content(self, path: str, params: Mapping[str, Any]) -> bytes:
        """``Http.content``'s twin."""
        async with self.stream("GET", path, params=params) as response:
            body = _Body(self.url, ReadFile.max_bytes, declared=_declared(response))
            async for piece in self.bulk(response):
                body.add(piece)
        return body.take()

    async def aclose(self) -> None:
        await self._client.aclose()
