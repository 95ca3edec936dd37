"""The exec judge's compiled fast path (``supervisor/judge.c``), built once per host.

The supervisor judges every exec of a sandbox under command rules; in Python, each costs a
wake of the supervisor and about 0.35 ms. ``judge.c`` answers, on a thread of the supervisor,
the execs the rules allow whatever their arguments, and hands the rest to the Python judge;
it also confines each shim in one call (``stockade_confine``: dumpable, the Landlock domain).
It is built here with the host's C compiler into the cache, named after its source and flags,
and shipped beside the supervisor's modules to every tier (``supervisor.sources()``). It uses
no C library, so the one build loads in any image's python. Without a compiler (or off
x86_64) there is no library, and every tier judges in Python: slower, never weaker.
"""

from __future__ import annotations

from pathlib import Path

from stockade.sandbox import _native
from stockade.sandbox._rootfs import cache_root

__all__ = ["FLAGS", "LIBRARY", "SOURCE", "build", "built", "library"]

SOURCE = Path(__file__).parent / "supervisor" / "judge.c"
LIBRARY = "judge.so"  # its name beside the supervisor's modules
FLAGS = _native.FREESTANDING


def built(folder: Path | None = None) -> Path | None:
    """The library if it is in ``folder`` (the cache) already; never compiles."""
    return _native.built(SOURCE, FLAGS, folder or cache_root() / "judge")


def build(folder: Path | None = None) -> Path | None:
    """The library, compiled into ``folder`` (the cache) unless it is there; None without a
    compiler or off x86_64 (the listener it serves is x86_64 only)."""
    return _native.build(SOURCE, FLAGS, folder or cache_root() / "judge")


_library: list[bytes | None] = []  # once known in this process: its bytes, or None (no build)


def library(*, build_it: bool = True) -> bytes | None:
    """The library's bytes, built on first use in this process (once per host in the cache).
    ``build_it=False``: only if the cache has it, never waiting for a compiler (a sandbox
    without rules has no use for it, and a first build takes about a second)."""
    if _library:
        return _library[0]
    path = build() if build_it else built()
    if path is None and not build_it:
        return None  # asked again, with a build, by the first sandbox that needs it
    _library.append(path.read_bytes() if path is not None else None)
    return _library[0]
