"""Which of a workspace's files a copy on the host leaves out: those git, Mercurial, Sapling or
Jujutsu reads as commands or follows elsewhere (and what the seed's own config names so: its
hooks folder, its includes), at any depth and under any name a host opens as theirs, unless the
run started with them byte for byte and executable or not as they were."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from stockade._vcs import command_files, configured
from stockade.runs.handback import FileState, SeedFiles, prune_folder, withheld
from stockade.runs.seeds import pack_workspace, seed_files

GIT_ENV = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def state(digest: str, executable: bool = False) -> FileState:
    return FileState(digest * 64, executable)


def test_a_repositorys_command_files_are_found_at_any_depth_and_in_any_case() -> None:
    files = [
        ".git/config", ".git/HEAD", ".git/objects/ab/cdef", ".git/refs/heads/main", ".git/index",
        ".git/hooks/pre-commit", "sub/.git", "deep/er/.GIT/Config", ".git/info/attributes",
        ".git/info/exclude", ".git/modules/lib/x/config", ".git/modules/lib/x/HEAD",
        ".git/worktrees/w/commondir", ".git/objects/info/alternates", ".git/rebase-merge/git-rebase-todo",
        ".hg/hgrc", "vendor/.hg/sharedpath", ".hg/store/data/a.i", "src/config", "docs/hooks/a.md",
    ]  # fmt: skip
    assert command_files(files) == {
        ".git/config", ".git/hooks/pre-commit", "sub/.git", "deep/er/.GIT/Config", ".git/info/attributes",
        ".git/modules/lib/x/config", ".git/worktrees/w/commondir", ".git/objects/info/alternates",
        ".git/rebase-merge/git-rebase-todo", ".hg/hgrc", "vendor/.hg/sharedpath",
    }  # fmt: skip


def test_a_folder_shaped_as_a_bare_repository_is_one() -> None:
    """git takes a folder with HEAD beside objects/ and refs/ for a bare repository, whatever its name."""
    files = ["pkg/HEAD", "pkg/config", "pkg/refs/heads/main", "pkg/hooks/post-merge", "other/config"]
    assert command_files(files, ["pkg/objects"]) == {"pkg/config", "pkg/hooks/post-merge"}


def test_the_seeds_own_command_files_come_back_and_a_changed_one_does_not() -> None:
    files = {".git/config": state("a"), ".git/hooks/pre-push": state("b"), ".env": state("c")}
    seed = SeedFiles({".git/config": state("a"), ".git/hooks/pre-push": state("0")})
    out = withheld(files, [], seed=seed, keep=lambda path: path != ".env")
    assert out.commands == (".git/hooks/pre-push",) and out.refused == (".env",)


def test_a_downloaded_folder_is_pruned_and_a_link_named_git_with_it(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub/.git").symlink_to(tmp_path)  # followed by git, never by the prune
    (tmp_path / ".git/hooks").mkdir(parents=True)
    (tmp_path / ".git/hooks/post-checkout").write_text("#!/bin/sh\n")
    (tmp_path / "kept.py").write_text("x\n")
    out = prune_folder(tmp_path, seed=SeedFiles(), keep=None)
    assert out.commands == (".git/hooks/post-checkout", "sub/.git")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        ".git", ".git/hooks", "kept.py", "sub",
    ]  # fmt: skip


def test_names_a_host_opens_as_a_repositorys_are_one() -> None:
    """Windows drops trailing dots and spaces and reads `git~1` as `.git`'s short name; macOS
    ignores zero-width joiners and direction marks; `\\` parts a path on Windows."""
    files = [
        ".git./config", ".git /config", ".g\u200cit/config", "GIT~1/config", "x/.GIT/config",
        ".git/hooks./pre-commit", ".git::$INDEX_ALLOCATION/config", "a\\.git\\config",
        ".jj/repo/config.toml", ".jj/repo", ".jj/working_copy/tree_state", ".sl/config",
        "git~1.txt", ".gitignore", ".github/config",
    ]  # fmt: skip
    assert command_files(files) == set(files) - {
        ".jj/working_copy/tree_state",
        "git~1.txt",
        ".gitignore",
        ".github/config",
    }


def test_making_a_seed_hook_executable_is_a_change() -> None:
    """A hook the seed held disabled (not executable) comes back only as it was."""
    seed = SeedFiles({".git/hooks/pre-commit": state("a"), "run.sh": state("b")})
    files = {".git/hooks/pre-commit": state("a", executable=True), "run.sh": state("b", executable=True)}
    assert withheld(files, [], seed=seed, keep=None).commands == (".git/hooks/pre-commit",)


def test_a_seed_hook_made_executable_is_pruned(tmp_path: Path) -> None:
    hook = tmp_path / ".git/hooks/pre-commit"
    hook.parent.mkdir(parents=True)
    hook.write_text("#!/bin/sh\n")
    hook.chmod(0o644)
    seed = seed_files(pack_workspace(tmp_path).data)
    assert prune_folder(tmp_path, seed=seed, keep=None).commands == ()
    hook.chmod(0o755)
    assert prune_folder(tmp_path, seed=seed, keep=None).commands == (".git/hooks/pre-commit",)
    assert not hook.exists()


def seed_repository(tmp_path: Path, *settings: tuple[str, str]) -> SeedFiles:
    """A workspace holding a git repository whose config sets ``settings``, packed as a seed."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], env=GIT_ENV, check=True)
    for key, value in settings:
        subprocess.run(["git", "-C", str(tmp_path), "config", "--add", key, value], env=GIT_ENV, check=True)
    return seed_files(pack_workspace(tmp_path).data)


def test_the_seeds_hooks_path_is_a_hooks_folder(tmp_path: Path) -> None:
    """husky's `core.hooksPath = .husky/_` (a git-ignored folder): what git runs on a commit."""
    seed = seed_repository(tmp_path, ("core.hooksPath", ".husky/_"))
    files = {
        ".husky/_/pre-commit": state("a", True),
        ".husky/_/h": state("b"),
        ".husky/pre-commit": state("c"),
    }
    folders = [".git", ".husky", ".husky/_"]
    assert withheld(files, folders, seed=seed, keep=None).commands == (".husky/_/h", ".husky/_/pre-commit")


def test_an_absolute_hooks_path_is_matched_wherever_the_workspace_lies(tmp_path: Path) -> None:
    seed = seed_repository(tmp_path, ("core.hooksPath", str(tmp_path / "tools/hooks")))
    files = {"tools/hooks/post-checkout": state("a", True), "tools/build.sh": state("b")}
    assert withheld(files, [".git"], seed=seed, keep=None).commands == ("tools/hooks/post-checkout",)


def test_a_file_the_seeds_config_includes_is_a_config_file(tmp_path: Path) -> None:
    """`include.path = ../.gitconfig` makes a worktree file git config, and so does includeIf;
    an include in it is followed too."""
    (tmp_path / ".gitconfig").write_text("[include]\n\tpath = team.inc\n")
    seed = seed_repository(
        tmp_path, ("include.path", "../.gitconfig"), ("includeIf.onbranch:main.path", "../local.cfg")
    )
    assert seed.configured.includes == {".gitconfig", "local.cfg", "team.inc"}
    files = {
        ".gitconfig": seed.files[".gitconfig"],
        "local.cfg": state("a"),
        "team.inc": state("b"),
        "README": state("c"),
    }
    assert withheld(files, [".git"], seed=seed, keep=None).commands == ("local.cfg", "team.inc")


def test_a_config_git_cannot_read_is_read_loosely_for_paths() -> None:
    """A config git refuses is read for every `hooksPath`/`path` it holds, whatever the section."""
    config = b'[core]\n\thooksPath = "hooks dir" ; why\n[include]\n\tpath = ../x.cfg\n[bad\n'
    found = configured({".git/config": config}.get, [".git/config"])
    assert found.hooks == {"hooks dir"} and found.includes == {"x.cfg"}


def test_a_mercurial_include_is_a_config_file() -> None:
    found = configured({".hg/hgrc": b"%include ../shared.rc\n[ui]\nusername = a\n"}.get, [".hg/hgrc"])
    assert found.command_files(["shared.rc", "other.rc"]) == {"shared.rc"}


def test_a_seed_records_each_files_executable_bit(tmp_path: Path) -> None:
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    (tmp_path / "notes").write_text("n\n")
    files = seed_files(pack_workspace(tmp_path).data).files
    assert files["run.sh"].executable and not files["notes"].executable
