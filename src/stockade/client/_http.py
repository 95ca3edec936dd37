"""The HTTP side of the client: one ``httpx2`` client, and problem documents raised as the
SDK's own errors (a 404 of a file is ``SandboxFileNotFound``, a 422 of a path is
``PathEscapeError``, ...)."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from stockade import exceptions as exc
from stockade._checks import check_timeout
from stockade._gather import Gathered
from stockade.client import _inputs
from stockade.sandbox.ops import ReadFile

try:
    import httpx2 as httpx
except ModuleNotFoundError:  # pragma: no cover - the extra is missing
    httpx = None  # type: ignore[assignment]

__all__ = ["AsyncHttp", "Http", "araise_for_problem", "error_from", "raise_for_problem"]

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
    if status >= 500:
        return exc.ServiceUnavailable
    return exc.ServiceError


def error_from(body: Mapping[str, Any], status: int) -> exc.StockadeError:
    """The SDK error a problem document stands for."""
    cls = _error_class(str(body.get("error", "")), status)
    error = cls.__new__(cls)
    retry_after = body.get("retry_after")
    exc.StockadeError.__init__(
        error, str(body.get("detail") or body.get("title") or f"HTTP {status}"),
        retry_after=float(retry_after) if isinstance(retry_after, int | float) else None,
    )  # fmt: skip
    for attribute in _ATTRIBUTES:
        if attribute in body:
            setattr(error, attribute, body[attribute])
    if "field" in body:
        error.argument = body["field"]  # type: ignore[attr-defined]
    if "problems" in body:
        error.problems = tuple(body["problems"])  # type: ignore[attr-defined]
    error.problem = dict(body)  # type: ignore[attr-defined]
    return error


def _raise_problem(status: int, headers: Mapping[str, str], content: bytes) -> None:
    try:
        body = json.loads(content)
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    if not body.get("retry_after") and headers.get("retry-after", "").isdigit():
        body["retry_after"] = int(headers["retry-after"])
    raise error_from(body, status)


def raise_for_problem(response: httpx.Response) -> None:
    if response.status_code >= 400:
        _raise_problem(response.status_code, response.headers, response.read())


async def araise_for_problem(response: httpx.Response) -> None:
    if response.status_code >= 400:
        _raise_problem(response.status_code, response.headers, await response.aread())


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
    return min(int(declared), ReadFile.max_bytes) if declared.isdigit() else 0


def _unreachable(url: str, error: Exception) -> exc.ServiceUnavailable:
    return exc.ServiceUnavailable(f"the service at {url} cannot be reached: {error}")


class Http:
    """Requests to one service with one token; connection failures are ``ServiceUnavailable``."""

    def __init__(self, url: str | None, token: str | None, *, timeout_s: float | None = 120.0,
                 transport: Any = None) -> None:  # fmt: skip
        self.url, token = _settings(url, token)
        self._client = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"},
            timeout=_timeout(timeout_s), transport=transport,
        )  # fmt: skip

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._client.request(method, path, **_checked(kwargs))
        except httpx.TransportError as error:
            raise _unreachable(self.url, error) from None
        raise_for_problem(response)
        return response

    @contextmanager
    def stream(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx.Response]:
        try:
            with self._client.stream(method, path, **_checked(kwargs)) as response:
                raise_for_problem(response)
                yield response
        except httpx.TransportError as error:
            raise _unreachable(self.url, error) from None

    def content(self, path: str, params: Mapping[str, Any]) -> bytes:
        """A GET's body, gathered into one buffer as it arrives: about its size in memory,
        not twice (a response's ``content`` keeps the pieces, then joins them)."""
        with self.stream("GET", path, params=params) as response:
            gathered = Gathered(_declared(response))
            for piece in response.iter_bytes():
                gathered.add(piece)
        return gathered.take()

    def close(self) -> None:
        self._client.close()


class AsyncHttp:
    """``Http`` on asyncio: the same requests, the same errors, on ``httpx2.AsyncClient``."""

    def __init__(self, url: str | None, token: str | None, *, timeout_s: float | None = 120.0,
                 transport: Any = None) -> None:  # fmt: skip
        self.url, token = _settings(url, token)
        self._client = httpx.AsyncClient(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"},
            timeout=_timeout(timeout_s), transport=transport,
        )  # fmt: skip

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._client.request(method, path, **_checked(kwargs))
        except httpx.TransportError as error:
            raise _unreachable(self.url, error) from None
        await araise_for_problem(response)
        return response

    @asynccontextmanager
    async def stream(self, method: str, path: str, **kwargs: Any) -> AsyncIterator[httpx.Response]:
        try:
            async with self._client.stream(method, path, **_checked(kwargs)) as response:
                await araise_for_problem(response)
                yield response
        except httpx.TransportError as error:
            raise _unreachable(self.url, error) from None

    async def content(self, path: str, params: Mapping[str, Any]) -> bytes:
        """``Http.content``'s twin."""
        async with self.stream("GET", path, params=params) as response:
            gathered = Gathered(_declared(response))
            async for piece in response.aiter_bytes():
                gathered.add(piece)
        return gathered.take()

    async def aclose(self) -> None:
        await self._client.aclose()
