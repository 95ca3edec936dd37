"""Which of a workspace's files a copy on the host leaves out: those git or Mercurial reads as
commands or follows elsewhere, at any depth, unless the run started with them byte for byte."""

from __future__ import annotations

from pathlib import Path

from stockade._vcs import command_files
from stockade.runs.handback import prune_folder, withheld


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
    files = {".git/config": "a" * 64, ".git/hooks/pre-push": "b" * 64, ".env": "c" * 64}
    seed = {".git/config": "a" * 64, ".git/hooks/pre-push": "0" * 64}
    out = withheld(files, [], seed=seed, keep=lambda path: path != ".env")
    assert out.commands == (".git/hooks/pre-push",) and out.refused == (".env",)


def test_a_downloaded_folder_is_pruned_and_a_link_named_git_with_it(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub/.git").symlink_to(tmp_path)  # followed by git, never by the prune
    (tmp_path / ".git/hooks").mkdir(parents=True)
    (tmp_path / ".git/hooks/post-checkout").write_text("#!/bin/sh\n")
    (tmp_path / "kept.py").write_text("x\n")
    out = prune_folder(tmp_path, seed={}, keep=None)
    assert out.commands == (".git/hooks/post-checkout", "sub/.git")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        ".git", ".git/hooks", "kept.py", "sub",
    ]  # fmt: skip
