"""The process tier's launcher (``launch.c``): joins the sandbox's cgroups, takes its host uid,
execs bwrap, in one exec of a small static program, built once per host.

Without it (no C compiler, not x86_64, no writable cache) the same chain runs as it did
before: ``sh`` writes the cgroup files, ``nsenter -S UID -G UID`` drops to the uid. Both
ways do the same; the launcher saves two execs (~2 ms of every cold start, measured).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

from stockade.sandbox import _native
from stockade.sandbox._rootfs import cache_root

__all__ = ["FLAGS", "SOURCE", "build", "chain", "usable"]

SOURCE = Path(__file__).parent / "launch.c"
FLAGS = _native.FREESTANDING_PROGRAM
NO_UID = "-"  # the launcher keeps the caller's uid


def build(folder: Path | None = None) -> Path | None:
    """The launcher, compiled into ``folder`` (the cache) unless it is there (~0.1 s, once
    per host and version); None where it cannot be."""
    return _native.build(SOURCE, FLAGS, folder or cache_root() / "launch")


def usable(folder: Path | None = None) -> Path | None:
    """The launcher, built, and seen to run here (a cache on a ``noexec`` mount would build
    it and then fail every start); None otherwise: the caller takes the shell's way. Tried
    once per process and folder, not once per backend."""
    return _tried(folder or cache_root() / "launch")


@functools.cache
def _tried(folder: Path) -> Path | None:
    launcher = build(folder)
    true = shutil.which("true")
    if launcher is None or true is None:
        return None
    try:
        trial = [str(launcher), NO_UID, "0", true]
        done = subprocess.run(trial, capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return launcher if done.returncode == 0 else None


def chain(launcher: Path, uid: int | None, join: list[str], argv: list[str]) -> list[str]:
    """``argv``, started by the launcher inside the cgroups whose ``join`` files it writes
    to, as host ``uid`` (None: the caller's)."""
    return [str(launcher), NO_UID if uid is None else str(uid), str(len(join)), *join, *argv]
