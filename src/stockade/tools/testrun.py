"""Running a test command and reading what its runner reports (``run_test_command``): the
``run_tests`` tool's work, and the acceptance check's, which runs it outside any tool call.
Apart from the tools: which runner a line uses, where pytest's JUnit report is asked for and
read back, and how unittest's output is counted are the same whoever runs the command.
"""

from __future__ import annotations

import contextlib
import posixpath
import shlex
import time
from dataclasses import replace

from stockade.exceptions import SandboxFileNotFound, WorkspaceError
from stockade.sandbox._supervised_config import WORKSPACE
from stockade.sandbox.facade import Sandbox
from stockade.tools.testreport import (
    MAX_REPORT_BYTES,
    TestReport,
    parse_junit_xml,
    parse_unittest_output,
    unittest_counts,
)

__all__ = ["REPORT_DIR", "run_test_command"]

REPORT_DIR = ".stockade/reports"


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
