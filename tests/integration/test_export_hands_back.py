"""What a run's workspace, written back on the host, leaves out: a repository's files that make
git run programs (planted by the run's code at any depth, or changed from the seed's), and the
changes the policy does not let the run write; each named. The rest, an agent's commits with it,
comes back. A real run on the process tier, exported by ``stockade runs workspace``."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stockade.assembly import AgentConfig, build_agent
from stockade.cli.main import app
from stockade.models import ScriptedModel, tool_call
from tests.conftest import require, require_tier

POLICY = """\
version = 1
[trust]
level = "trusted"
[paths]
read = ["**"]
write = ["**"]
deny = [".git/**", "secrets/**"]
[models]
approved = ["scripted:*"]
"""

# What the run's code does: plants a repository whose config runs a command (at the top, where
# the policy's `.git/**` does not reach a workspace that had none, and in a subfolder, which it
# never reaches), and writes where the policy does not let it.
PLANT = """\
import os
for repo in ('.git', 'sub/.git'):
    os.makedirs(repo + '/objects', exist_ok=True)
    os.makedirs(repo + '/refs/heads', exist_ok=True)
    open(repo + '/HEAD', 'w').write('ref: refs/heads/main\\n')
    open(repo + '/config', 'w').write('[core]\\n\\tfsmonitor = "touch {marker}; false"\\n')
os.makedirs('secrets', exist_ok=True)
open('secrets/token', 'w').write('planted\\n')
open('notes.txt', 'w').write('kept\\n')
"""


def run_and_export(tmp_path: Path, workspace: Path, code: str, policy: str = POLICY) -> tuple[Path, str]:
    """Run ``code`` in a real sandbox seeded with ``workspace``; export what it left."""
    (tmp_path / "policy.toml").write_text(policy)
    model = ScriptedModel([tool_call("run_code", {"language": "python", "code": code}), "done"])
    config = AgentConfig(
        model=model,
        policy=tmp_path / "policy.toml",
        tier="process",
        audit=f"sqlite:///{tmp_path / 'audit.db'}",
        approval_dir=tmp_path / "approvals",
    )
    with build_agent(config) as agent:
        agent.run_sync("work", workspace=str(workspace), run_id="planted")
    dest = tmp_path / "export"
    db = f"sqlite:///{tmp_path / 'audit.db'}"
    exported = CliRunner().invoke(app, ["runs", "workspace", "planted", str(dest), "--db", db])
    assert exported.exit_code == 0, exported.output
    return dest, exported.output


def git_status(folder: Path) -> None:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run(["git", "status"], cwd=folder, env=env, capture_output=True, check=False)


@pytest.mark.process
def test_a_planted_repository_config_never_reaches_the_host(tmp_path: Path) -> None:
    require_tier("process")
    require("git", shutil.which("git") is not None, "git is not installed on this host")
    workspace = tmp_path / "ws"
    (workspace / "sub").mkdir(parents=True)
    marker = tmp_path / "ran"
    dest, output = run_and_export(tmp_path, workspace, PLANT.format(marker=marker))
    assert (dest / "notes.txt").read_text() == "kept\n"
    assert not (dest / ".git/config").exists() and not (dest / "sub/.git/config").exists()
    assert (dest / "sub/.git/HEAD").exists()  # the rest of the repository comes back
    assert not (dest / "secrets/token").exists()
    said = " ".join(output.split())
    assert "'.git/config'" in said and "'sub/.git/config'" in said
    assert "policy does not let the run write there): '.git/HEAD', 'secrets/token'" in said
    git_status(dest)
    git_status(dest / "sub")
    assert not marker.exists()


@pytest.mark.process
def test_a_seed_repository_keeps_its_own_config_but_not_a_hook_code_added(tmp_path: Path) -> None:
    require_tier("process")
    require("git", shutil.which("git") is not None, "git is not installed on this host")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run(["git", "init", "-q", str(workspace)], env=env, check=True)
    config = (workspace / ".git/config").read_bytes()
    hook = (
        "import os\n"
        "open('.git/hooks/post-checkout', 'w').write('#!/bin/sh\\ntouch ran\\n')\n"
        "os.chmod('.git/hooks/post-checkout', 0o755)\n"
    )
    # a policy that hides a path keeps the repository out of the sandbox: one that hides none
    everything = POLICY.replace('deny = [".git/**", "secrets/**"]\n', "")
    dest, output = run_and_export(tmp_path, workspace, hook, everything)
    assert (dest / ".git/config").read_bytes() == config, output  # byte for byte the seed's: kept
    assert not (dest / ".git/hooks/post-checkout").exists()
    assert "'.git/hooks/post-checkout'" in " ".join(output.split())


# What the run's code does in a husky repository: writes the hooks git runs from its
# `core.hooksPath`, a git-ignored folder in the worktree (`git status` shows nothing there).
HUSKY = """\
import os
for hook in ('pre-commit', 'post-checkout'):
    open('.husky/_/' + hook, 'w').write('#!/bin/sh\\ntouch {marker}\\n')
    os.chmod('.husky/_/' + hook, 0o755)
open('a.txt', 'a').write('b\\n')
"""


@pytest.mark.process
def test_hooks_planted_where_the_seeds_hooks_path_points_never_reach_the_host(tmp_path: Path) -> None:
    require_tier("process")
    require("git", shutil.which("git") is not None, "git is not installed on this host")
    workspace = tmp_path / "ws"
    (workspace / ".husky/_").mkdir(parents=True)
    (workspace / ".husky/_/.gitignore").write_text("*\n")
    (workspace / "a.txt").write_text("a\n")
    env = {
        **os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@example.com",
        "GIT_COMMITTER_NAME": "a", "GIT_COMMITTER_EMAIL": "a@example.com",
    }  # fmt: skip

    def git(folder: Path, *args: str) -> None:
        subprocess.run(["git", *args], cwd=folder, env=env, capture_output=True, check=True)

    git(workspace, "init", "-q")
    git(workspace, "config", "core.hooksPath", ".husky/_")
    git(workspace, "add", "-A")
    git(workspace, "commit", "-qm", "start")
    marker = tmp_path / "ran"
    everything = POLICY.replace('deny = [".git/**", "secrets/**"]\n', "")
    dest, output = run_and_export(tmp_path, workspace, HUSKY.format(marker=marker), everything)
    git(dest, "commit", "-qam", "the run's change")
    git(dest, "checkout", "-q", "-b", "review")
    assert not marker.exists()
    assert "'.husky/_/post-checkout', '.husky/_/pre-commit'" in " ".join(output.split())
    assert (dest / "a.txt").read_text() == "a\nb\n" and (dest / ".husky/_/.gitignore").exists()
