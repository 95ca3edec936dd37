"""Sandbox calls on the server's threads: each tenant's counted, each cut when its client goes.

A call (a command, ``run_code``, a file op, ...) runs in one of the server's threads, which
no one else may have while it runs: ``RunningCalls`` caps each tenant's at once, so one
tenant's hundreds of streams leave the pool to the others.

A client that goes (its connection closed: a Ctrl-C, a cancelled task, a client-side timeout,
a process that died) gave up on its command, but the command ran on to its own deadline in
the sandbox: 350 streamed ``sleep``\\s abandoned by their clients left 308 running, holding the
tenant's calls and the server's threads for their whole timeout. ``CutOnLeave`` runs a
command or code call under a ``Cut`` (the one an ``AsyncSandbox`` task's cancel uses) and
asks for it the moment the client's ``http.disconnect`` arrives: the call's next wait for the
supervisor raises there, and its clean-up (the same as a Ctrl-C's) stops what it runs in the
sandbox, which stays, with its files, for the tenant's next call.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import anyio

from stockade import exceptions as exc
from stockade.sandbox._interrupt import CUT, Cut, Interrupted

if TYPE_CHECKING:
    from fastapi import Request

    from stockade.server.tenants import Tenant

__all__ = ["CutOnLeave", "RunningCalls"]

R = TypeVar("R")


class RunningCalls:
    """Each tenant's sandbox calls running at once in this process, at most its
    ``Quotas.running_calls``: each holds one of the server's threads until it ends (a streamed
    command for its whole life), so one tenant's hundreds of them would leave every other
    tenant's requests waiting for a thread. One more is refused at once, never queued."""

    def __init__(self) -> None:
        self._running: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, tenant: Tenant) -> None:
        """``QuotaExceeded`` when ``tenant`` runs its most already; else one more is counted
        (``give_back`` once it ends)."""
        cap = tenant.quotas.running_calls
        with self._lock:
            used = self._running.get(tenant.id, 0)
            if used >= cap:
                raise exc.QuotaExceeded(
                    f"tenant {tenant.id!r} has {used} sandbox calls running, its most at once "
                    f"(running_calls = {cap}): wait for one to end, or kill the sandbox running it",
                    quota="running_calls", limit=float(cap), used=float(used),
                )  # fmt: skip
            self._running[tenant.id] = used + 1

    async def run(self, tenant: Tenant, function: Callable[[], R], *, cut: CutOnLeave | None = None) -> R:
        """``function()`` on one of the server's threads as one of ``tenant``'s calls (under
        ``cut``, when given: stopped if its client goes)."""
        self.take(tenant)
        try:
            if cut is not None:
                return await cut.run(function)
            return await anyio.to_thread.run_sync(function)
        finally:  # a cancelled wait still waits for the thread: the call has ended here
            self.give_back(tenant)

    def give_back(self, tenant: Tenant) -> None:
        with self._lock:
            left = self._running.get(tenant.id, 0) - 1
            if left > 0:
                self._running[tenant.id] = left
            else:
                self._running.pop(tenant.id, None)


class CutOnLeave:
    """One call that its client's leaving cuts (``Cut``), as a Ctrl-C would cut it."""

    def __init__(self, request: Request) -> None:
        self._request = request
        self.cut = Cut()
        self._context = contextvars.copy_context()
        self._context.run(CUT.set, self.cut)

    async def run(self, function: Callable[[], R]) -> R:
        """``function()`` on one of the server's threads, the client's connection watched
        meanwhile; ``CallCancelled`` (answered to no one) when it went and the call was cut."""
        watcher = asyncio.ensure_future(self._watch())
        watcher.add_done_callback(lambda done: done.cancelled() or done.exception())  # seen, not logged
        try:
            return await anyio.to_thread.run_sync(self._context.run, function)
        except Interrupted:
            raise exc.CallCancelled(
                "the client went while its call ran: what the call ran in the sandbox was stopped"
            ) from None
        finally:
            watcher.cancel()

    async def _watch(self) -> None:
        # The body was read before the call began: what comes next is the client leaving.
        while (await self._request.receive())["type"] != "http.disconnect":
            pass
        self.cut.request()
