"""What the API process holds for a tenant's transfers in flight: at most its ``bodies_mb``.

A request's body is held from its first byte to the end of its request (a file's content is
written to the sandbox whole), and a response's body from when it is made until its client
has read it (a file's content in memory, a packed folder in a temporary file, a command's
result): a client that sends slowly, or reads nothing, keeps them for as long as its
connection lasts. Twenty uploads trickled at the slowest rate the service takes held 1.4 GB
for 17 minutes; ten reads of a 60 MB file whose clients read nothing held 600 MB, and eight
unread folder downloads 458 MiB of deleted temporary files, until their clients closed. Each
is counted here against its tenant's share, in this process: a request's body as it arrives
(``RequestGuard``), a response's when it is made (``HeldResponse``), and an upload's unpacked
files at the most they may take while they are unpacked. What would pass the share is refused
(``QuotaExceeded``, 429, ``quota = "bodies_mb"``); the other tenants' shares are their own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from starlette.responses import ContentStream, StreamingResponse
from starlette.types import Receive, Scope, Send

from stockade import exceptions as exc
from stockade.types import MiB

if TYPE_CHECKING:
    from fastapi import Request

    from stockade.server.tenants import Principal, Tenant

__all__ = ["CHUNK", "HeldBytes", "HeldResponse", "Hold", "held_bytes", "pieces", "unpacking"]

CHUNK = 256 * 1024  # a response's body is sent in pieces this big


class Hold:
    """``size`` bytes of a tenant's share, given back once (however often ``release`` is called)."""

    def __init__(self, held: HeldBytes, tenant: Tenant, size: int) -> None:
        self._held = held
        self._tenant = tenant
        self.size = size
        self._lock = threading.Lock()

    def resize(self, size: int, *, what: str) -> None:
        """Hold ``size`` bytes instead: more taken (``QuotaExceeded`` past the share, the hold
        as it was), the rest given back."""
        with self._lock:
            more = size - self.size
            if more > 0:
                self._held.take(self._tenant, more, what=what)
            elif more < 0:
                self._held.give_back(self._tenant, -more)
            self.size = size

    def release(self) -> None:
        with self._lock:
            size, self.size = self.size, 0
        if size:
            self._held.give_back(self._tenant, size)


class HeldBytes:
    """Each tenant's bytes held at once in this process, at most its ``bodies_mb``."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, tenant: Tenant, size: int, *, what: str = "request bodies") -> None:
        """Count ``size`` more bytes of ``tenant``'s, or ``QuotaExceeded`` when they would
        pass its share (nothing is counted then)."""
        cap = tenant.quotas.bodies_mb * MiB
        with self._lock:
            held = self._held.get(tenant.id, 0)
            if held + size <= cap:
                self._held[tenant.id] = held + size
                return
        why = (
            f"{size:,} bytes of {what} are over tenant {tenant.id!r}'s bodies_mb "
            f"({tenant.quotas.bodies_mb:,} MiB) alone: move less at once"
            if size > cap
            else f"tenant {tenant.id!r} has {held:,} bytes of requests and responses in this server's "
            f"memory: {size:,} more of {what} would pass its bodies_mb ({tenant.quotas.bodies_mb:,} MiB); "
            "ask again once one of its transfers has ended (a response counts until its client has read it)"
        )
        raise exc.QuotaExceeded(why, quota="bodies_mb", limit=float(cap), used=float(held))

    def give_back(self, tenant: Tenant, size: int) -> None:
        with self._lock:
            left = self._held.get(tenant.id, 0) - size
            if left > 0:
                self._held[tenant.id] = left
            else:
                self._held.pop(tenant.id, None)

    def hold(self, tenant: Tenant, size: int, *, what: str) -> Hold:
        """``take``, as a ``Hold`` to release."""
        self.take(tenant, size, what=what)
        return Hold(self, tenant, size)

    def hold_up_to(self, tenant: Tenant, most: int, *, what: str) -> Hold:
        """As much of ``most`` as the tenant's share has left, held (what an upload's unpacked
        files may then take); ``QuotaExceeded`` when nothing is left."""
        with self._lock:
            left = tenant.quotas.bodies_mb * MiB - self._held.get(tenant.id, 0)
            size = min(most, left)
            if size > 0:
                self._held[tenant.id] = self._held.get(tenant.id, 0) + size
                return Hold(self, tenant, size)
        return self.hold(tenant, most, what=what)  # refused (saying why), unless freed meanwhile


def held_bytes(request: Request) -> HeldBytes:
    """The process's count (``create_app`` keeps it on the app's state)."""
    held: HeldBytes = request.app.state.held_bytes
    return held


@contextlib.contextmanager
def unpacking(request: Request, caller: Principal, most: int) -> Iterator[int]:
    """Room for an upload's unpacked files (up to ``most``, the upload cap), held while they
    are: a 9 KB ``.tar.xz`` unpacks into 60 MB, so the body the guard counted says nothing of
    what its unpacking takes (forty at once took 1.6 GiB of disk and 2.4 GB of memory)."""
    hold = held_bytes(request).hold_up_to(caller.tenant, most, what="an upload's unpacked files")
    try:
        yield hold.size
    finally:
        hold.release()


async def pieces(data: bytes) -> AsyncIterator[memoryview]:
    """``data`` in views of ``CHUNK``: sent whole, it would be copied whole once more as the
    server frames it, and again into the socket's buffer for what the socket did not take at
    once; in pieces, each is copied alone, once the one before is on its way."""
    with memoryview(data) as view:
        for start in range(0, len(view), CHUNK):
            yield view[start : start + CHUNK]


class Releasable(Protocol):
    def release(self) -> None: ...


class HeldResponse(StreamingResponse):
    """A response that holds ``hold`` (its bytes' count against its tenant's share, an event
    stream's slot) for as long as it is served: released when its body ends, when its client
    goes (Starlette's disconnect, or a send that fails), or when the server cancels it."""

    def __init__(
        self,
        content: ContentStream,
        *,
        hold: Releasable,
        media_type: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self.hold = hold

    @classmethod
    def of(cls, data: bytes, *, hold: Releasable, media_type: str) -> HeldResponse:
        """``data`` whole, sent in pieces (``pieces``) with its length."""
        return cls(pieces(data), hold=hold, media_type=media_type, headers={"Content-Length": str(len(data))})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.hold.release()
