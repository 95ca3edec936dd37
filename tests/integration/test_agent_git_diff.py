"""git_diff on the real process tier: `git diff HEAD` semantics in a repository, the run's
baseline elsewhere, and the repository's index left as it was."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from stockade import Sandbox
from stockade.tools import ToolContext, git_diff
from stockade.tools.workspace_diff import record_baseline
from tests.conftest import require, require_tier

pytestmark = pytest.mark.process


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def _committed(tmp_path: Path, files: dict[str, str]) -> Path:
    """A repository of ``files``, committed (on a host with git and the process tier)."""
    require_tier("process")
    require("git", shutil.which("git") is not None, "git is not installed on this host")
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    for name, text in files.items():
        (repo / name).write_text(text)
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "init")
    return repo


async def _git_diff(sbx: Sandbox) -> str:
    return str(await git_diff.invoke(ToolContext(sandbox=sbx), git_diff.validate({})))


async def test_in_a_git_repository_git_diff_compares_with_head(tmp_path: Path) -> None:
    repo = _committed(tmp_path, {"app.py": "x = 1\n", "old.txt": "before the run\n", ".gitignore": "*.log\n"})
    (repo / "old.txt").write_text("changed before the run\n")  # HEAD sees this; a baseline would not
    with Sandbox.create(tier="process", workspace=repo) as sbx:
        record_baseline(sbx)
        sbx.files.write("app.py", "x = 2\n")
        sbx.files.write("new.py", "print('new')\n")
        sbx.files.write("debug.log", "ignored\n")
        out = await _git_diff(sbx)
        assert out.startswith("(git diff HEAD; untracked files shown as new)\n")
        assert "-x = 1\n+x = 2\n" in out
        assert "+changed before the run\n" in out
        assert "+++ b/new.py" in out and "+print('new')" in out
        assert "debug.log" not in out and ".stockade" not in out
        status = sbx.commands.run("git -c safe.directory=* diff --cached --name-only")
        assert status.exit_code == 0 and status.stdout == ""  # the index is untouched


async def test_outside_a_repository_git_diff_compares_with_the_runs_baseline(tmp_path: Path) -> None:
    require_tier("process")
    (tmp_path / "app.py").write_text("x = 1\n")
    with Sandbox.create(tier="process", workspace=tmp_path) as sbx:
        record_baseline(sbx)
        sbx.files.write("app.py", "x = 2\n")
        out = await _git_diff(sbx)
    assert out.startswith("(changes since the run began; not a git repository)\n--- a/app.py")


async def test_git_diff_runs_no_diff_driver_the_code_planted(tmp_path: Path) -> None:
    """A low-risk call runs no command the code chose: code wrote a textconv driver into
    $HOME/.gitconfig (HOME is /tmp) and named it in .gitattributes; git_diff ran it at
    every call (it could forge the diff, and ran as a read under a policy that asks a human
    before writes)."""
    repo = _committed(tmp_path, {"app.py": "x = 1\n"})
    with Sandbox.create(tier="process", workspace=repo) as sbx:
        planted = sbx.commands.run(
            'printf \'[diff "pwn"]\\n\\ttextconv = sh -c "touch /workspace/ran; echo FORGED"\\n'
            '[diff]\\n\\texternal = sh -c "touch /workspace/ran"\\n\' > /tmp/.gitconfig'
            " && echo '* diff=pwn' > .gitattributes && echo 'x = 2' > app.py"
        )
        assert planted.exit_code == 0, planted.stderr
        out = await _git_diff(sbx)
        assert "-x = 1\n+x = 2\n" in out and "FORGED" not in out
        assert not sbx.files.exists("ran")
