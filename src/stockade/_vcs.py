"""The files of a version-control folder that make a tool on the host run programs.

git reads its repository's ``config`` as commands (``core.fsmonitor``, ``core.pager``,
``core.sshCommand``, ``diff.external``, filter drivers, aliases, ``include.path``...), runs
``hooks/``, follows ``commondir``, a ``.git`` file (``gitdir:``) and ``objects/info/alternates``
to other folders, and runs a half-done rebase's ``exec`` lines on ``git rebase --continue``.
Mercurial reads ``.hg/hgrc`` (hooks, extensions, ``!`` aliases, ``%include``) and follows
``sharedpath``; Sapling the same in ``.sl/config``; Jujutsu reads ``.jj/repo/config.toml`` (and
the workspace's, both with ``ui.pager``, ``merge-tools``, ``fix.tools``...) and follows
``.jj/repo`` (a file naming the shared repository) and ``store/git_target``. Subversion's
``.svn`` holds no file that runs a program. A repository's own config names more: the folder
of ``core.hooksPath`` (husky's ``.husky/_``, often git-ignored) and the files of
``include.path``/``includeIf``, which can lie in the worktree (``Configured``).
Code in a sandbox can write any of them into its workspace: a copy of that workspace on the
host (an export, a service's artifacts) made ``git status`` there run the code's command, as
the host's user (found from outside). Every other file of those folders (objects, refs, the
index, logs) is data: an agent's commits come back with them.

A folder is a repository's when it is named ``.git``, or when it has the shape git takes for a
bare repository (a ``HEAD`` beside ``objects/``, ``refs/`` or ``commondir``): git finds one of
those from any folder beneath it too. Names are compared as a host that folds them opens them
(git's ``is_ntfs_dotgit``/``is_hfs_dotgit``): case-folded, ``\\`` a separator, trailing dots
and spaces and an NTFS stream (``:...``) dropped, the code points HFS+ ignores removed, and
the 8.3 short name ``git~1`` read as ``.git``.
"""

from __future__ import annotations

import os
import posixpath
import re
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["VCS_DIRS", "Configured", "command_files", "configured", "fold", "in_vcs_folder"]

VCS_DIRS = frozenset({".git", ".hg", ".svn", ".sl", ".jj"})
# A repository's own files git reads as commands or as a way elsewhere (one part each).
_GIT_FILES = frozenset({"config", "config.worktree", "commondir", "gitdir"})
# Its folders whose every file is: hooks, and the to-do lists of a half-done rebase or pick.
_GIT_FOLDERS = frozenset({"hooks", "rebase-merge", "rebase-apply", "sequencer"})
_HG_FILES = frozenset({"hgrc", "hgrc-not-shared", "sharedpath"})
_SL_FILES = _HG_FILES | {"config", "config-not-shared"}
# What HFS+ ignores in a name (git's is_hfs_dotgit): zero-width joiners, direction marks, BOM.
_IGNORED = dict.fromkeys([*range(0x200C, 0x2010), *range(0x202A, 0x202F), *range(0x206A, 0x2070), 0xFEFF])
_SHORT_NAME = re.compile(r"(git|hg|svn|sl|jj)~[1-9]")  # NTFS's 8.3 alias of `.git`...


def fold(part: str) -> str:
    """One name of a path as a host that folds names opens it (``.GIT.``, ``.g\u200cit``,
    ``git~1`` and ``.git::$DATA`` are all ``.git``)."""
    part = part.translate(_IGNORED).split(":", 1)[0].rstrip(". ").lower()
    short = _SHORT_NAME.fullmatch(part)
    return f".{short[1]}" if short else part


def _parts(path: str) -> list[str]:
    return [fold(part) for part in re.split(r"[/\\]", path)]


def in_vcs_folder(path: str) -> bool:
    """Whether a workspace-relative ``path`` lies in (or is) one of ``VCS_DIRS``."""
    return any(part in VCS_DIRS for part in _parts(path))


def command_files(files: Iterable[str], folders: Iterable[str] = ()) -> set[str]:
    """Of a workspace's ``files`` (relative paths; ``folders``: its folders, empty ones
    included), those a VCS tool on the host would read as commands or follow elsewhere."""
    files = list(files)
    bare = _bare_repositories(files, folders)
    return {path for path in files if _runs_programs(_parts(path), bare)}


def _bare_repositories(files: list[str], folders: Iterable[str]) -> set[tuple[str, ...]]:
    """The folders (as folded parts; () is the root) shaped as git's bare repositories."""
    present = {tuple(_parts(f)) for f in folders}
    for path in files:
        parts = tuple(_parts(path))
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
        if part == ".sl" and len(parts) == i + 2 and parts[i + 1] in _SL_FILES:
            return True
        if part == ".jj" and _jj_hazard(parts[i + 1 :]):
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


def _jj_hazard(rest: list[str]) -> bool:
    """Whether ``rest``, a path inside a ``.jj``, is one Jujutsu reads as config or follows."""
    if not rest or rest == ["repo"] or rest[-1].endswith(".toml"):
        return True  # a `.jj` file or a `repo` file lead to another repository; *.toml are config
    return rest in (["repo", "config-id"], ["repo", "store", "git_target"])


# -- what a repository's config names in the workspace --------------------------------------

_MAX_INCLUDE_DEPTH = 10  # git's own bound on includes of includes
_HG_INCLUDE = re.compile(rb"^%include\s+(.+?)\s*$", re.MULTILINE)
# Read when git cannot be run: every `hooksPath`/`path` assignment, whatever its section (more
# than git reads, never less).
_LOOSE_GIT = re.compile(rb'(?im)\b(hookspath|path)\s*=\s*("(?:[^"\\\n]|\\.)*"|[^;#\r\n]*)')


@dataclass(frozen=True)
class Configured:
    """What the config of a workspace's repositories names as commands beside their own files:
    ``core.hooksPath`` folders (relative ones below each worktree's top) and included files
    (``include.path``, ``includeIf.*.path``, Mercurial's ``%include``). A path given absolute
    is matched by each of its tails, as the workspace may lie anywhere on the host."""

    hooks: frozenset[str] = frozenset()
    includes: frozenset[str] = frozenset()  # workspace-relative, or absolute as written

    def command_files(self, files: Iterable[str], folders: Iterable[str] = ()) -> set[str]:
        """Of ``files`` (``folders``: the workspace's folders), those in a hooks folder or included."""
        files, folders = list(files), list(folders)
        tops = _worktree_tops(files, folders)
        hooks: set[tuple[str, ...]] = set()
        for hook in self.hooks:
            if hook.startswith("/"):
                hooks.update(_tails(hook))
                continue
            for top in tops:
                inside = _inside("/".join((*top, hook)))
                if inside is not None:
                    hooks.add(inside)
        included = {tail for path in self.includes for tail in _tails(path)}
        out = set()
        for path in files:
            parts = tuple(_parts(path))
            if parts in included or any(parts[:i] in hooks for i in range(len(parts))):
                out.add(path)
        return out


def configured(
    read: Callable[[str], bytes | None], files: Iterable[str], folders: Iterable[str] = ()
) -> Configured:
    """What the config files among a workspace's ``files`` (``read``: a file's content, None when
    there is none) name as commands, their includes followed inside the workspace."""
    files = list(files)
    by_name = {tuple(_parts(path)): path for path in files}
    hooks: set[str] = set()
    includes: set[str] = set()
    todo = [(path, kind, 0) for path in sorted(command_files(files, folders)) if (kind := _config_kind(path))]
    seen: set[str] = set()
    while todo:
        path, kind, depth = todo.pop()
        content = read(path) if path not in seen and depth <= _MAX_INCLUDE_DEPTH else None
        seen.add(path)
        if content is None:
            continue
        if kind == "git":
            found_hooks, targets = _git_settings(content)
            hooks.update(h for h in found_hooks if h and not h.startswith("~"))
        else:
            targets = _hg_includes(content)
        for target in targets:
            if not target or target.startswith("~") or "$" in target:
                continue  # the host user's home or environment: not the workspace's
            inside = _inside(posixpath.join(posixpath.dirname(path), target))
            name = target if target.startswith("/") else None if inside is None else "/".join(inside)
            if name is not None:
                includes.add(name)
                # an included file is read as the file including it is
                todo.append((by_name.get(tuple(_parts(name)), name), kind, depth + 1))
    return Configured(hooks=frozenset(hooks), includes=frozenset(includes))


def _config_kind(path: str) -> str:
    """``git`` or ``hg`` for a repository's own config file (one ``command_files`` names), else ``""``."""
    parts = _parts(path)
    if len(parts) >= 2 and parts[-2] in (".hg", ".sl"):
        return "hg" if parts[-1] in ("hgrc", "hgrc-not-shared", "config", "config-not-shared") else ""
    return "git" if parts[-1] in ("config", "config.worktree") and ".jj" not in parts else ""


def _git_settings(content: bytes) -> tuple[list[str], list[str]]:
    """The ``core.hooksPath`` values and the include paths of a git config file, read by git
    itself (its includes left to the caller: they are the workspace's files, or not)."""
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_DIR": os.devnull,  # no repository found around the working folder
        "LC_ALL": "C",
    }
    try:
        listed = subprocess.run(
            ["git", "config", "--no-includes", "--file", "-", "--null", "--list"],
            input=content, capture_output=True, env=env, cwd="/", timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):  # no git here (a copy may reach one) or a bad file
        found = [(key.decode().lower(), _unquote(value)) for key, value in _LOOSE_GIT.findall(content)]
        return [v for k, v in found if k == "hookspath"], [v for k, v in found if k == "path"]
    hooks, includes = [], []
    for entry in listed.split(b"\0"):
        key, _, value = entry.decode("utf-8", "surrogateescape").partition("\n")
        if key == "core.hookspath":
            hooks.append(value)
        elif key == "include.path" or (key.startswith("includeif.") and key.endswith(".path")):
            includes.append(value)
    return hooks, includes


def _unquote(value: bytes) -> str:
    text = value.decode("utf-8", "surrogateescape").strip()
    return re.sub(r"\\(.)", r"\1", text[1:-1]) if text.startswith('"') and text.endswith('"') else text


def _hg_includes(content: bytes) -> list[str]:
    return [m.decode("utf-8", "surrogateescape") for m in _HG_INCLUDE.findall(content)]


def _inside(path: str) -> tuple[str, ...] | None:
    """A workspace-relative ``path`` normalised (folded parts); None when it leaves the workspace."""
    norm = posixpath.normpath(path)
    if norm.startswith("/") or norm == ".." or norm.startswith("../"):
        return None
    return () if norm == "." else tuple(_parts(norm))


def _tails(path: str) -> set[tuple[str, ...]]:
    """A path's folded parts and, given absolute, each of its tails (the workspace may be any)."""
    if not path.startswith("/"):
        return {tuple(_parts(path))}
    parts = tuple(_parts(posixpath.normpath(path).lstrip("/")))
    return {parts[i:] for i in range(len(parts)) if parts[i:] != ("",)}


def _worktree_tops(files: list[str], folders: list[str]) -> set[tuple[str, ...]]:
    """The folders git runs a repository's hooks from: each holding a ``.git``, and each bare one."""
    tops = _bare_repositories(files, folders)
    for path in (*files, *folders):
        parts = tuple(_parts(path))
        tops.update(parts[:i] for i, part in enumerate(parts) if part == ".git")
    return tops
