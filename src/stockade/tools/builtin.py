"""The built-in tools. Every one works through the sandbox; none touches the host.

``default_toolset()`` holds the narrow set an agent gets by default. ``shell`` is not in
it: raw shell is opt-in (``default_toolset().including(shell)``), and the command policy
guards it by its name.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass

from stockade.exceptions import SandboxFileNotFound, ToolError
from stockade.sandbox.facade import Sandbox
from stockade.tools.base import Risk, ToolContext, Toolset, tool
from stockade.tools.patch import apply_patch_to_sandbox
from stockade.tools.testreport import TestReport, parse_junit_xml, parse_unittest_output
from stockade.tools.workspace_diff import is_ignored, workspace_diff
from stockade.types import CommandResult, EntryType, Execution

__all__ = [
    "apply_patch",
    "default_toolset",
    "git_diff",
    "list_files",
    "read_file",
    "run_code",
    "run_tests",
    "shell",
    "write_file",
]

MAX_LIST_ENTRIES = 400
REPORT_DIR = ".stockade/reports"


@dataclass(frozen=True)
class Ran:
    """A command's outcome: text for the model, and the exit code for the run's record."""

    text: str
    exit_code: int | None = None
    timed_out: bool = False

    def observation(self) -> str:
        return self.text


def _show_command(result: CommandResult) -> str:
    parts = [f"exit code {result.exit_code}" + (" (timed out)" if result.timed_out else "")]
    if result.oom_killed:
        parts.append("killed: out of memory")
    if result.stdout:
        parts.append(f"stdout:\n{result.stdout}")
    if result.stderr:
        parts.append(f"stderr:\n{result.stderr}")
    if result.truncated:
        parts.append("(output was truncated by the sandbox's output cap)")
    return "\n".join(parts)


def _show_execution(execution: Execution) -> str:
    parts: list[str] = []
    if execution.logs.stdout:
        parts.append(f"stdout:\n{execution.logs.stdout}")
    if execution.logs.stderr:
        parts.append(f"stderr:\n{execution.logs.stderr}")
    if execution.text is not None:
        parts.append(f"result: {execution.text}")
    if execution.error is not None:
        parts.append(f"error: {execution.error.name}: {execution.error.value}\n{execution.error.traceback}")
    if execution.timed_out:
        parts.append("(timed out)")
    return "\n".join(parts) or "(no output)"


@tool(risk=Risk.MEDIUM)
def run_code(
    ctx: ToolContext,
    language: str,
    code: str,
    files: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> str:
    """Run code in the sandbox. Python keeps its state between calls; other languages run fresh.

    Args:
        language: python, bash, sh, node, ruby, perl, ...
        code: the source to run.
        files: files to write into the workspace first, path -> content.
        timeout_s: wall-clock limit in seconds (the sandbox default when omitted).
    """
    for path, content in (files or {}).items():
        ctx.sandbox.files.write(path, content)
    return _show_execution(ctx.sandbox.run_code(code, language, timeout_s=timeout_s))


def _runner(argv: list[str]) -> str:
    if any(part == "pytest" or part.endswith("/pytest") or part == "py.test" for part in argv):
        return "pytest"
    if "unittest" in argv:
        return "unittest"
    return "plain"


@tool(risk=Risk.MEDIUM)
def run_tests(ctx: ToolContext, command: str, timeout_s: float | None = None) -> TestReport:
    """Run the test suite and report passed, failed and errored tests with their failure messages.

    pytest and `python -m unittest` are understood; other runners report their plain output.

    Args:
        command: the test command, e.g. "python3 -m pytest -q tests" or "python3 -m unittest".
        timeout_s: wall-clock limit in seconds (the sandbox default when omitted).
    """
    argv = shlex.split(command)
    runner = _runner(argv)
    report_path = f"{REPORT_DIR}/junit-{ctx.step}-{ctx.call_id}.xml"
    if runner == "pytest":
        argv += [f"--junitxml={report_path}", "-o", "junit_family=xunit1"]
    elif runner == "unittest" and not {"-v", "--verbose"} & set(argv):
        argv.append("-v")
    start = time.monotonic()
    result = ctx.sandbox.commands.run(shlex.join(argv), timeout_s=timeout_s)
    duration = time.monotonic() - start
    output = (result.stdout + ("\n" if result.stdout and result.stderr else "") + result.stderr).strip()
    parsed = None
    if runner == "pytest":
        try:
            # the report is the tool's own record: read it whatever the model may read
            parsed = parse_junit_xml(ctx.records.files.read(report_path, format="bytes"))
            ctx.records.files.remove(report_path)
        except (SandboxFileNotFound, SyntaxError):
            parsed = None  # collection crashed before pytest wrote a report: show the output
    elif runner == "unittest":
        parsed = parse_unittest_output(output)
        if not any(parsed[:3]):
            parsed = None
    if parsed is None:
        return TestReport(
            command=command,
            runner="plain",
            exit_code=result.exit_code,
            output=output,
            duration_s=duration,
            timed_out=result.timed_out,
        )
    passed, failed, errored, skipped, failures = parsed
    return TestReport(
        command=command,
        runner=runner,
        exit_code=result.exit_code,
        passed=tuple(passed),
        failed=tuple(failed),
        errored=tuple(errored),
        skipped=skipped,
        failures=tuple(failures),
        output=output,
        duration_s=duration,
        timed_out=result.timed_out,
    )


@tool(idempotent=True, risk=Risk.LOW)
def read_file(ctx: ToolContext, path: str, offset: int = 0, limit: int = 400) -> str:
    """Read lines of a text file, numbered, starting at line `offset` (0-based).

    Args:
        path: the file, relative to the workspace.
        offset: the first line to show, counting from 0.
        limit: how many lines to show at most.
    """
    if offset < 0 or limit <= 0:
        raise ToolError("offset must be >= 0 and limit > 0")
    lines = ctx.sandbox.files.read(path).splitlines()
    shown = lines[offset : offset + limit]
    if not shown:
        return f"{path}: {len(lines)} lines; nothing at offset {offset}"
    width = len(str(offset + len(shown)))
    body = "\n".join(f"{n:>{width}}  {line}" for n, line in enumerate(shown, offset + 1))
    header = f"{path}: lines {offset + 1}-{offset + len(shown)} of {len(lines)}"
    more = (
        ""
        if offset + len(shown) >= len(lines)
        else f"\n(more: read_file({path!r}, offset={offset + len(shown)}))"
    )
    return f"{header}\n{body}{more}"


@tool(idempotent=True, risk=Risk.MEDIUM)
def write_file(ctx: ToolContext, path: str, content: str) -> str:
    """Create or replace a text file in the workspace (parent folders are created).

    Args:
        path: the file, relative to the workspace.
        content: the whole new content.
    """
    entry = ctx.sandbox.files.write(path, content)
    return f"wrote {entry.size} bytes to {path}"


@tool(risk=Risk.MEDIUM)
def apply_patch(ctx: ToolContext, diff: str) -> str:
    """Apply a unified diff to the workspace, all or nothing.

    Use '--- a/path' and '+++ b/path' headers and '@@ -l,n +l,n @@' hunks with a few lines of
    context; '/dev/null' creates or deletes a file. If any hunk does not apply, no file is changed
    and the reply says which hunk failed and why.

    Args:
        diff: the unified diff text.
    """
    stats = apply_patch_to_sandbox(ctx.sandbox, diff)
    return "applied:\n" + "\n".join(f"  {path} (+{added} -{removed})" for path, added, removed in stats)


@tool(idempotent=True, risk=Risk.LOW)
def list_files(ctx: ToolContext, path: str = "", depth: int = 2) -> str:
    """List files and folders under a folder of the workspace (VCS, caches and build output are skipped).

    Args:
        path: the folder, relative to the workspace ("" for the root).
        depth: how many levels to descend, 1 for the folder's own entries.
    """
    shown: list[str] = []
    hidden = 0
    for entry in ctx.sandbox.files.list(path, depth=max(depth, 1)):
        if is_ignored(entry.path):
            continue
        if len(shown) >= MAX_LIST_ENTRIES:
            hidden += 1
            continue
        shown.append(
            f"{entry.path}/" if entry.type == EntryType.DIR else f"{entry.path}  ({entry.size} bytes)"
        )
    if hidden:
        shown.append(f"... {hidden} more entries not shown; list a subfolder")
    return "\n".join(shown) or "(empty)"


# `git diff HEAD`, plus untracked (not ignored) files as new ones, without touching the index;
# the run's own records (.stockade/) are left out.
# Exit 97-99: no git, not a repository, no commit yet; the tool then diffs against the baseline.
_GIT = "git -c safe.directory=* -c core.fsmonitor= -c core.quotepath=off"
GIT_HEAD_DIFF = f"""\
command -v git >/dev/null 2>&1 || exit 97
{_GIT} rev-parse --is-inside-work-tree >/dev/null 2>&1 || exit 98
{_GIT} rev-parse --verify -q HEAD >/dev/null 2>&1 || exit 99
{_GIT} diff --no-color --no-ext-diff HEAD -- || exit 96
{_GIT} ls-files --others --exclude-standard --exclude=/.stockade/ -z \
  | xargs -0 -r -n 1 {_GIT} diff --no-color --no-ext-diff --no-index -- /dev/null
exit 0
"""
GIT_TIMEOUT_S = 60.0


def _git_head_diff(sandbox: Sandbox) -> str | None:
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


@tool(idempotent=True, risk=Risk.LOW)
def git_diff(ctx: ToolContext) -> str:
    """Show the workspace's changes as a unified diff.

    In a git repository: what `git diff HEAD` shows, with untracked files as new files. Otherwise:
    every change since the run began. The first line says which.
    """
    books = ctx.records  # the tool's own reading: it is not a command the model chose
    against_head = _git_head_diff(books)
    if against_head is not None:
        return f"(git diff HEAD; untracked files shown as new)\n{against_head or '(no changes)'}"
    return f"(changes since the run began; not a git repository)\n{workspace_diff(books) or '(no changes)'}"


@tool(risk=Risk.HIGH)
def shell(ctx: ToolContext, command: str, timeout_s: float | None = None) -> Ran:
    """Run a shell command in the sandbox's workspace.

    Args:
        command: the command line, run with /bin/sh -c.
        timeout_s: wall-clock limit in seconds (the sandbox default when omitted).
    """
    result = ctx.sandbox.commands.run(command, timeout_s=timeout_s)
    return Ran(_show_command(result), result.exit_code, result.timed_out)


def default_toolset() -> Toolset:
    """The tools an agent gets unless told otherwise (no raw shell)."""
    return Toolset([run_code, run_tests, read_file, write_file, apply_patch, list_files, git_diff])
