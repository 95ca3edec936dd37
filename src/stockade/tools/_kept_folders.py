"""The folders tools keep in a workspace (VCS, dependencies, caches, build output), and what
the run's diff says of them (``workspace_diff``).

``list_files`` shows the model none of them. The diff compares them all the same, after the
project's own files: it once left out every path with such a part at any depth, files the run
began with included, and said nothing (a ``curl ... | sh`` appended to tools/build/release.sh,
a new target/run.sh, showed as no change, while a copy of the workspace on the host brought them
back; found from outside). A file the run began with is diffed as any other; a file new in such
a folder is named with its folder's count; a VCS folder is never a patch (one applied elsewhere
would write its ``config``), its command files (``stockade._vcs``) are named one by one.
"""

from __future__ import annotations

from stockade._vcs import in_vcs_folder

__all__ = ["IGNORED_DIRS", "Kept", "ignored_folder", "is_ignored", "under_ignored", "vcs_folder"]

IGNORED_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        "__pycache__",
        "node_modules",
        ".venv",
        "venv",
        "build",
        "dist",
        "target",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".tox",
        ".nox",
        ".stockade",
        ".eggs",
    }
)


def is_ignored(path: str) -> bool:
    """VCS, caches, dependencies and build output: not the project's own files (what
    ``list_files`` shows the model; the diff still compares them, ``workspace_diff``)."""
    return any(_ignored_part(part) for part in path.split("/"))


def _ignored_part(part: str) -> bool:
    return part in IGNORED_DIRS or part.endswith(".egg-info")


def under_ignored(path: str) -> bool:
    """Whether ``path`` lies in an ignored folder (a file of its own named ``build`` does not)."""
    return any(_ignored_part(part) for part in path.split("/")[:-1])


def ignored_folder(path: str) -> str:
    """The outermost ignored folder ``path`` lies in (``is_ignored``), by which the diff counts
    the files new there; "" for none."""
    parts = path.split("/")
    first = next((i for i, part in enumerate(parts[:-1]) if _ignored_part(part)), None)
    return "" if first is None else "/".join(parts[: first + 1])


def vcs_folder(path: str) -> str:
    """The outermost ``.git``, ``.hg`` or ``.svn`` folder ``path`` lies in (or is)."""
    parts = path.split("/")
    first = next(i for i, part in enumerate(parts) if in_vcs_folder(part))
    return "/".join(parts[: first + 1])


class Kept:
    """The changes the diff names but never shows: a repository's command files (a patch
    applied elsewhere would write them: ``.git/config`` runs programs), the rest of a VCS
    folder (objects, refs, the index: an agent's commits), counted by folder, and files new in
    folders of dependencies, caches and build output, counted by folder (what a run's
    ``npm install`` writes). A file those folders held at the start is diffed as any other."""

    def __init__(self, commands: set[str]) -> None:
        self.commands = commands
        self.hazards: list[str] = []
        self.vcs: dict[str, list[str]] = {}
        self.made: dict[str, list[str]] = {}

    def takes(self, path: str, new: bool, same: bool) -> bool:
        """Whether ``path`` (``new``: not in the baseline; ``same``: unchanged) is one of these,
        named at the diff's end when it changed."""
        commanding = path in self.commands
        if not (commanding or in_vcs_folder(path) or (new and under_ignored(path))):
            return False
        if same:
            return True
        if commanding:
            self.hazards.append(path)
        elif in_vcs_folder(path):
            self.vcs.setdefault(vcs_folder(path), []).append(path)
        else:
            self.made.setdefault(ignored_folder(path), []).append(path)
        return True

    def lines(self) -> list[str]:
        out = []
        if self.hazards:
            why = (
                "a repository's files that make git or Mercurial run programs (config, hooks, a "
                ".git file...), changed during the run: a patch never carries them"
            )
            out.append(f"Left out ({why}): {_names(self.hazards)}\n")
        if self.vcs:
            why = "changes in a repository's folder (objects, refs, the index: commits made during the run)"
            out.append(f"Left out ({why}): {_counted(self.vcs)}\n")
        if self.made:
            why = (
                "new in folders of dependencies, caches and build output, of which the diff "
                "shows only the files the run began with"
            )
            out.append(f"Left out ({why}): {_counted(self.made)}\n")
        return out


def _counted(folders: dict[str, list[str]]) -> str:
    """Each folder with its count of files and the first few of them."""

    def one(folder: str, paths: list[str]) -> str:
        more = ", ..." if len(paths) > 3 else ""
        return f"{folder!r} ({len(paths):,}: {', '.join(repr(p) for p in paths[:3])}{more})"

    named = [one(folder, folders[folder]) for folder in sorted(folders)[:20]]
    more = f" ... ({len(folders)} folders in all)" if len(folders) > 20 else ""
    return ", ".join(named) + more


def _names(paths: list[str]) -> str:
    return ", ".join(repr(p) for p in paths[:20]) + (f" ... ({len(paths)} in all)" if len(paths) > 20 else "")
