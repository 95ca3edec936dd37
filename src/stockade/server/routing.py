"""Several API processes: a request for a sandbox reaches the process that holds it.

A sandbox lives in the process that made it (its supervisor's stream is there). Each process
has a row in the database (``svc_nodes``: its address, a key of its own, a heartbeat), and so
has each sandbox (``svc_sandboxes``: its owner). ``SandboxRouting`` sits in front of the
routes: a request for ``/v1/sandboxes/{id}...`` that this process does not hold is
authenticated, looked up, and

* forwarded to the owner when it is alive: the request's body streamed up as it arrives, the
  answer (an NDJSON command stream, a tar) streamed back as it comes, status and headers
  kept. The hop carries the owner's key (``x-stockade-hop``), so the owner does not count the
  request against the tenant's rate limit again, and never forwards it further;
* answered ``SandboxGone`` (410) when the owner is dead (no heartbeat for ``DEAD_AFTER_S``,
  or, on this machine, its pid gone): the owner is buried first, which frees the quota of
  every sandbox it held;
* left to the routes otherwise: another tenant's sandbox, or none, is 404 there, alike.

Why forwarding, not a shared sandbox: a sandbox is a live process tree with a byte stream to
its supervisor; moving it would be a migration. The owner's address costs one indexed query
per request that lands elsewhere, and a load balancer with sticky sessions by sandbox id
makes even that rare.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

import anyio

from stockade import exceptions as exc
from stockade.server import problems
from stockade.server.deps import HOP_HEADER
from stockade.server.schemas import SandboxOut
from stockade.server.state.rows import Node
from stockade.server.tenants import Principal

if TYPE_CHECKING:
    import httpx2
    from fastapi import Request

    from stockade.server.service import Service

__all__ = ["HOP_HEADER", "Peers", "SandboxRouting", "peers_of"]

log = logging.getLogger("stockade.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_SANDBOX = re.compile(r"^/v1/sandboxes/([A-Za-z0-9_-]{1,100})(?:/|$)")
# headers of one connection, not of the request: never passed on (RFC 9110, 7.6.1)
_HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
     b"transfer-encoding", b"upgrade", b"host", HOP_HEADER.encode()}
)  # fmt: skip


# and what this process says of itself
_NOT_PASSED_BACK = _HOP_BY_HOP | {b"date", b"server"}


class _ClientLeft(Exception):
    """The client went away while its request's body was being forwarded."""


class Peers:
    """One HTTP client to the other API processes (made on first use, closed with the app)."""

    def __init__(self) -> None:
        self._client: httpx2.AsyncClient | None = None

    @property
    def client(self) -> httpx2.AsyncClient:
        if self._client is None:
            import httpx2

            self._client = httpx2.AsyncClient(
                # a command streams as long as it runs: no read timeout; a peer that does not
                # answer the connection within seconds is down
                timeout=httpx2.Timeout(None, connect=5.0),
                limits=httpx2.Limits(max_connections=None, max_keepalive_connections=64),
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


async def _respond(send: Send, error: exc.StockadeError, path: str) -> None:
    problem = problems.from_error(error, path)
    headers = [(b"content-type", b"application/problem+json")]
    headers += [(k.lower().encode(), v.encode()) for k, v in problem.headers.items()]
    await send({"type": "http.response.start", "status": problem.status, "headers": headers})
    await send({"type": "http.response.body", "body": problem.content(), "more_body": False})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


class SandboxRouting:
    """ASGI middleware: requests for sandboxes held by another API process go there."""

    def __init__(self, app: ASGIApp, service: Service, peers: Peers) -> None:
        self.app = app
        self.service = service
        self.peers = peers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _SANDBOX.match(scope.get("path", "")) if scope["type"] == "http" else None
        registry = self.service.sandboxes
        if match is None or registry.holds(match.group(1)) or _header(scope, HOP_HEADER.encode()) is not None:
            await self.app(scope, receive, send)
            return
        sandbox_id = match.group(1)
        principal = self._principal(scope)
        if principal is None:  # no token, or a wrong one: the routes say so, the usual way
            await self.app(scope, receive, send)
            return
        placement = await anyio.to_thread.run_sync(registry.locate, sandbox_id)
        if placement is None or placement.tenant != principal.tenant.id:
            await self.app(scope, receive, send)  # not found, or not yours: 404 there, alike
            return
        try:
            self.service.limits.admit(principal)
        except exc.StockadeError as error:
            await _respond(send, error, scope["path"])
            return
        node = placement.node
        if placement.ended == "lost" or not registry.alive(placement.owner, node):
            await anyio.to_thread.run_sync(registry.sweep)
            await _respond(send, _gone(sandbox_id), scope["path"])
            return
        assert node is not None
        await self._forward(scope, receive, send, node, sandbox_id)

    def _principal(self, scope: Scope) -> Principal | None:
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        try:
            return self.service.tenants.authenticate(token.strip())
        except exc.AuthenticationError:
            return None

    async def _forward(self, scope: Scope, receive: Receive, send: Send, node: Node, sandbox_id: str) -> None:
        import httpx2

        if not node.url:
            await _respond(send, exc.ServiceUnavailable(
                "the API process that holds this sandbox has no address its peers can reach: start "
                "it with --advertise-url"), scope["path"])  # fmt: skip
            return
        request, body_read = _upstream(self.peers.client, scope, receive, node)
        failed: httpx2.TransportError | None = None
        async with anyio.create_task_group() as group:

            async def watch() -> None:
                # once the body is read, the next message is the client leaving: stop the hop,
                # which the owner sees as its client leaving too
                await body_read.wait()
                while (await receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                response = await self.peers.client.send(request, stream=True)
            except _ClientLeft:
                group.cancel_scope.cancel()
                return
            except httpx2.TransportError as error:
                failed = error
                group.cancel_scope.cancel()
            else:
                try:
                    await _pass_back(send, response)
                except httpx2.TransportError as error:  # the owner died mid-answer: the answer is cut
                    log.warning("forwarding %s to %s was cut: %s", scope["path"], node.url, error)
                finally:
                    await response.aclose()
                    group.cancel_scope.cancel()
        if failed is not None:  # answered out here: the group's scope is cancelled
            await self._unreachable(send, scope, node, sandbox_id, failed)

    async def _unreachable(
        self, send: Send, scope: Scope, node: Node, sandbox_id: str, error: Exception
    ) -> None:
        registry = self.service.sandboxes
        await anyio.to_thread.run_sync(registry.sweep)  # a dead owner on this machine is seen at once
        placement = await anyio.to_thread.run_sync(registry.locate, sandbox_id)
        if placement is None or placement.ended == "lost":
            await _respond(send, _gone(sandbox_id), scope["path"])
            return
        log.warning("the API process at %s does not answer: %s", node.url, error)
        await _respond(send, exc.ServiceUnavailable(
            "the API process that holds this sandbox does not answer; if it died, its sandboxes are "
            "declared gone within seconds", retry_after=2.0), scope["path"])  # fmt: skip


def _upstream(
    client: httpx2.AsyncClient, scope: Scope, receive: Receive, node: Node
) -> tuple[httpx2.Request, anyio.Event]:
    """The request to send the owner, its body read from ``receive`` as it goes up; and the
    event set once the whole body is read."""
    body_read = anyio.Event()

    async def body() -> AsyncIterator[bytes]:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientLeft
            yield bytes(message.get("body", b""))
            if not message.get("more_body", False):
                body_read.set()
                return

    has_body = (
        _header(scope, b"transfer-encoding") is not None or (_header(scope, b"content-length") or "0") != "0"
    )
    if not has_body:
        body_read.set()
    headers = [(k, v) for k, v in scope["headers"] if bytes(k).lower() not in _HOP_BY_HOP]
    headers.append((HOP_HEADER.encode(), node.hop_key.encode()))
    url = node.url + scope.get("raw_path", scope["path"].encode()).decode("latin-1")
    query = bytes(scope.get("query_string", b""))
    if query:
        url += "?" + query.decode("latin-1")
    request = client.build_request(
        scope["method"], url, headers=headers, content=body() if has_body else None
    )
    return request, body_read


async def _pass_back(send: Send, response: httpx2.Response) -> None:
    """The owner's answer, streamed back as it comes: status, headers, body."""
    passed = [(k, v) for k, v in response.headers.raw if k.lower() not in _NOT_PASSED_BACK]
    await send({"type": "http.response.start", "status": response.status_code, "headers": passed})
    async for chunk in response.aiter_raw():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _gone(sandbox_id: str) -> exc.SandboxGone:
    return exc.SandboxGone(
        f"sandbox {sandbox_id} was lost with the API process that held it (that process died); its "
        "quota is free: create a new sandbox",
        id=sandbox_id,
    )


async def peers_of(request: Request, caller: Principal) -> list[SandboxOut]:
    """The caller's sandboxes held by the other live API processes (each asked for its own)."""
    service: Service = request.app.state.service
    peers: Peers = request.app.state.peers
    nodes = await anyio.to_thread.run_sync(service.sandboxes.peers_of, caller)
    found: list[SandboxOut] = []
    for node in nodes:
        if not node.url:
            continue
        try:
            response = await peers.client.get(
                node.url + "/v1/sandboxes",
                headers={"authorization": request.headers.get("authorization", ""), HOP_HEADER: node.hop_key},
            )
        except Exception as error:  # a peer that just died: its sandboxes are gone anyway
            log.warning("listing sandboxes at %s failed: %s", node.url, error)
            continue
        if response.status_code == 200:
            found += [SandboxOut.model_validate(item) for item in json.loads(response.content)]
    return found
