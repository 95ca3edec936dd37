"""The built-in tools. Every one works through the sandbox; none touches the host.

``default_toolset()`` holds the narrow set an agent gets by default. ``shell`` is not in
it: raw shell is opt-in (``default_toolset().including(shell)``), and the command policy
guards it by its name.
"""

from __future__ import annotations

import codecs
import contextlib
import posixpath
import shlex
import time
from dataclasses import dataclass, field, replace

from stockade.exceptions import LimitNotEnforceable, SandboxFileNotFound, ToolError, WorkspaceError
from stockade.sandbox._rules import write_targets
from stockade.sandbox._supervised_config import WORKSPACE
from stockade.sandbox.facade import Sandbox
from stockade.tools.base import Risk, ToolContext, Toolset, tool
from stockade.tools.deadline import checkpoint
from stockade.tools.patch import apply_patch_to_sandbox
from stockade.tools.testreport import (
    MAX_REPORT_BYTES,
    TestReport,
    parse_junit_xml,
    parse_unittest_output,
    unittest_counts,
)
from stockade.tools.workspace_diff import is_ignored, started_in_repository, workspace_diff
from stockade.types import CommandResult, EntryType, Execution, Mechanism

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
REPORT_DIR = ".stockade/reports"


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


def _words(command: str) -> list[str]:
    """The words of a shell line, operators apart (``a&&b`` is three words); never raises."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # unbalanced quotes: the shell will say so; the words are a guess
        return command.split()


def _runner(command: str) -> str:
    """Which runner a test command uses, wherever it sits in the line (``cd x && VAR=1 pytest
    -q | tee log``): pytest, unittest or plain."""
    words = _words(command)
    for before, word in zip(["", *words], words, strict=False):
        program = posixpath.basename(word)
        if program in _PYTEST_PROGRAMS or (before == "-m" and word == "pytest"):
            return "pytest"
    for before, word in zip(["", *words], words, strict=False):
        if before == "-m" and word.split(".")[0] == "unittest":
            return "unittest"
    return "plain"


# pytest's own programs (Debian also installs pytest-3); `python -m pytest` is matched apart.
_PYTEST_PROGRAMS = frozenset({"pytest", "py.test", "pytest-3", "py.test-3"})


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


def run_test_command(
    sandbox: Sandbox,
    command: str,
    *,
    records: Sandbox | None = None,
    name: str = "check",
    timeout_s: float | None = None,
) -> TestReport:
    """Run ``command`` in ``sandbox`` as given and read what its runner reports.

    pytest is asked for a JUnit XML report through ``PYTEST_ADDOPTS``, so the command line is
    never rewritten: what runs is what the model asked for, what an approval showed and what
    the audit trail records, pipes, ``&&``, ``cd`` and assignments included. The report is read
    (and removed) through ``records``, the run's own view of the sandbox.
    """
    books = records if records is not None else sandbox
    runner = _runner(command)
    report_path = f"{WORKSPACE}/{REPORT_DIR}/junit-{name}.xml"
    envs = {"PYTEST_ADDOPTS": f"--junitxml={report_path} -o junit_family=xunit1"}
    with contextlib.suppress(SandboxFileNotFound):  # one that code wrote ahead, under the name
        books.files.remove(report_path)
    start = time.monotonic()
    result = sandbox.commands.run(command, envs=envs, timeout_s=timeout_s)
    duration = time.monotonic() - start
    output = (result.stdout + ("\n" if result.stdout and result.stderr else "") + result.stderr).strip()
    parsed = None
    # The report is the tool's own record: read it whatever the model may read. None, one that
    # is not a file, or one parse_junit_xml cannot read (over its cap: no more than that is
    # read): not pytest, or code in the sandbox wrote it; the output is shown instead.
    with contextlib.suppress(WorkspaceError):
        parsed = parse_junit_xml(books.files.read_range(report_path, 0, MAX_REPORT_BYTES + 1))
        books.files.remove(report_path)
    doubt = ""
    if parsed is not None:
        runner = "pytest"
    elif runner == "pytest":
        # pytest writes the report it was asked for whenever its session ends: without one it
        # did not finish (code called os._exit(0) after a failing test), or the report was
        # over the cap or unreadable. Its exit code alone is not a pass.
        cap = MAX_REPORT_BYTES // 2**20
        doubt = f"pytest was asked for a JUnit report and left none readable (at most {cap} MiB)"
    if runner == "unittest":
        parsed = parse_unittest_output(output)
        counted = unittest_counts(output)
        if counted is not None and not parsed.verbose:
            if counted.verdict_ok and counted.progress_failed:
                failing = counted.progress_failed
                doubt = f"the progress line shows {failing} failed or errored, the summary after it OK"
            if not parsed.empty:
                # Without -v the summary counts what it does not name; with -v the lines are the
                # count (a test can print a summary of its own, "Ran 500 tests ... OK", and end
                # the process).
                named = len(parsed.failed) + len(parsed.errored)
                parsed = replace(
                    parsed,
                    passed_unnamed=max(counted.ran - named - counted.not_passed_unnamed, 0),
                    skipped=max(parsed.skipped, counted.skipped),
                )
        if parsed.empty:
            parsed = None
    if parsed is None:
        return TestReport(
            command=command,
            runner="plain",
            exit_code=result.exit_code,
            output=output,
            duration_s=duration,
            timed_out=result.timed_out,
            doubt=doubt,
        )
    return TestReport(
        command=command,
        runner=runner,
        exit_code=result.exit_code,
        passed=tuple(parsed.passed),
        passed_unnamed=parsed.passed_unnamed,
        failed=tuple(parsed.failed),
        errored=tuple(parsed.errored),
        skipped=parsed.skipped,
        failures=tuple(parsed.failures),
        output=output,
        duration_s=duration,
        timed_out=result.timed_out,
        doubt=doubt,
    )


# read_file holds one chunk of the file and the lines it shows, never the whole file: a file
# the code wrote may be as large as the sandbox's disk (256 MiB by default), and one string
# per line of it took 28 times its size in the host.
READ_CHUNK = 1 << 20
MAX_SHOWN_BYTES = 128 * 1024  # of one reply's lines; a longer first line is cut
MAX_SHOWN_LINES = 2_000


@dataclass
class _Window:
    """The lines ``[offset, offset + limit)`` of a file fed a chunk at a time: the others are
    counted, not split; those shown are kept, ``MAX_SHOWN_BYTES`` of them at most."""

    offset: int
    limit: int
    newlines: int = 0  # lines ended so far
    shown: list[bytes] = field(default_factory=list)
    kept: int = 0  # bytes of shown
    done: bool = False  # no more lines are shown (the limit, or the bytes)
    cut: int | None = None  # the size of the one line shown in part
    line: bytearray | None = None  # the shown line being read, its first bytes
    size: int = 0  # the whole size of that line
    ends_open: bool = False  # the last line has no newline

    def feed(self, chunk: bytes) -> None:
        i = 0
        while i < len(chunk):
            if self.newlines < self.offset:
                i = self._skip(chunk, i)
            elif self.done:
                self.newlines += chunk.count(b"\n", i)
                i = len(chunk)
            else:
                i = self._read(chunk, i)
        if chunk:
            self.ends_open = chunk[-1] != ord("\n")

    def finish(self) -> None:
        """The file ended: a last line without a newline is a line too."""
        if self.line is not None:
            self._end_line()

    def _skip(self, chunk: bytes, i: int) -> int:
        """Past the lines before ``offset``, counted a chunk at a time where it can."""
        need = self.offset - self.newlines
        if chunk.count(b"\n", i) < need:
            self.newlines += chunk.count(b"\n", i)
            return len(chunk)
        for _ in range(need):
            i = chunk.index(b"\n", i) + 1
        self.newlines += need
        return i

    def _read(self, chunk: bytes, i: int) -> int:
        """Gather the shown line at ``i``: only as much of it as may be shown."""
        nl = chunk.find(b"\n", i)
        stop = len(chunk) if nl < 0 else nl
        if self.line is None:
            self.line = bytearray()
        room = MAX_SHOWN_BYTES - self.kept - len(self.line)
        self.line += chunk[i : i + min(stop - i, max(room, 0))]
        self.size += stop - i
        if nl < 0:
            return len(chunk)
        self._end_line()
        self.newlines += 1
        return nl + 1

    def _end_line(self) -> None:
        line, size = self.line or bytearray(), self.size
        self.line, self.size = None, 0
        if self.kept + size <= MAX_SHOWN_BYTES:
            self.shown.append(bytes(line))
            self.kept += size
        elif not self.shown:  # a line longer than a reply: its start, and its size
            self.shown.append(bytes(line))
            self.cut = size
            self.done = True
        else:
            self.done = True  # the next reply starts with it
        self.done = self.done or len(self.shown) >= self.limit

    @property
    def total(self) -> int:
        """The file's lines (a last line without a newline counts)."""
        return self.newlines + (1 if self.ends_open else 0)


def _scan(sandbox: Sandbox, path: str, window: _Window) -> None:
    """Feed the whole file to ``window`` a chunk at a time, checking it is UTF-8 on the way."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    at = 0
    while True:
        chunk = sandbox.files.read_range(path, at, READ_CHUNK)
        last = len(chunk) < READ_CHUNK
        pending = len(decoder.getstate()[0])
        try:
            decoder.decode(chunk, final=last)  # thrown away: read only for the check
        except UnicodeDecodeError as err:  # shown as U+FFFD, the model would take it for the text
            bad = at - pending + err.start
            size = at + len(chunk) + (0 if last else _size_from(sandbox, path, at + len(chunk)))
            raise ToolError(
                f"{path} is not UTF-8 text (byte {bad:,} of {size:,}): a binary file? "
                "look at its bytes with run_code"
            ) from None
        window.feed(chunk)
        at += len(chunk)
        if last:
            window.finish()
            return


def _size_from(sandbox: Sandbox, path: str, at: int) -> int:
    """How many bytes the file has from ``at`` on (read, not kept)."""
    start = at
    while len(chunk := sandbox.files.read_range(path, at, READ_CHUNK)) == READ_CHUNK:
        at += len(chunk)
    return at + len(chunk) - start


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
    window = _Window(offset=offset, limit=min(limit, MAX_SHOWN_LINES))
    _scan(ctx.sandbox, path, window)
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


def _git_is_the_projects(ctx: ToolContext) -> bool:
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

    In the git repository the run began in: what `git diff HEAD` shows, with untracked files as
    new files. Otherwise: every change since the run began. The first line says which.
    """
    books = ctx.records  # the tool's own reading: it is not a command the model chose
    against_head = _git_head_diff(books) if _git_is_the_projects(ctx) else None
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
