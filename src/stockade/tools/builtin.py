"""The built-in tools. Every one works through the sandbox; none touches the host.

``default_toolset()`` holds the narrow set an agent gets by default. ``shell`` is not in
it: raw shell is opt-in (``default_toolset().including(shell)``), and the command policy
guards it by its name.

This module holds the tools as the model sees them (their schemas, what each reply says);
what a tool does at length is beside it: ``testrun`` runs a test command and reads its
report, ``linewindow`` reads a file's lines a chunk at a time, ``githead`` diffs against git
HEAD without running what the repository names, ``patch`` applies a diff.
"""

from __future__ import annotations

from dataclasses import dataclass

from stockade.exceptions import ToolError
from stockade.tools.base import Risk, ToolContext, Toolset, tool
from stockade.tools.deadline import checkpoint
from stockade.tools.githead import git_head_diff, git_is_the_projects
from stockade.tools.linewindow import MAX_SHOWN_BYTES, MAX_SHOWN_LINES, Window, scan
from stockade.tools.patch import apply_patch_to_sandbox
from stockade.tools.testreport import TestReport
from stockade.tools.testrun import run_test_command
from stockade.tools.workspace_diff import is_ignored, workspace_diff
from stockade.types import CommandResult, EntryType, Execution

__all__ = [
    "CodeRan",
    "Ran",
    "apply_patch",
    "default_toolset",
    "git_diff",
    "list_files",
    "read_file",
    "run_code",
    "run_test_command",
    "run_tests",
    "shell",
    "write_file",
]

MAX_LIST_ENTRIES = 400


@dataclass(frozen=True)
class Ran:
    """A command's outcome: text for the model, and the exit code for the run's record."""

    text: str
    exit_code: int | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """Whether the command did what it was asked (exit code 0, in time)."""
        return (self.exit_code is None or self.exit_code == 0) and not self.timed_out

    def observation(self) -> str:
        return self.text


@dataclass(frozen=True)
class CodeRan:
    """What ``run_code`` shows the model, and whether the code ran without raising."""

    text: str
    ok: bool

    def observation(self) -> str:
        return self.text


def _show_command(result: CommandResult) -> str:
    parts = [f"exit code {result.exit_code}" + (" (timed out)" if result.timed_out else "")]
    if result.oom_killed:
        parts.append("killed: out of memory")
    if result.locks_killed:
        parts.append("killed: more file locks held than a sandbox may (4,096)")
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
) -> CodeRan:
    """Run code in the sandbox. Python keeps its state between calls; other languages run fresh.

    Args:
        language: python, bash, sh, node, ruby, perl, ...
        code: the source to run.
        files: files to write into the workspace first, path -> content.
        timeout_s: wall-clock limit in seconds (the sandbox default when omitted).
    """
    for path, content in (files or {}).items():
        ctx.sandbox.files.write(path, content)
    execution = ctx.sandbox.run_code(code, language, timeout_s=timeout_s)
    return CodeRan(_show_execution(execution), ok=execution.error is None and not execution.timed_out)


@tool(risk=Risk.MEDIUM)
def run_tests(ctx: ToolContext, command: str, timeout_s: float | None = None) -> TestReport:
    """Run the test suite and report passed, failed and errored tests with their failure messages.

    The command runs exactly as given, with /bin/sh -c. pytest is understood wherever it runs
    in the line; `python -m unittest` too (add -v to get the name of every passing test); other
    runners report their plain output.

    Args:
        command: the test command, e.g. "python3 -m pytest -q tests" or "python3 -m unittest -v".
        timeout_s: wall-clock limit in seconds (the sandbox default when omitted).
    """
    return run_test_command(
        ctx.sandbox, command, records=ctx.records, name=f"{ctx.step}-{ctx.call_id}", timeout_s=timeout_s
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
    window = Window(offset=offset, limit=min(limit, MAX_SHOWN_LINES))
    scan(ctx.sandbox, path, window)
    shown, total = window.shown, window.total
    if not shown:
        return f"{path}: {total} lines; nothing at offset {offset}"
    width = len(str(offset + len(shown)))
    body = "\n".join(
        f"{n:>{width}}  {line.decode('utf-8', 'ignore').removesuffix(chr(13))}"
        for n, line in enumerate(shown, offset + 1)
    )
    header = f"{path}: lines {offset + 1}-{offset + len(shown)} of {total}"
    cut = (
        ""
        if window.cut is None
        else f"\n(line {offset + 1} is {window.cut:,} bytes: only its first {MAX_SHOWN_BYTES:,} are shown;"
        " look at the rest with run_code)"
    )
    more = (
        "" if offset + len(shown) >= total else f"\n(more: read_file({path!r}, offset={offset + len(shown)}))"
    )
    return f"{header}\n{body}{cut}{more}"


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
        checkpoint()
        if is_ignored(entry.path):
            continue
        if len(shown) >= MAX_LIST_ENTRIES:
            hidden += 1
            continue
        line = f"{entry.path}/" if entry.type == EntryType.DIR else f"{entry.path}  ({entry.size} bytes)"
        shown.append(
            line + ("  (name not UTF-8, shown with U+FFFD: no tool can open it)" if entry.lossy else "")
        )
    if hidden:
        shown.append(f"... {hidden} more entries not shown; list a subfolder")
    return "\n".join(shown) or "(empty)"


@tool(idempotent=True, risk=Risk.LOW)
def git_diff(ctx: ToolContext) -> str:
    """Show the workspace's changes as a unified diff.

    In the git repository the run began in: what `git diff HEAD` shows, with untracked files as
    new files. Otherwise: every change since the run began. The first line says which.
    """
    books = ctx.records  # the tool's own reading: it is not a command the model chose
    against_head = git_head_diff(books) if git_is_the_projects(ctx) else None
    if against_head is not None:
        return f"(git diff HEAD; untracked files shown as new)\n{against_head or '(no changes)'}"
    since = workspace_diff(books, baseline=ctx.baseline) or "(no changes)"
    return f"(changes since the run began; not a git repository)\n{since}"


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
