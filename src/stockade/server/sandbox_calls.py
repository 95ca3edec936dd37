"""What every sandbox route shares: the request's registry, and its work run off the event loop.

A route of ``server/sandboxes.py`` or ``server/sandbox_files.py`` does its work on a server
thread: a sandbox call through ``call``, counted among the caller's ``RunningCalls``; a kill,
a delete, a look for a paused sandbox or the token's recheck through ``blocking``, not counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
from fastapi import Request

from stockade.server.calls import CutOnLeave
from stockade.server.deps import get_service
from stockade.server.sandbox_registry import SandboxRegistry
from stockade.server.tenants import Principal

__all__ = ["blocking", "call", "registry_of"]


def registry_of(request: Request) -> SandboxRegistry:
    return get_service(request).sandboxes


async def blocking(function: Callable[[], Any]) -> Any:
    return await anyio.to_thread.run_sync(function)


async def call(
    request: Request, caller: Principal, function: Callable[[], Any], *, cut_on_leave: bool = False
) -> Any:
    """``function`` on a server thread, as one of the caller's ``RunningCalls`` (refused at
    once when they are all taken). Killing or deleting a sandbox is not one: a tenant at its
    most can always stop what holds it. ``cut_on_leave``: a command or code, stopped in the
    sandbox when its client goes (``CutOnLeave``); the other calls are short, and run to
    their end."""
    cut = CutOnLeave(request) if cut_on_leave else None
    return await registry_of(request).calls.run(caller.tenant, function, cut=cut)
