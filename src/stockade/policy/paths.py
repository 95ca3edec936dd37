"""Path rules: globs over workspace-relative paths, after normalisation.

``*``, ``?`` and ``[...]`` stay within one directory, ``**`` crosses directories (``src/**``
is every path under ``src``); paths and globs are compared in NFC (``stockade._globs``). A
path that leads out of the workspace is never readable nor writable.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence

from stockade._globs import GLOB_CHARS, covers_below, glob_matches, nfc
from stockade.policy.schema import PathRules

__all__ = [
    "GLOB_CHARS",
    "glob_matches",
    "literal_prefix",
    "normalise",
    "readable",
    "tree_allowed",
    "writable",
]

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
    norm = posixpath.normpath("/" + nfc(path)).lstrip("/")  # NFC: as the globs are
    return "" if norm == "." else norm


def _allowed(globs: Sequence[str], rules: PathRules, path: str) -> bool:
    norm = normalise(path)
    if norm is None:
        return False
    if covers_below(rules.deny, norm):
        return False
    return glob_matches(globs, norm)


def readable(rules: PathRules, path: str) -> bool:
    return _allowed(rules.read, rules, path)


def writable(rules: PathRules, path: str) -> bool:
    return _allowed(rules.write, rules, path)


def literal_prefix(glob: str) -> str:
    """The directories of ``glob`` before its first wildcard part (``src/a/*.py`` -> ``src/a``)."""
    parts: list[str] = []
    for part in glob.strip("/").split("/"):
        if GLOB_CHARS & set(part):
            break
        parts.append(part)
    return "/".join(parts)


def _under(path: str, base: str) -> bool:
    return base in ("", path) or path.startswith(base + "/")


def tree_allowed(
    globs: Sequence[str], rules: PathRules, prefix: str, *, classified: Sequence[str] = ()
) -> bool:
    """Whether every path under ``prefix`` (normalised) is allowed: a glob covers the whole
    subtree, and no deny glob nor classified-data glob reaches into it. Conservative: used for
    what a shell wildcard may expand to, which the rules cannot enumerate."""
    covered = False
    for glob in globs:
        g = glob.strip("/")
        base = g[:-3] if g.endswith("/**") else ("" if g == "**" else g)
        if not (GLOB_CHARS & set(base)) and (g == "**" or g.endswith("/**") or base) and _under(prefix, base):
            covered = True
            break
    if not covered:
        return False
    for glob in (*rules.deny, *classified):
        reach = literal_prefix(glob)
        if _under(prefix, reach) or _under(reach, prefix):
            return False
    return True
