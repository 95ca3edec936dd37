"""Connections from one sandbox's proxy to its servers, kept open between its requests.

Most clients in a sandbox (urllib, pip's per-request sessions, curl) open a connection per
request; the proxy need not. After a response has ended cleanly, its connection to the
server waits here, under the key it was made for, and the sandbox's next request to the
same place takes it instead of connecting again (the connect, the server's accept and the
close cost more of the proxy's time per request than the request's own parsing).

What keeps this from widening anything:

* A pool belongs to one ``EgressProxy``, that is one sandbox: no connection is ever
  shared between sandboxes.
* A request is judged in full before it takes a connection (name, port, method, every
  resolved address); the key is the address that check chose, the port, the scheme, the
  name the TLS was verified for and the credential added, so a connection carries only
  requests that would have been sent on a new one to the same place, with the same
  credential (a server that ties authentication to a connection sees no other).
* Only a response that ended cleanly on both sides (h11 ``DONE``, the server did not ask
  to close) gives its connection back; anything else closes it.
* A kept connection waits at most ``IDLE_S`` (servers often close theirs after 5 s), at
  most ``PER_KEY`` per key and ``MAX_IDLE`` per sandbox; ``close`` (the sandbox's end)
  closes them all at once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["IDLE_S", "MAX_IDLE", "PER_KEY", "Pool", "UpstreamKey"]

IDLE_S = 4.0  # below the 5 s after which many servers close an idle connection
PER_KEY = 4
MAX_IDLE = 16


class Closable(Protocol):
    def close(self) -> None: ...
    def alive(self) -> bool: ...


S = TypeVar("S", bound=Closable)


@dataclass(frozen=True, kw_only=True)
class UpstreamKey:
    """Where a kept connection goes, and as what (see the module's docstring)."""

    address: str
    port: int
    scheme: str
    host: str
    credential: str


class _Kept(Generic[S]):
    __slots__ = ("conn", "expiry", "stream")

    def __init__(self, stream: S, conn: Any, expiry: asyncio.TimerHandle) -> None:
        self.stream = stream
        self.conn = conn
        self.expiry = expiry


class Pool(Generic[S]):
    """Idle upstream connections of one proxy, by ``UpstreamKey``; on its event loop only."""

    def __init__(self, *, idle_s: float = IDLE_S, per_key: int = PER_KEY, max_idle: int = MAX_IDLE) -> None:
        self.idle_s = idle_s
        self.per_key = per_key
        self.max_idle = max_idle
        self._idle: dict[UpstreamKey, list[_Kept[S]]] = {}
        self._count = 0
        self._closed = False

    def __len__(self) -> int:
        return self._count

    def take(self, key: UpstreamKey) -> tuple[S, Any] | None:
        """The most recently used live connection for ``key`` (stream, h11 connection)."""
        kept = self._idle.get(key)
        while kept:
            item = kept.pop()
            self._count -= 1
            item.expiry.cancel()
            if item.stream.alive():
                if not kept:
                    del self._idle[key]
                return item.stream, item.conn
            item.stream.close()
        self._idle.pop(key, None)
        return None

    def give(self, key: UpstreamKey, stream: S, conn: Any) -> None:
        """Keep ``stream`` for ``key`` (its h11 ``conn`` ready for a new cycle), or close it."""
        kept = self._idle.setdefault(key, [])
        if self._closed or len(kept) >= self.per_key or self._count >= self.max_idle or not stream.alive():
            if not kept:
                del self._idle[key]
            stream.close()
            return
        expiry = asyncio.get_running_loop().call_later(self.idle_s, self._expire, key, stream)
        kept.append(_Kept(stream, conn, expiry))
        self._count += 1

    def _expire(self, key: UpstreamKey, stream: S) -> None:
        kept = self._idle.get(key, [])
        for item in kept:
            if item.stream is stream:
                kept.remove(item)
                self._count -= 1
                break
        if not kept:
            self._idle.pop(key, None)
        stream.close()

    def close(self) -> None:
        """Close every kept connection; nothing is kept after this."""
        self._closed = True
        self.drop()

    def drop(self) -> None:
        """Close every kept connection (the sandbox's next user starts with none)."""
        for kept in self._idle.values():
            for item in kept:
                item.expiry.cancel()
                item.stream.close()
        self._idle.clear()
        self._count = 0
