"""The files of a version-control folder that make a tool on the host run programs.

git reads its repository's ``config`` as commands (``core.fsmonitor``, ``core.pager``,
``core.sshCommand``, ``diff.external``, filter drivers, aliases, ``include.path``...), runs
``hooks/``, follows ``commondir``, a ``.git`` file (``gitdir:``) and ``objects/info/alternates``
to other folders, and runs a half-done rebase's ``exec`` lines on ``git rebase --continue``.
Mercurial reads ``.hg/hgrc`` (hooks, extensions, ``!`` aliases) and follows ``sharedpath``.
Code in a sandbox can write any of them into its workspace: a copy of that workspace on the
host (an export, a service's artifacts) made ``git status`` there run the code's command, as
the host's user (found from outside). Every other file of those folders (objects, refs, the
index, logs) is data: an agent's commits come back with them.

A folder is a repository's when it is named ``.git``, or when it has the shape git takes for a
bare repository (a ``HEAD`` beside ``objects/``, ``refs/`` or ``commondir``): git finds one of
those from any folder beneath it too. Names are compared case-folded, as a host whose file
system folds case (macOS, Windows) opens them.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["VCS_DIRS", "command_files", "in_vcs_folder"]

VCS_DIRS = frozenset({".git", ".hg", ".svn"})
# A repository's own files git reads as commands or as a way elsewhere (one part each).
_GIT_FILES = frozenset({"config", "config.worktree", "commondir", "gitdir"})
# Its folders whose every file is: hooks, and the to-do lists of a half-done rebase or pick.
_GIT_FOLDERS = frozenset({"hooks", "rebase-merge", "rebase-apply", "sequencer"})
_HG_FILES = frozenset({"hgrc", "hgrc-not-shared", "sharedpath"})


def in_vcs_folder(path: str) -> bool:
    """Whether a workspace-relative ``path`` lies in (or is) a ``.git``, ``.hg`` or ``.svn``."""
    return any(part.lower() in VCS_DIRS for part in path.split("/"))


def command_files(files: Iterable[str], folders: Iterable[str] = ()) -> set[str]:
    """Of a workspace's ``files`` (relative paths; ``folders``: its folders, empty ones
    included), those a VCS tool on the host would read as commands or follow elsewhere."""
    files = list(files)
    bare = _bare_repositories(files, folders)
    return {path for path in files if _runs_programs(path.lower().split("/"), bare)}


def _bare_repositories(files: list[str], folders: Iterable[str]) -> set[tuple[str, ...]]:
    """The folders (as folded parts; () is the root) shaped as git's bare repositories."""
    present = {tuple(f.lower().split("/")) for f in folders}
    for path in files:
        parts = tuple(path.lower().split("/"))
        present.update(parts[:i] for i in range(1, len(parts) + 1))
    return {
        parts[:-1]
        for parts in present
        if parts and parts[-1] == "head"
        and any((*parts[:-1], name) in present for name in ("objects", "refs", "commondir"))
    }  # fmt: skip


def _runs_programs(parts: list[str], bare: set[tuple[str, ...]]) -> bool:
    for i, part in enumerate(parts):
        if part == ".git" and _git_hazard(parts[i + 1 :]):
            return True
        if part == ".hg" and len(parts) == i + 2 and parts[i + 1] in _HG_FILES:
            return True
    return any(tuple(parts[:i]) in bare and _git_hazard(parts[i:]) for i in range(len(parts)))


def _git_hazard(rest: list[str]) -> bool:
    """Whether ``rest``, a path inside a repository's folder, is one git runs or follows."""
    if not rest:
        return True  # a `.git` file: `gitdir:` names the repository, anywhere
    if (len(rest) == 1 and rest[0] in _GIT_FILES) or rest[0] in _GIT_FOLDERS:
        return True
    if rest in (
        ["info", "attributes"],
        ["objects", "info", "alternates"],
        ["objects", "info", "http-alternates"],
    ):
        return True
    if rest[0] in ("modules", "worktrees"):  # each holds repositories of its own, named with any depth
        return any(_git_hazard(rest[j:]) for j in range(2, len(rest)))
    return False
