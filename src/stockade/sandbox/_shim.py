"""The compiled command shim (``supervisor/shim.c``), built once per host.

Every command runs under a shim: a child subreaper leading its own session, which kills
what the command leaves behind and ends as the command did. In Python the shim is a fork
of the supervisor, whose page tables and touched pages each command pays for: ~2 ms more a
command on the process tier, tens of milliseconds on gVisor (docs/benchmarks.md). The
compiled one is started with posix_spawn instead. Built here with the host's C compiler
into the cache, named after its source and flags, and shipped beside the supervisor's
modules to every tier (``supervisor.sources()``); it uses no C library, so the one build
runs in any image. Without a compiler (or off x86_64) commands keep the Python shim:
slower, never weaker.
"""

from __future__ import annotations

import functools
from pathlib import Path

from stockade.sandbox import _native
from stockade.sandbox._rootfs import cache_root

__all__ = ["NAME", "SOURCE", "build", "program"]

SOURCE = Path(__file__).parent / "supervisor" / "shim.c"
NAME = "shim"  # its name beside the supervisor's modules (supervisor/reaper.py: SHIM)
FLAGS = _native.FREESTANDING_PROGRAM


def build(folder: Path | None = None) -> Path | None:
    """The shim, compiled into ``folder`` (the cache) unless it is there (~0.1 s, once per
    host and version); None where it cannot be."""
    return _native.build(SOURCE, FLAGS, folder or cache_root() / "shim")


@functools.cache
def program() -> bytes | None:
    """The shim's bytes, built on first use in this process; None where it cannot be."""
    path = build()
    return path.read_bytes() if path is not None else None
