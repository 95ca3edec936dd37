"""Path rules: globs over workspace-relative paths, after normalisation.

``*`` and ``?`` stay within one directory, ``**`` crosses directories (``src/**`` is every
path under ``src``). A path that leads out of the workspace is never readable nor writable.
"""

from __future__ import annotations

import functools
import posixpath
import re
from collections.abc import Sequence

from stockade.policy.schema import PathRules

__all__ = ["glob_matches", "normalise", "readable", "writable"]

WORKSPACE = "/workspace"


def normalise(path: str) -> str | None:
    """The workspace-relative form of ``path``, or None if it leads outside (or is not a path)."""
    if "\x00" in path:
        return None
    if path.startswith("/"):
        if path != WORKSPACE and not path.startswith(WORKSPACE + "/"):
            return None
        path = path[len(WORKSPACE) :]
    depth = 0
    for part in path.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return None
        elif part not in ("", "."):
            depth += 1
    norm = posixpath.normpath("/" + path).lstrip("/")
    return "" if norm == "." else norm


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


def _allowed(globs: Sequence[str], rules: PathRules, path: str) -> bool:
    norm = normalise(path)
    if norm is None:
        return False
    if glob_matches(rules.deny, norm):
        return False
    return glob_matches(globs, norm)


def readable(rules: PathRules, path: str) -> bool:
    return _allowed(rules.read, rules, path)


def writable(rules: PathRules, path: str) -> bool:
    return _allowed(rules.write, rules, path)
