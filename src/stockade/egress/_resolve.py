"""How a sandbox's proxy finds the addresses of a name: the host's resolver, or a pinned answer.

The proxy resolves each name itself, once per request, and checks every answer before it
connects to one of them (``_gate.Gate.address``); the sandbox has no DNS of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from stockade.egress._rules import ip_literal
from stockade.exceptions import StockadeError

__all__ = [
    "LOOKUP_TIMEOUT_S",
    "MAX_LOOKUPS",
    "RESOLVE_CACHE_SIZE",
    "RESOLVE_TTL_S",
    "LookupsStuck",
    "NotAName",
    "Resolver",
    "SystemResolver",
    "host_addresses",
]

RESOLVE_TTL_S = 15.0  # below most records' own TTL; getaddrinfo does not say theirs
RESOLVE_CACHE_SIZE = 1024  # names per sandbox
LOOKUP_TIMEOUT_S = 10.0  # a name not resolved by then is refused (glibc: 5 s a try, 2 tries a server)
MAX_LOOKUPS = 4  # the host resolver's threads one sandbox may hold at once
# ... and hold still, its earlier users' stuck ones with them, when a lookup would start
# another (times ``max_lookups``): ``forget`` frees the slots, not the threads.
MAX_THREADS_PER_LOOKUP_SLOT = 2


class NotAName(StockadeError):
    """A name no resolver can be asked about (an empty label, one over 63 characters, ...):
    the proxy refuses the request (``400``) as it does any other it cannot read."""


class LookupsStuck(StockadeError):
    """The host resolver's threads this resolver holds are all in use, most of them by
    lookups of the sandbox's earlier users that have not ended: the proxy refuses the
    name (``502``) rather than start another. Retrying helps once they end."""

    retryable = True


class Resolver(Protocol):
    """How the proxy finds addresses. One with a ``forget()`` (``SystemResolver``) has it
    called when the sandbox passes to its next user (``Gate.renew``)."""

    async def resolve(self, host: str, port: int) -> list[str]:
        """The addresses of ``host`` (empty when it has none); ``NotAName`` for no DNS name."""
        ...


def host_addresses(host: str, port: int) -> list[str]:
    """The host resolver's answers for ``host`` (``getaddrinfo``; blocks), empty for none."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class SystemResolver:
    """The host's resolver, with ``pinned`` names answered first (``NetworkPolicy.resolve``).

    Answers are kept ``ttl_s`` (a burst of requests to one host, as ``pip install`` makes,
    asks the host's resolver once: a host without a caching resolver sends a query each
    time). Safe against rebinding: the proxy checks every answer each time, cached or not,
    and connects to an address it checked; a cache only keeps the answers the same for a
    while. Failures are not kept.

    Each lookup runs ``ask`` (``host_addresses``) on a daemon thread of this resolver's, at
    most ``max_lookups`` at once; more wait for one to end (the proxy's deadline,
    ``Gate.lookup_timeout_s``, refuses a name that waits too long). Not the event loop's
    pool, which every sandbox's proxy shares: a sandbox asking for names its host's DNS
    is slow to answer held all of its threads and stalled every other sandbox's lookups.
    And not a pool the interpreter joins at exit, nor uvloop's (libuv's threads), whose
    lookups still blocked at the interpreter's exit crashed it (SIGSEGV) when they ended:
    a daemon thread still in ``getaddrinfo`` then just ends.

    ``forget`` gives the next user ``max_lookups`` free slots, but its threads are counted
    across forgets: while ``MAX_THREADS_PER_LOOKUP_SLOT * max_lookups`` of them are still in
    ``getaddrinfo`` (the earlier users' stuck lookups with the current one's), a lookup is
    refused (``LookupsStuck``), so resetting a sandbox in a loop of slow names cannot pile
    up the host's threads (it gave 4 more each reset)."""

    def __init__(
        self,
        pinned: Mapping[str, Sequence[str]] | None = None,
        *,
        ttl_s: float = RESOLVE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        ask: Callable[[str, int], Sequence[str]] = host_addresses,
        max_lookups: int = MAX_LOOKUPS,
    ) -> None:
        self.pinned = {k.lower().rstrip("."): list(v) for k, v in (pinned or {}).items()}
        self.ttl_s = ttl_s
        self.clock = clock
        self.ask = ask
        self.max_lookups = max_lookups
        self._cache: dict[tuple[str, int], tuple[float, list[str]]] = {}
        self._threads: asyncio.Semaphore | None = None  # made on the loop that first asks
        self._running = 0  # threads in ``ask`` now, whoever's lookups they are (a forget keeps it)
        self._running_lock = threading.Lock()  # ends in a thread, its start on the loop

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

    def forget(self) -> None:
        """As if new, for the sandbox's next user: no answer kept (its timing told which names
        the last user asked for) and every lookup slot free (the last user's stuck lookups
        held them). A lookup still running frees the slot it took, of a semaphore nobody
        waits on any more; its answer goes to a request that was cut. Its thread still
        counts against the threads this resolver may hold (``LookupsStuck``)."""
        self._cache = {}
        self._threads = None

    async def lookup(self, host: str, port: int) -> list[str]:
        """Ask the host's resolver, on a thread of this resolver's once one is free."""
        try:  # what getaddrinfo would do first, and fail on, in the thread
            name = host.encode("idna").decode("ascii")
        except UnicodeError as err:
            raise NotAName(f"{host} is not a DNS name ({err.__cause__ or err})") from None
        if self._threads is None:
            self._threads = asyncio.Semaphore(self.max_lookups)
        threads = self._threads
        await threads.acquire()
        with self._running_lock:
            if self._running >= MAX_THREADS_PER_LOOKUP_SLOT * self.max_lookups:
                stuck = self._running
            else:
                stuck = 0
                self._running += 1
        if stuck:
            threads.release()
            raise LookupsStuck(f"{host} not looked up: {stuck} lookups of this sandbox's have not ended")
        # From here the slot is the thread's: it is freed when ``ask`` returns, not when the
        # request that asked gives up (getaddrinfo cannot be cut short).
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[list[str]] = loop.create_future()

        def answered(found: list[str] | None, error: BaseException | None) -> None:
            threads.release()
            if answer.done():  # the request gave up (its deadline, its sandbox closed)
                return
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(found or [])

        def run() -> None:
            found: list[str] | None = None
            error: BaseException | None = None
            try:
                found = list(self.ask(name, port))
            except ValueError as err:  # what getaddrinfo says of a name it cannot send
                error = NotAName(f"{host} is not a DNS name ({err})")
            except Exception as err:  # a resolver's failure is the request's, not the thread's
                error = err
            finally:
                with self._running_lock:
                    self._running -= 1
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(answered, found, error)

        try:
            threading.Thread(target=run, name="stockade-egress-dns", daemon=True).start()
        except BaseException:  # no thread (the host is out of them): the slot stays free
            with self._running_lock:
                self._running -= 1
            threads.release()
            raise
        return await answer
