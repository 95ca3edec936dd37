"""The in-sandbox side of every tier: the supervisor, the interpreter, their protocol.

These modules are copied into each sandbox and run there on whatever Python it has (stdlib
only, >= 3.8). Host code imports only ``protocol`` from here, and ``sources()`` to copy them.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["sources"]


def sources(*, judge: bool = True) -> dict[str, bytes]:
    """Every module the sandbox needs, by file name, the compiled command shim (``shim``:
    without it each command's shim is a fork of the supervisor) and the exec judge's
    compiled fast path (``judge.so``: without it the supervisor judges in Python), each
    where this host could build it.
    ``judge=False``: the fast path only if it was built already (no compiler run for it)."""
    from stockade.sandbox import _judge, _shim

    here = Path(__file__).parent
    found = {p.name: p.read_bytes() for p in sorted(here.glob("*.py")) if p.name != "__init__.py"}
    compiled = _judge.library(build_it=judge)
    if compiled is not None:
        found[_judge.LIBRARY] = compiled
    shim = _shim.program()
    if shim is not None:
        found[_shim.NAME] = shim
    return found
