"""git_diff on the real process tier: `git diff HEAD` semantics in the repository the run began
in where code cannot change its .git, the run's baseline elsewhere, and the repository's index
left as it was."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from stockade import Sandbox
from stockade.agent import Agent
from stockade.testing import ScriptedModel, tool_call
from stockade.tools import ToolContext, Toolset, git_diff, read_file
from stockade.tools.githead import GIT_HEAD_DIFF
from stockade.tools.workspace_diff import record_baseline
from stockade.types import SandboxRules
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
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "init")
    return repo


# Code may write src/ alone: .git (and the workspace's root) are read-only to it, by the kernel.
SRC_ONLY = SandboxRules(write=("src/**",))


async def _git_diff(sbx: Sandbox, baseline: str | None) -> str:
    ctx = ToolContext(sandbox=sbx, baseline=baseline)
    return str(await git_diff.invoke(ctx, git_diff.validate({})))


async def test_in_a_git_repository_git_diff_compares_with_head(tmp_path: Path) -> None:
    repo = _committed(
        tmp_path, {"src/app.py": "x = 1\n", "old.txt": "before the run\n", ".gitignore": "*.log\n"}
    )
    (repo / "old.txt").write_text("changed before the run\n")  # HEAD sees this; a baseline would not
    with Sandbox.create(tier="process", workspace=repo, rules=SRC_ONLY) as sbx:
        baseline = record_baseline(sbx)
        sbx.files.write("src/app.py", "x = 2\n")
        sbx.files.write("src/new.py", "print('new')\n")
        sbx.files.write("src/debug.log", "ignored\n")
        out = await _git_diff(sbx, baseline)
        assert out.startswith("(git diff HEAD; untracked files shown as new)\n")
        assert "-x = 1\n+x = 2\n" in out
        assert "+changed before the run\n" in out
        assert "+++ b/src/new.py" in out and "+print('new')" in out
        assert "debug.log" not in out and ".stockade" not in out
        status = sbx.commands.run("git -c safe.directory=* diff --cached --name-only")
        assert status.exit_code == 0 and status.stdout == ""  # the index is untouched


async def test_outside_a_repository_git_diff_compares_with_the_runs_baseline(tmp_path: Path) -> None:
    require_tier("process")
    (tmp_path / "app.py").write_text("x = 1\n")
    with Sandbox.create(tier="process", workspace=tmp_path) as sbx:
        baseline = record_baseline(sbx)
        sbx.files.write("app.py", "x = 2\n")
        out = await _git_diff(sbx, baseline)
    assert out.startswith("(changes since the run began; not a git repository)\n--- a/app.py")


async def test_git_diff_runs_no_diff_driver_the_code_planted(tmp_path: Path) -> None:
    """A low-risk call runs no command the code chose: code wrote a textconv driver into
    $HOME/.gitconfig (HOME is /tmp) and named it in .gitattributes; git_diff ran it at
    every call (it could forge the diff, and ran as a read under a policy that asks a human
    before writes)."""
    repo = _committed(tmp_path, {"src/app.py": "x = 1\n"})
    with Sandbox.create(tier="process", workspace=repo, rules=SRC_ONLY) as sbx:
        baseline = record_baseline(sbx)
        planted = sbx.commands.run(
            'printf \'[diff "pwn"]\\n\\ttextconv = sh -c "touch /workspace/src/ran; echo FORGED"\\n'
            '[diff]\\n\\texternal = sh -c "touch /workspace/src/ran"\\n\' > /tmp/.gitconfig'
            " && echo '* diff=pwn' > src/.gitattributes && echo 'x = 2' > src/app.py"
        )
        assert planted.exit_code == 0, planted.stderr
        out = await _git_diff(sbx, baseline)
        assert out.startswith("(git diff HEAD;") and "-x = 1\n+x = 2\n" in out and "FORGED" not in out
        assert not sbx.files.exists("src/ran")


PLANT_FILTER = """
set -e
git init -q .
git -c user.email=a@b -c user.name=a add app.py
git -c user.email=a@b -c user.name=a commit -qm one
echo 'x = 2' >> app.py
printf '[filter "x"]\\n\\tclean = ./f.sh\\n' >> .git/config
printf '#!/bin/sh\\ntouch ran\\ncat\\n' > f.sh && chmod +x f.sh
echo '* filter=x' > .gitattributes
"""


def test_git_diff_runs_no_filter_of_a_repository_code_made(tmp_path: Path) -> None:
    """Under `write = ["**"]` with `.git` kept out of the seed, code made a repository, named a
    clean filter of its own in .git/config and .gitattributes, and git_diff (low risk: a read,
    past approvals of code, run again on a resume) ran it. git runs only on the repository the
    run began in, where code cannot change .git; here the diff is against the run's start."""
    require_tier("process")
    require("git", shutil.which("git") is not None, "git is not installed on this host")
    (tmp_path / "app.py").write_text("x = 1\n")
    model = ScriptedModel(
        [tool_call("run_code", {"language": "bash", "code": PLANT_FILTER}), tool_call("git_diff"), "done"]
    )
    rules = SandboxRules(write=("**",), hide=(".git/**", "secrets/**", ".env"))
    with Sandbox.create(tier="process", workspace=tmp_path, rules=rules) as sbx:
        result = Agent(model).run_sync("go", sandbox=sbx)
        ran = sbx.files.exists("ran")
    planted, shown = (step.tool_calls[0] for step in result.steps[:2])
    assert not planted.is_error, planted.observation
    assert not ran, "the filter code planted ran in git_diff"
    assert shown.observation.startswith("(changes since the run began; not a git repository)\n")
    assert "+x = 2" in shown.observation


async def test_git_diff_in_a_repository_code_may_write_is_against_the_runs_start(tmp_path: Path) -> None:
    """A repository the run began in, but with .git among what code may write (`write =
    ["**"]`): a filter code names in .git/config would run, so git does not."""
    repo = _committed(tmp_path, {"app.py": "x = 1\n"})
    with Sandbox.create(tier="process", workspace=repo, rules=SandboxRules(write=("**",))) as sbx:
        baseline = record_baseline(sbx)
        planted = sbx.commands.run(
            "printf '[filter \"x\"]\\n\\tclean = ./f.sh\\n' >> .git/config"
            " && printf '#!/bin/sh\\ntouch ran\\ncat\\n' > f.sh && chmod +x f.sh"
            " && echo '* filter=x' > .gitattributes && echo 'x = 2' > app.py"
        )
        assert planted.exit_code == 0, planted.stderr
        out = await _git_diff(sbx, baseline)
        assert not sbx.files.exists("ran")
    assert out.startswith("(changes since the run began; not a git repository)\n")
    assert "-x = 1\n+x = 2\n" in out


# A program in the uploaded repository's .git: it marks that it ran, and passes its input on.
MARK = "#!/bin/sh\ntouch src/ran\nexec cat\n"
# What a caller's .git may say to have git run it, each with what assigns it to every file.
PLANTED = {
    "clean filter": ('[filter "x"]\n\tclean = .git/mark.sh\n', "* filter=x\n"),
    "process filter": ('[filter "x"]\n\tprocess = .git/mark.sh\n', "* filter=x\n"),
    "fsmonitor": ("[core]\n\tfsmonitor = .git/mark.sh\n", ""),
    # the filter in a workspace file the repository's config includes
    "include.path": ("[include]\n\tpath = ../filters.cfg\n", "* filter=x\n"),
}


def _uploaded(tmp_path: Path, config: str, attributes: str) -> Path:
    """A repository as a caller uploads it: committed, a tracked file changed since, and its
    .git naming a program (``config``) that ``attributes`` (.git/info/attributes) assigns."""
    repo = _committed(
        tmp_path,
        {
            "README": "read me\n",
            "src/app.py": "x = 1\n",
            "filters.cfg": '[filter "x"]\n\tclean = .git/mark.sh\n',
        },
    )
    (repo / "README").write_text("read me\nchanged before the run\n")  # git hashes it: a filter runs
    (repo / ".git" / "mark.sh").write_text(MARK)
    (repo / ".git" / "mark.sh").chmod(0o755)
    with (repo / ".git" / "config").open("a") as config_file:
        config_file.write(config)
    (repo / ".git" / "info").mkdir(exist_ok=True)
    (repo / ".git" / "info" / "attributes").write_text(attributes)
    return repo


@pytest.mark.parametrize("planted", sorted(PLANTED))
async def test_git_diff_runs_no_program_the_repositorys_git_names(tmp_path: Path, planted: str) -> None:
    """git_diff (low risk: a read) runs no program but git, whatever the repository's .git
    says. Over the service the .git is the caller's upload: a clean filter its .git/config
    named and .git/info/attributes assigned ran in each git_diff, for a role that runs no
    code, rewriting a file that role could only read. git reads no config of the .git at all,
    so a filter, a process filter, an fsmonitor hook, or config included from elsewhere, all
    alike, name nothing that runs; the diff is still git's, against HEAD."""
    repo = _uploaded(tmp_path, *PLANTED[planted])
    with Sandbox.create(tier="process", workspace=repo, rules=SRC_ONLY) as sbx:
        baseline = record_baseline(sbx)
        sbx.files.write("src/app.py", "x = 2\n")
        out = await _git_diff(sbx, baseline)
        ran = sbx.files.exists("src/ran")
    assert not ran, f"the {planted} the repository named ran in git_diff"
    assert out.startswith("(git diff HEAD; untracked files shown as new)\n"), out
    assert " read me\n+changed before the run\n" in out and "-x = 1\n+x = 2\n" in out


def test_git_diffs_command_execs_git_and_what_sets_up_its_git_dir_alone(tmp_path: Path) -> None:
    """What the sandbox's exec judge saw of git_diff's command (a deny list makes it judge
    every exec): its shell, the few tools that make git's own GIT_DIR, git and xargs; the
    filter the uploaded .git named is not among them."""
    repo = _uploaded(tmp_path, *PLANTED["clean filter"])
    judged = SandboxRules(write=("src/**",), deny=("id",))
    with Sandbox.create(tier="process", workspace=repo, rules=judged) as sbx:
        result = sbx.commands.run(GIT_HEAD_DIFF)
    assert result.exit_code == 0, result.stderr
    programs = [Path(e.argv[0]).name for e in result.execs]
    assert programs.count("sh") == 1 and "git" in programs, programs
    assert set(programs) <= {"sh", "mktemp", "cp", "mkdir", "git", "xargs", "rm"}, programs


def test_a_reader_agents_git_diff_runs_no_filter_of_an_uploaded_repository(tmp_path: Path) -> None:
    """The finding as a run: an agent that may only read (read_file, git_diff) calls git_diff
    in a workspace whose .git names a clean filter; the run ends with the filter not run and
    the diff against HEAD shown."""
    repo = _uploaded(tmp_path, *PLANTED["clean filter"])
    model = ScriptedModel([tool_call("git_diff"), "done"])
    with Sandbox.create(tier="process", workspace=repo, rules=SRC_ONLY) as sbx:
        result = Agent(model, tools=Toolset([read_file, git_diff])).run_sync("review", sandbox=sbx)
        ran = sbx.files.exists("src/ran")
    shown = result.steps[0].tool_calls[0]
    assert not ran, "the clean filter the repository named ran in git_diff"
    assert not shown.is_error and shown.observation.startswith("(git diff HEAD;"), shown.observation
    assert "+changed before the run" in shown.observation


async def test_links_and_fifos_code_made_are_named_as_left_out(tmp_path: Path) -> None:
    """A link or FIFO code made was missing from the diff without a word: a patch carries
    none, so they are named at its end, as files the policy keeps out are."""
    require_tier("process")
    (tmp_path / "app.py").write_text("x = 1\n")
    (tmp_path / "old-link").symlink_to("app.py")  # there from the start: not the run's doing
    with Sandbox.create(tier="process", workspace=tmp_path) as sbx:
        baseline = record_baseline(sbx)
        made = sbx.commands.run("ln -s app.py link && mkfifo pipe && echo 'x = 2' > app.py")
        assert made.exit_code == 0, made.stderr
        out = await _git_diff(sbx, baseline)
    assert "-x = 1\n+x = 2\n" in out
    assert out.endswith(
        "Left out (links, FIFOs or sockets made during the run: a patch carries none): 'link', 'pipe'\n"
    )
