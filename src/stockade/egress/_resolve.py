"""How a sandbox's proxy finds the addresses of a name: the host's resolver, or a pinned answer.

The proxy resolves each name itself, once per request, and checks every answer before it
connects to one of them (``_gate.Gate.address``); the sandbox has no DNS of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from stockade.egress._rules import ip_literal

__all__ = ["RESOLVE_CACHE_SIZE", "RESOLVE_TTL_S", "Resolver", "SystemResolver"]

RESOLVE_TTL_S = 15.0  # below most records' own TTL; getaddrinfo does not say theirs
RESOLVE_CACHE_SIZE = 1024  # names per sandbox


class Resolver(Protocol):
    async def resolve(self, host: str, port: int) -> list[str]:
        """The addresses of ``host`` (empty when it has none)."""
        ...


class SystemResolver:
    """The host's resolver, with ``pinned`` names answered first (``NetworkPolicy.resolve``).

    Answers are kept ``ttl_s`` (a burst of requests to one host, as ``pip install`` makes,
    asks the host's resolver once: its ``getaddrinfo`` runs in a thread, and a host without a
    caching resolver sends a query each time). Safe against rebinding: the proxy checks every
    answer each time, cached or not, and connects to an address it checked; a cache only
    keeps the answers the same for a while. Failures are not kept."""

    def __init__(
        self,
        pinned: Mapping[str, Sequence[str]] | None = None,
        *,
        ttl_s: float = RESOLVE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pinned = {k.lower().rstrip("."): list(v) for k, v in (pinned or {}).items()}
        self.ttl_s = ttl_s
        self.clock = clock
        self._cache: dict[tuple[str, int], tuple[float, list[str]]] = {}

    async def resolve(self, host: str, port: int) -> list[str]:
        if host in self.pinned:
            return list(self.pinned[host])
        if ip_literal(host) is not None:
            return [host]
        now = self.clock()
        kept = self._cache.get((host, port))
        if kept is not None and kept[0] > now:
            return list(kept[1])
        found = await self.lookup(host, port)
        if found and self.ttl_s > 0:
            if len(self._cache) >= RESOLVE_CACHE_SIZE:  # bounded: the expired go, else all
                self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                if len(self._cache) >= RESOLVE_CACHE_SIZE:
                    self._cache.clear()
            self._cache[(host, port)] = (now + self.ttl_s, list(found))
        return found

    async def lookup(self, host: str, port: int) -> list[str]:
        """Ask the host's resolver (``getaddrinfo``, in the loop's thread pool)."""
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=1)  # SOCK_STREAM
        except OSError:
            return []
        return list(dict.fromkeys(str(info[4][0]) for info in infos))
