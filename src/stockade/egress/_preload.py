"""The connect shortcut preloaded into a gVisor sandbox's programs (``connect.c``).

On gVisor the relay's hop (the code's TCP connection over the netstack's loopback, then the
relay's reads and writes) is most of what egress adds to a request. ``connect.c``, preloaded
into the sandbox's programs, connects them to the proxy's socket itself when they connect
to the relay's port: the same socket the relay would connect to, so nothing new is
reachable, and the proxy decides as before. What it cannot take (a program without the C
library's ``connect``, a full backlog) still goes through the relay. Built once per host
(``stockade.sandbox._native``); without a compiler there is no library and every
connection takes the relay.
"""

from __future__ import annotations

from pathlib import Path

from stockade.sandbox import _native
from stockade.sandbox._rootfs import cache_root

__all__ = ["LIBRARY", "SOURCE", "flags", "library"]

SOURCE = Path(__file__).parent / "connect.c"
LIBRARY = "connect.so"  # its name in the sandbox's egress folder


def flags(port: int, socket_path: str) -> tuple[str, ...]:
    """The compiler's flags for a library that sends ``127.0.0.1:port`` to ``socket_path``."""
    if not 0 < port < 65536 or not socket_path.startswith("/") or len(socket_path.encode()) >= 108:
        raise ValueError(f"no preload for port {port} and socket {socket_path!r}")
    if any(c in socket_path for c in '"\\\n'):
        raise ValueError(f"no preload for a socket path with quotes: {socket_path!r}")
    return (*_native.FREESTANDING, f"-DPROXY_PORT={port}", f'-DPROXY_SOCKET="{socket_path}"')


_built: dict[tuple[int, str], bytes | None] = {}  # per process: the library's bytes, or None


def library(port: int, socket_path: str, folder: Path | None = None) -> bytes | None:
    """The library's bytes (built on first use, once per host in the cache), or None where
    it cannot be built."""
    key = (port, socket_path)
    if key not in _built:
        path = _native.build(SOURCE, flags(port, socket_path), folder or cache_root() / "egress")
        _built[key] = path.read_bytes() if path is not None else None
    return _built[key]
