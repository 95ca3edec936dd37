"""Globs over workspace-relative paths: ``*`` and ``?`` within one folder, ``**`` across.

The policy's path rules and the sandbox (what a seeded folder leaves out) match alike.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

__all__ = ["covers", "glob_matches", "may_hold"]


@functools.lru_cache(maxsize=512)
def _compile(glob: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif glob[i] == "*":
            out.append("[^/]*")
            i += 1
        elif glob[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return re.compile("".join(out), re.DOTALL)


def glob_matches(globs: Sequence[str], path: str) -> bool:
    """``path`` (normalised) matches a glob, or lies under a directory one matches."""
    for glob in globs:
        pattern = _compile(glob.strip("/"))
        if pattern.fullmatch(path):
            return True
        parent = path
        while "/" in parent:
            parent = parent.rsplit("/", 1)[0]
            if pattern.fullmatch(parent) and not any(c in glob for c in "*?"):
                return True  # a plain directory ("secrets") also covers everything below it
    return False


def covers(globs: Sequence[str], path: str) -> bool:
    """Like ``glob_matches``, and ``dir/**`` also covers ``dir`` itself: what is left out of
    a copy is the folder, not only what is in it."""
    return glob_matches(globs, path) or any(
        g.strip("/").endswith("/**") and g.strip("/")[:-3] == path for g in globs
    )


def may_hold(globs: Sequence[str], folder: str) -> bool:
    """Whether something beneath ``folder`` may match one of ``globs`` (a folder to walk)."""
    for glob in globs:
        parts = glob.strip("/").split("/")
        literal: list[str] = []
        for part in parts:
            if any(c in part for c in "*?["):
                break
            literal.append(part)
        prefix = "/".join(literal)
        if not prefix or folder == prefix or folder.startswith(prefix + "/"):
            return True
        if prefix.startswith(folder + "/"):
            return True
    return False
