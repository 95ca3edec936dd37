"""The sync client's connections, their reads ended by the call's deadline.

httpx's read timeout is per read: a head that drips a byte a second never trips it. The
client sets the deadline of the call in flight on this thread (``reads_by``); the connections
of its pools read at most what is left of it (``with_deadlines``). The async client bounds its
calls with ``asyncio.timeout`` instead.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

try:
    import httpcore2 as httpcore
except ModuleNotFoundError:  # pragma: no cover - the extra is missing
    httpcore = None  # type: ignore[assignment]

__all__ = ["read_by", "reads_by", "with_deadlines"]

# When the read in flight on this thread must end (monotonic), whatever httpx's per-read
# timeout says: a head that drips a byte a second never trips that (it read 16 KiB of one
# for 30 s at timeout_s=3). The sync client's sockets check it (``_ByDeadline``).
_READ_BY: contextvars.ContextVar[float | None] = contextvars.ContextVar("stockade_read_by", default=None)


@contextmanager
def reads_by(deadline: float | None) -> Iterator[None]:
    token = _READ_BY.set(deadline)
    try:
        yield
    finally:
        _READ_BY.reset(token)


class _Stream(Protocol):  # httpcore's NetworkStream, as far as _ByDeadline uses it
    def read(self, max_bytes: int, timeout: float | None = None) -> bytes: ...
    def write(self, buffer: bytes, timeout: float | None = None) -> None: ...
    def close(self) -> None: ...
    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> Any: ...  # fmt: skip
    def get_extra_info(self, info: str) -> Any: ...


class _ByDeadline:
    """A connection whose reads end at ``_READ_BY``: each waits at most what is left."""

    def __init__(self, stream: _Stream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        deadline = _READ_BY.get()
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise httpcore.ReadTimeout("past the call's deadline (timeout_s)")
            timeout = left if timeout is None else min(timeout, left)
        return self._stream.read(max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, timeout)

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> _ByDeadline:  # fmt: skip
        return _ByDeadline(self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _Backend:
    """httpcore's sync network backend, its connections ``_ByDeadline``."""

    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None, socket_options: Any = None) -> _ByDeadline:  # fmt: skip
        return _ByDeadline(self._backend.connect_tcp(host, port, timeout, local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> _ByDeadline:  # fmt: skip
        return _ByDeadline(self._backend.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


def with_deadlines(client: Any) -> Any:
    """``client`` (an ``httpx2.Client``), its connection pools' reads ``_ByDeadline``: the
    default transport's and the proxies' httpx mounts from the environment (httpx takes no
    network backend; httpcore's pool does, and makes no connection before the first call).
    A transport of the caller's with no such pool is left as it is."""
    for transport in (client._transport, *client._mounts.values()):
        pool = getattr(transport, "_pool", None)
        if isinstance(pool, httpcore.ConnectionPool):
            pool._network_backend = _Backend()  # type: ignore[assignment]
    return client


def read_by() -> float | None:
    """The deadline (monotonic) of the read in flight on this thread, if a call set one."""
    return _READ_BY.get()
