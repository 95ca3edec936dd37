"""What ``git_diff`` asks git, and when: the script that diffs the workspace against git HEAD
without reading the workspace's .git as a repository (``GIT_HEAD_DIFF``), and whether that
.git is the project's and not code's (``git_is_the_projects``). Apart from the tool: what git
may run, and what it is kept from, is a concern of its own.
"""

from __future__ import annotations

from stockade.exceptions import LimitNotEnforceable
from stockade.sandbox._rules import write_targets
from stockade.sandbox._supervised_config import WORKSPACE
from stockade.sandbox.facade import Sandbox
from stockade.tools.base import ToolContext
from stockade.tools.workspace_diff import started_in_repository
from stockade.types import Mechanism

__all__ = ["GIT_HEAD_DIFF", "GIT_TIMEOUT_S", "git_head_diff", "git_is_the_projects"]

# `git diff HEAD`, plus untracked (not ignored) files as new ones, without touching the index;
# the run's own records (.stockade/) are left out.
# Exit 97-99: no git, not a repository, no commit yet; the tool then diffs against the baseline.
# A low-risk call runs no program but git, whatever the repository says. Every program git may
# run (a filter's clean, smudge or process, core.fsmonitor, a textconv or external diff, a
# pager, hooks) is named by configuration, and `include.path`, `includeIf` and `info/attributes`
# pull more of it from .git: a list of keys to turn off misses the next one (a clean filter in
# .git/config, assigned in .git/info/attributes, ran in each git_diff of an uploaded
# workspace, as a read past approvals and past a role that runs no code). So git never reads
# the workspace's .git as a repository: it runs under a fresh GIT_DIR of its own (mktemp) that
# holds a copy of HEAD and the refs (data git resolves, nothing it runs), the workspace's
# objects (GIT_OBJECT_DIRECTORY: data too) and an index read from HEAD's tree, and no config,
# hooks or info/attributes; global and system configuration are off, and so no program can be
# named anywhere git looks. What is left (--no-ext-diff, --no-textconv, no fsmonitor, the empty
# tree as attr.tree on git >= 2.42, no look into submodules) keeps the work tree's own
# .gitattributes from changing what the diff shows. A .git git cannot read this way (a
# linked worktree's file, sha256 or reftable) is no repository here: the baseline's diff.
_EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
_GIT = (
    "git --no-pager -c safe.directory=* -c core.fsmonitor=false -c core.quotepath=off"
    f" -c core.attributesFile=/dev/null -c attr.tree={_EMPTY_TREE}"
)
_DIFF = "diff --no-color --no-ext-diff --no-textconv"
GIT_HEAD_DIFF = f"""\
export GIT_CONFIG_GLOBAL=/dev/null GIT_CONFIG_NOSYSTEM=1 GIT_ATTR_NOSYSTEM=1 GIT_PAGER=cat PAGER=cat
unset GIT_CONFIG GIT_CONFIG_COUNT GIT_CONFIG_PARAMETERS GIT_COMMON_DIR GIT_INDEX_FILE GIT_ATTR_SOURCE
command -v git >/dev/null 2>&1 || exit 97
[ -d .git ] && [ -f .git/HEAD ] && [ -d .git/refs ] && [ -d .git/objects ] || exit 98
shadow=$(mktemp -d "${{TMPDIR:-/tmp}}/stockade-git.XXXXXXXX") || exit 98
trap 'rm -rf "$shadow"' EXIT
cp .git/HEAD "$shadow/HEAD" && cp -R .git/refs "$shadow/refs" || exit 98
[ ! -f .git/packed-refs ] || cp .git/packed-refs "$shadow/packed-refs" || exit 98
[ ! -f .git/info/exclude ] || {{ mkdir "$shadow/info" && cp .git/info/exclude "$shadow/info/"; }} || exit 98
export GIT_DIR="$shadow" GIT_WORK_TREE="$PWD" GIT_OBJECT_DIRECTORY="$PWD/.git/objects"
{_GIT} rev-parse --verify -q 'HEAD^{{commit}}' >/dev/null 2>&1 || exit 99
{_GIT} read-tree HEAD >/dev/null 2>&1 || exit 98
{_GIT} {_DIFF} --ignore-submodules=all HEAD -- || exit 96
{_GIT} ls-files --others --exclude-standard --exclude=/.stockade/ -z \
  | xargs -0 -r -n 1 {_GIT} {_DIFF} --no-index -- /dev/null
exit 0
"""
GIT_TIMEOUT_S = 60.0


def git_is_the_projects(ctx: ToolContext) -> bool:
    """Whether the workspace's .git is the repository the run began with, unchanged by code: the
    run's baseline (as the host recorded it) saw a .git folder, and the sandbox's kernel keeps
    code from writing .git (Landlock write rules naming no target in or above it). Otherwise
    a .git is code's to write, and its HEAD and objects say what code chose: the diff against
    the run's start is the truthful one. (What git runs is no longer this gate's to keep: no
    config of any .git is read, ``GIT_HEAD_DIFF``; before that, a clean filter code named in
    .git/config ran in each `git_diff`, a low-risk read, past approvals of code.)"""
    sandbox = ctx.records
    rules = ctx.sandbox.rules or sandbox.rules
    if rules is None or sandbox.enforcement.paths is not Mechanism.LANDLOCK:
        return False
    try:
        targets = write_targets(rules.write)
    except LimitNotEnforceable:  # a pattern the kernel cannot hold: only the tools are judged
        return False
    if targets is None:
        return False
    for target in targets:
        path = target.removeprefix(WORKSPACE).strip("/")
        if path == ".git" or path.startswith(".git/"):
            return False
    return started_in_repository(sandbox, ctx.baseline)


def git_head_diff(sandbox: Sandbox) -> str | None:
    """The diff against git HEAD, or None when the workspace is no git repository with a commit
    (or the sandbox has no git)."""
    if not sandbox.files.exists(".git"):
        return None
    result = sandbox.commands.run(GIT_HEAD_DIFF, timeout_s=GIT_TIMEOUT_S)
    if result.exit_code != 0 or result.timed_out:
        return None
    if result.truncated:
        return result.stdout + "\n(the diff was cut by the sandbox's output cap)"
    return result.stdout
