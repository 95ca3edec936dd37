"""One event loop thread per process for every sandbox's egress proxy.

The tiers are synchronous (threads); the proxies are asyncio. One daemon thread runs a loop
for all of them, started on first use; ``call`` runs a coroutine there and waits for it.
After a fork the child starts its own (the parent's thread does not exist there).

The loop is uvloop's when it is installed (``pip install "stockade[egress-fast]"``): the
proxies spend a fifth less CPU per request on it (asyncio's own Python code was a third of
theirs). ``STOCKADE_EGRESS_LOOP=asyncio`` keeps the standard loop; without uvloop it is that.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_pid = 0


def loop() -> asyncio.AbstractEventLoop:
    global _loop, _pid
    with _lock:
        if _loop is None or _pid != os.getpid() or _loop.is_closed():
            new = new_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(new)
                new.call_soon(ready.set)
                new.run_forever()

            threading.Thread(target=run, name="stockade-egress", daemon=True).start()
            ready.wait()
            _loop, _pid = new, os.getpid()
        return _loop


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop if it is installed and not declined, else asyncio's."""
    if os.environ.get("STOCKADE_EGRESS_LOOP", "").strip().lower() != "asyncio":
        try:  # by name: an optional dependency, without stubs for the type checker
            uvloop = importlib.import_module("uvloop")
        except ImportError:
            pass
        else:
            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return loop
    return asyncio.new_event_loop()


def call(coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
    """Run ``coro`` on the egress loop and return its result (from any other thread)."""
    return asyncio.run_coroutine_threadsafe(coro, loop()).result(timeout_s)
