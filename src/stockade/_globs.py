"""Globs over workspace-relative paths: ``*`` and ``?`` within one folder, ``**`` across,
``[...]`` one character of a class (fnmatch's: ``[a-z]``, ``[!.]``), never ``/``.

The policy's path rules and the sandbox (what a seeded folder leaves out) match alike. A glob
is normalised once, where it is taken (``workspace_globs``); names and globs are compared in
NFC, so a folder named in NFD (as macOS writes names) is covered by a glob written in NFC.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Iterable, Sequence

from stockade.exceptions import InvalidArgument

__all__ = [
    "GLOB_CHARS",
    "covers",
    "covers_below",
    "glob_matches",
    "literal_glob",
    "may_hold",
    "nfc",
    "reaches",
    "unpack_filter",
    "workspace_glob",
    "workspace_globs",
]

# ``[`` opens a character class, as in fnmatch and the command rules: a name with a literal
# ``[`` is written ``[[]``. Refusing classes would leave ``[`` meaning two things across
# stockade (the command rules take fnmatch's), so a workspace glob takes fnmatch's meaning too.
GLOB_CHARS = frozenset("*?[")

WORKSPACE = "/workspace"


def nfc(text: str) -> str:
    """``text`` in NFC; ASCII (most names) as it is, without a look at its characters."""
    return text if text.isascii() else unicodedata.normalize("NFC", text)


def literal_glob(path: str) -> str:
    """The glob that matches ``path`` alone: its wildcard characters each a class of one."""
    return re.sub(r"[*?[]", lambda m: f"[{m.group()}]", path)


def workspace_globs(globs: Iterable[str], *, setting: str) -> tuple[str, ...]:
    """``globs`` in the one form they are matched in (``workspace_glob``)."""
    return tuple(workspace_glob(glob, setting=setting) for glob in globs)


def workspace_glob(glob: str, *, setting: str) -> str:
    """``glob`` relative to the workspace, in NFC, without ``./``, ``//``, ``/./``, a trailing
    ``/`` or the workspace's own prefix (``/workspace/``): a spelling that names the right files
    but matched none of them would keep nothing out. One that climbs (``..``), another absolute
    path, an empty one or an unclosed ``[`` is an ``InvalidArgument`` for ``setting``."""
    text = nfc(glob)
    where = f"{setting}: " if setting else ""  # a policy file's error names the setting itself
    fix = "write it relative to the workspace, e.g. secrets/** or **/*.pem"
    if "\x00" in text:
        raise InvalidArgument(f"{where}the glob {glob!r} holds a NUL", argument=setting, fix=fix)
    parts = [part for part in text.split("/") if part not in ("", ".")]
    if text.startswith("/"):
        if parts[:1] != [WORKSPACE[1:]]:
            raise InvalidArgument(
                f"{where}the glob {glob!r} is a path outside the workspace (globs name the "
                f"workspace's files)",
                argument=setting,
                fix=fix,
            )
        parts = parts[1:]
    if ".." in parts:
        raise InvalidArgument(
            f"{where}the glob {glob!r} climbs out of where it starts (..)", argument=setting, fix=fix
        )
    if not parts:
        raise InvalidArgument(
            f"{where}the glob {glob!r} names no file",
            argument=setting,
            fix="write ** for the whole workspace",
        )
    out = "/".join(parts)
    for part in parts:
        i = part.find("[")
        while i >= 0:
            end = _class_end(part, i)
            if end < 0:
                raise InvalidArgument(
                    f"{where}the glob {glob!r} opens a character class ([) it never closes",
                    argument=setting,
                    fix="close it (]), or write [[] for a literal [",
                )
            i = part.find("[", end + 1)
    return out


def _class_end(glob: str, start: int) -> int:
    """The index of the ``]`` that closes the class ``glob[start]`` opens, or -1 (fnmatch's
    rule: a ``]`` first in the class, after a ``!`` or not, is one of its characters)."""
    j = start + 1
    if j < len(glob) and glob[j] == "!":
        j += 1
    if j < len(glob) and glob[j] == "]":
        j += 1
    end = glob.find("]", j)
    return -1 if "/" in glob[start:end] else end


def _char_class(body: str) -> str:
    """The regular expression of one class's ``body`` (between the brackets): never ``/``."""
    negated = body.startswith("!")
    if negated:
        body = body[1:]
    items: list[str] = []
    k = 0
    while k < len(body):
        if k + 2 < len(body) and body[k + 1] == "-":
            low, high = body[k], body[k + 2]
            if low <= high:  # fnmatch drops an empty range (z-a)
                items.append(f"{re.escape(low)}-{re.escape(high)}")
            k += 3
        else:
            items.append(re.escape(body[k]))
            k += 1
    if negated:
        return f"[^/{''.join(items)}]"
    return f"(?!/)[{''.join(items)}]" if items else "(?!)"


@functools.lru_cache(maxsize=512)
def _compile(glob: str) -> re.Pattern[str]:
    glob = nfc(glob)
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
        elif glob[i] == "[" and (end := _class_end(glob, i)) >= 0:
            out.append(_char_class(glob[i + 1 : end]))
            i = end + 1
        else:  # an unclosed [ (a glob not taken through workspace_glob) is itself
            out.append(re.escape(glob[i]))
            i += 1
    return re.compile("".join(out), re.DOTALL)


def glob_matches(globs: Sequence[str], path: str) -> bool:
    """``path`` (normalised) matches a glob, or lies under a directory one matches."""
    path = nfc(path)
    for glob in globs:
        pattern = _compile(glob.strip("/"))
        if pattern.fullmatch(path):
            return True
        parent = path
        while "/" in parent:
            parent = parent.rsplit("/", 1)[0]
            if pattern.fullmatch(parent) and not GLOB_CHARS & set(glob):
                return True  # a plain directory ("secrets") also covers everything below it
    return False


def covers_below(globs: Sequence[str], path: str) -> bool:
    """``path`` or a folder above it matches a glob, wildcards or not: what a deny glob or a
    data class names, a folder's whole content with it (``secret*`` matches the folder
    ``secrets``, so ``secrets/key`` too). The sandbox leaves such a folder out whole; the
    host's checks must not read its files as outside the glob."""
    if glob_matches(globs, path):
        return True
    parent = nfc(path)
    while "/" in parent:
        parent = parent.rsplit("/", 1)[0]
        if any(_compile(glob.strip("/")).fullmatch(parent) for glob in globs):
            return True
    return False


def covers(globs: Sequence[str], path: str) -> bool:
    """Like ``glob_matches``, and ``dir/**`` also covers ``dir`` itself: what is left out of
    a copy is the folder, not only what is in it."""
    if glob_matches(globs, path):
        return True
    path = nfc(path)
    return any((folder := _folder(glob)) is not None and folder.fullmatch(path) for glob in globs)


@functools.lru_cache(maxsize=512)
def _folder(glob: str) -> re.Pattern[str] | None:
    """The folder ``dir/**`` names (``dir``), or None for a glob of another form."""
    glob = glob.strip("/")
    return _compile(glob[:-3]) if glob.endswith("/**") else None


def _prefix(glob: str) -> str:
    """The folders ``glob`` names before its first wildcard (``src/a`` of ``src/a/*.py``)."""
    literal: list[str] = []
    for part in nfc(glob).strip("/").split("/"):
        if GLOB_CHARS & set(part):
            break
        literal.append(part)
    return "/".join(literal)


def may_hold(globs: Sequence[str], folder: str) -> bool:
    """Whether something beneath ``folder`` may match one of ``globs`` (a folder to walk)."""
    folder = nfc(folder)
    for glob in globs:
        prefix = _prefix(glob)
        if not prefix or folder == prefix or folder.startswith(prefix + "/"):
            return True
        if prefix.startswith(folder + "/"):
            return True
    return False


def reaches(globs: Sequence[str], folder: str, depth: int | None = None) -> bool:
    """Whether a path beneath ``folder`` (normalised; "" the root), at most ``depth`` levels down
    (None: any), may match one of ``globs`` or lie in a folder one matches: what a download, a
    listing or a removal of ``folder`` reaches. A glob's first match lies at its literal prefix
    (``reports`` of ``reports/**``) or, with wildcards after it, one level below; a folder at or
    inside that prefix may hold matches at any level (conservatively)."""
    folder = nfc(folder)
    for glob in globs:
        prefix = _prefix(glob)
        if _within(folder, prefix):
            return True
        if not _within(prefix, folder):
            continue
        below = prefix.count("/") + 1 - (folder.count("/") + 1 if folder else 0)
        first = below if _plain(glob) else below + 1
        if depth is None or first <= depth:
            return True
    return False


def _within(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or lies beneath it ("" is the root, which holds every path)."""
    return folder in ("", path) or path.startswith(folder + "/")


def unpack_filter(
    hide: Sequence[str], read: Sequence[str], stores: Iterable[str]
) -> dict[str, object] | None:
    """What a sandbox's unpacking leaves out of a restore (``supervisor/unpack.py``'s ``Keep``,
    standard library only): each glob compiled here, so that both sides match alike (as
    ``covers``, ``glob_matches`` and ``may_hold`` do), and the names of repository stores
    (``stores``), left out whenever anything is hidden. None: nothing is left out."""
    everything = "**" in (g.strip("/") for g in read)
    if not hide and everything:
        return None
    return {
        "hide": [[_compile(g.strip("/")).pattern, _folder_pattern(g), _plain(g)] for g in hide],
        "stores": sorted(stores) if hide else [],
        "read": None
        if everything
        else [[_compile(g.strip("/")).pattern, _plain(g), _prefix(g)] for g in read],
    }


def _folder_pattern(glob: str) -> str | None:
    folder = _folder(glob)
    return None if folder is None else folder.pattern


def _plain(glob: str) -> bool:
    """A glob without wildcards: a folder it names covers all below (``glob_matches``)."""
    return not GLOB_CHARS & set(glob)
