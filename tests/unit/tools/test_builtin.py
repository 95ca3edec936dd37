"""The built-in tools over the fake backend: reading, listing, bounded output, diffs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from stockade import Sandbox
from stockade.sandbox.base import OpResult
from stockade.sandbox.ops import ListDir, Op, ReadFile, RunCommand
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.tools import (
    Tool,
    ToolContext,
    bound,
    git_diff,
    list_files,
    read_file,
    render,
    reported_failure,
    run_code,
    run_tests,
    shell,
    write_file,
)
from stockade.tools.workspace_diff import record_baseline, snapshot
from stockade.types import CommandResult, Execution, ExecutionError, Listing, Logs


def make_sandbox(workspace: MemoryWorkspace | None = None) -> Sandbox:
    ws = workspace or MemoryWorkspace()
    return Sandbox.create(backend=FakeBackend(ws))


async def call(
    t: Tool, sbx: Sandbox, args: dict[str, object], *, step: int = 1, call_id: str = "c1"
) -> object:
    context = ToolContext(sandbox=sbx, step=step, call_id=call_id)
    return await t.invoke(context, t.validate(args))  # type: ignore[arg-type]


async def test_read_file_numbers_lines_and_pages_with_offset_and_limit() -> None:
    sbx = make_sandbox()
    sbx.files.write("a.py", "".join(f"line {i}\n" for i in range(1, 11)))
    out = await call(read_file, sbx, {"path": "a.py", "offset": 2, "limit": 3})
    assert (
        out == "a.py: lines 3-5 of 10\n3  line 3\n4  line 4\n5  line 5\n(more: read_file('a.py', offset=5))"
    )


async def test_list_files_skips_vcs_caches_and_dependencies_and_caps_entries() -> None:
    sbx = make_sandbox()
    for path in (
        "src/app.py",
        ".git/HEAD",
        "src/__pycache__/app.pyc",
        "node_modules/x/index.js",
        "pkg.egg-info/PKG",
    ):
        sbx.files.write(path, "x")
    out = await call(list_files, sbx, {"depth": 5})
    assert out == "src/\nsrc/app.py  (1 bytes)"


async def test_a_long_observation_keeps_head_and_tail_and_saves_the_rest_for_paging() -> None:
    sbx = make_sandbox()
    text = "".join(f"row {i}\n" for i in range(5000))
    shown = bound(ToolContext(sandbox=sbx, step=3, call_id="call/7", max_observation_chars=600), text)
    assert shown.text.startswith("row 0\n") and shown.text.endswith("row 4999\n")
    assert shown.saved_to == ".stockade/outputs/3-call_7.txt"
    assert f"{shown.cut_chars:,} characters cut from the middle" in shown.text
    assert "5001 lines) is saved at .stockade/outputs/3-call_7.txt" in shown.text
    assert len(shown.text) < 800
    assert sbx.files.read(shown.saved_to) == text


async def test_git_diff_shows_changes_since_the_baseline() -> None:
    sbx = make_sandbox()
    sbx.files.write("a.txt", "one\ntwo\n")
    record_baseline(sbx)
    await call(write_file, sbx, {"path": "a.txt", "content": "one\n2\n"})
    await call(write_file, sbx, {"path": "b.txt", "content": "new\n"})
    assert await call(git_diff, sbx, {}) == (
        "(changes since the run began; not a git repository)\n"
        "--- a/a.txt\n+++ b/a.txt\n@@ -1,2 +1,2 @@\n one\n-two\n+2\n"
        "--- /dev/null\n+++ b/b.txt\n@@ -0,0 +1 @@\n+new\n"
    )


async def test_git_diff_runs_no_git_where_code_may_change_the_repository() -> None:
    """A .git that no kernel keeps from code (the fake holds no write rules) is code's: a clean
    filter it named there would run in this low-risk read, so git is not run at all."""
    ran: list[tuple[str, ...]] = []

    def commands(op: RunCommand) -> CommandResult:
        ran.append(op.argv)
        return CommandResult(exit_code=0, stdout="FROM GIT\n", stderr="", duration_s=0.0)

    files = {".git/HEAD": b"ref: refs/heads/main\n", "a.txt": b"one\n"}
    sbx = make_sandbox(MemoryWorkspace(commands=commands, files=files))
    baseline = record_baseline(sbx)
    sbx.files.write("a.txt", "1\n")
    out = await git_diff.invoke(ToolContext(sandbox=sbx, baseline=baseline), git_diff.validate({}))
    assert out == (
        "(changes since the run began; not a git repository)\n"
        "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-one\n+1\n"
    )
    assert ran == []


async def test_git_diff_falls_back_to_the_baseline_without_git_or_a_commit() -> None:
    def no_git(op: RunCommand) -> CommandResult:
        return CommandResult(exit_code=97, stdout="", stderr="", duration_s=0.0)

    sbx = make_sandbox(MemoryWorkspace(commands=no_git, files={".git/HEAD": b"x", "a.txt": b"one\n"}))
    record_baseline(sbx)
    sbx.files.write("a.txt", "1\n")
    out = await call(git_diff, sbx, {})
    assert str(out).startswith("(changes since the run began; not a git repository)\n--- a/a.txt")


async def test_the_workspace_diff_is_a_patch_apply_patch_accepts() -> None:
    from stockade.tools import apply_patch

    sbx = make_sandbox()
    sbx.files.write("a.txt", "one\ntwo\n")
    record_baseline(sbx)
    sbx.files.write("a.txt", "one\n2\nthree")
    diff = await call(git_diff, sbx, {})
    sbx.files.write("a.txt", "one\ntwo\n")
    await call(apply_patch, sbx, {"diff": diff})
    assert sbx.files.read("a.txt") == "one\n2\nthree"


JUNIT = b"""<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="test_m" name="test_ok" time="0.001"/>
<testcase classname="test_m" name="test_bad" time="0.001"><failure message="assert 1 == 2">def test_bad():
&gt;       assert 1 == 2
E       assert 1 == 2</failure></testcase>
<testcase classname="test_m" name="test_skip"><skipped message="later"/></testcase>
</testsuite></testsuites>"""


async def test_run_tests_reads_pytests_junit_report() -> None:
    ws = MemoryWorkspace()

    def pytest_run(op: RunCommand) -> CommandResult:
        assert op.argv == ("/bin/sh", "-c", "python3 -m pytest -q")  # as given: the report comes by env
        assert "--junitxml=/workspace/.stockade/reports/junit-1-c1.xml" in op.envs["PYTEST_ADDOPTS"]
        ws.files[".stockade/reports/junit-1-c1.xml"] = JUNIT
        return CommandResult(exit_code=1, stdout="1 failed, 1 passed", stderr="", duration_s=0.1)

    ws.commands = pytest_run
    report = await call(run_tests, make_sandbox(ws), {"command": "python3 -m pytest -q"})
    assert report.runner == "pytest"  # type: ignore[attr-defined]
    assert report.passed == ("test_m::test_ok",)  # type: ignore[attr-defined]
    assert report.failed == ("test_m::test_bad",)  # type: ignore[attr-defined]
    assert report.skipped == 1  # type: ignore[attr-defined]
    text = render(report)
    assert "pytest: 1 passed, 1 failed, 0 errors, 1 skipped (exit code 1)" in text
    assert "FAILED test_m::test_bad\ndef test_bad():" in text


def test_a_report_is_read_as_the_tree_was() -> None:
    """Read a case at a time now: the text before a failure's first child, else its message;
    the first failure of a case, and the failure before an error."""
    from stockade.tools.testreport import TestFailure, parse_junit_xml

    parsed = parse_junit_xml(
        b'<testsuites><testsuite><testcase classname="m" name="a"><error message="only">\n</error></testcase>'
        b'<testcase name="b"><error message="e"/><failure message="f">text<x>child</x>tail</failure>'
        b"<failure>second</failure></testcase>"
        b'<testcase name="c"><system-out><failure>not a direct child</failure></system-out></testcase>'
        b"</testsuite></testsuites>"
    )
    assert parsed is not None
    assert (parsed.passed, parsed.failed, parsed.errored) == (["c"], ["b"], ["m::a"])
    assert parsed.failures == [
        TestFailure(test_id="m::a", kind="error", message="only"),
        TestFailure(test_id="b", kind="failed", message="text"),
    ]


async def test_run_tests_reads_no_report_that_code_wrote_ahead_under_its_name() -> None:
    """The report's name is known (the step and the call): code wrote one saying every test
    passed before a runner that writes none ran."""
    forged = (
        b'<testsuites><testsuite name="pytest"><testcase classname="m" name="t"/></testsuite></testsuites>'
    )
    ws = MemoryWorkspace(files={".stockade/reports/junit-1-c1.xml": forged})
    ws.commands = lambda op: CommandResult(exit_code=1, stdout="boom", stderr="", duration_s=0.1)
    report = await call(run_tests, make_sandbox(ws), {"command": "make check"})
    assert report.runner == "plain" and report.exit_code == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("encoding", ["shift_jis", "cp932", "utf-7", "hex", "rot13", "no-such-codec"])
async def test_a_report_in_an_encoding_expat_refuses_is_no_report(encoding: str) -> None:
    """Code in the sandbox writes the report (a conftest.py's hook): one declaring a multi-byte
    encoding raised ValueError out of the tool, an unknown or binary codec LookupError. The
    plain output stands, and pytest's exit code 0 without a readable report is no pass."""
    ws = MemoryWorkspace()
    head = f'<?xml version="1.0" encoding="{encoding}"?>'.encode()

    def run(op: RunCommand) -> CommandResult:
        ws.files[".stockade/reports/junit-1-c1.xml"] = head + b'<testsuite><testcase name="t"/></testsuite>'
        return CommandResult(exit_code=0, stdout="1 passed", stderr="", duration_s=0.1)

    ws.commands = run
    report = await call(run_tests, make_sandbox(ws), {"command": "python3 -m pytest -q"})
    assert report.runner == "plain" and report.output == "1 passed"  # type: ignore[attr-defined]
    assert not report.ok  # type: ignore[attr-defined]
    assert ".stockade/reports/junit-1-c1.xml" not in ws.files


UNITTEST = """test_a (test_m.T.test_a) ... ok
test_b (test_m.T.test_b) ... FAIL

======================================================================
FAIL: test_b (test_m.T.test_b)
----------------------------------------------------------------------
Traceback (most recent call last):
AssertionError: 1 != 2

----------------------------------------------------------------------
Ran 2 tests in 0.001s

FAILED (failures=1)
"""


async def test_run_tests_parses_verbose_unittest_output() -> None:
    ws = MemoryWorkspace(
        commands=lambda op: CommandResult(exit_code=1, stdout="", stderr=UNITTEST, duration_s=0.1)
    )
    report = await call(run_tests, make_sandbox(ws), {"command": "python3 -m unittest"})
    assert (report.passed, report.failed) == (("test_m.T::test_a",), ("test_m.T::test_b",))  # type: ignore[attr-defined]
    assert "AssertionError: 1 != 2" in report.failures[0].message  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "command",
    [
        "sleep 25; python3 -m pytest -q",
        "cd sub && PYTHONPATH=src python3 -m pytest -x tests | tee log.txt",
        "VAR='a b' pytest-3 -q",
        "(cd sub; py.test)",
        "make test",  # pytest somewhere below: the report still comes back
    ],
)
async def test_run_tests_runs_the_command_as_given_and_still_reads_the_report(command: str) -> None:
    ws = MemoryWorkspace()
    seen: list[RunCommand] = []

    def run(op: RunCommand) -> CommandResult:
        seen.append(op)
        ws.files[".stockade/reports/junit-1-c1.xml"] = JUNIT
        return CommandResult(exit_code=1, stdout="", stderr="", duration_s=0.1)

    ws.commands = run
    report = await call(run_tests, make_sandbox(ws), {"command": command})
    assert seen[0].argv == ("/bin/sh", "-c", command)
    assert report.runner == "pytest" and report.failed == ("test_m::test_bad",)  # type: ignore[attr-defined]
    assert ".stockade/reports/junit-1-c1.xml" not in ws.files  # the tool's own record is cleaned up


UNITTEST_QUIET = """.F.s
======================================================================
FAIL: test_b (test_m.T.test_b)
----------------------------------------------------------------------
Traceback (most recent call last):
AssertionError: 1 != 2

----------------------------------------------------------------------
Ran 4 tests in 0.001s

FAILED (failures=1, skipped=1)
"""


@pytest.mark.parametrize("command", ["python3 -m unittest", "cd proj && python3 -m unittest discover 2>&1"])
async def test_run_tests_counts_what_a_quiet_unittest_does_not_name(command: str) -> None:
    seen: list[RunCommand] = []

    def run(op: RunCommand) -> CommandResult:
        seen.append(op)
        return CommandResult(exit_code=1, stdout="", stderr=UNITTEST_QUIET, duration_s=0.1)

    report = await call(run_tests, make_sandbox(MemoryWorkspace(commands=run)), {"command": command})
    assert seen[0].argv[-1] == command  # no -v added behind the model's back
    assert report.runner == "unittest"  # type: ignore[attr-defined]
    assert report.failed == ("test_m.T::test_b",) and report.passed_count == 2  # type: ignore[attr-defined]
    assert "unittest: 2 passed, 1 failed, 0 errors, 1 skipped (exit code 1)" in render(report)


def reports(output: str, *, exit_code: int = 0, report: bytes | None = None) -> MemoryWorkspace:
    """A workspace whose commands print ``output`` and leave ``report`` as the JUnit report."""
    ws = MemoryWorkspace()

    def run(op: RunCommand) -> CommandResult:
        if report is not None:
            ws.files[".stockade/reports/junit-1-c1.xml"] = report
        return CommandResult(exit_code=exit_code, stdout="", stderr=output, duration_s=0.1)

    ws.commands = run
    return ws


async def test_failures_in_the_report_are_no_pass_whatever_the_exit_code() -> None:
    """A conftest.py set session.exitstatus = 0: "0 passed, 2 failed (exit code 0)" was ok."""
    report = await call(
        run_tests, make_sandbox(reports("", report=JUNIT)), {"command": "python3 -m pytest -q"}
    )
    assert report.failed == ("test_m::test_bad",) and report.exit_code == 0  # type: ignore[attr-defined]
    assert not report.ok and reported_failure(report)  # type: ignore[attr-defined]


async def test_a_pytest_run_that_wrote_no_report_is_no_pass() -> None:
    """A test called os._exit(0) after another failed: pytest printed ".F", wrote no report,
    and its exit code 0 was a pass."""
    report = await call(run_tests, make_sandbox(reports(".F")), {"command": "python3 -m pytest -q"})
    assert report.runner == "plain" and not report.ok  # type: ignore[attr-defined]
    assert render(report) == (
        "$ python3 -m pytest -q\nexit code 0; not a pass: pytest was asked for a JUnit report"
        " and left none readable (at most 8 MiB)\n.F"
    )


async def test_a_runner_that_is_not_pytest_needs_no_report() -> None:
    report = await call(run_tests, make_sandbox(reports("all good")), {"command": "make check"})
    assert report.ok and render(report) == "$ make check\nexit code 0\nall good"  # type: ignore[attr-defined]


FAKE_SUMMARY = "\n" + "-" * 70 + "\nRan 500 tests in 0.1s\n\nOK\n"


async def test_a_verbose_unittest_counts_its_lines_not_a_summary_a_test_printed() -> None:
    """A test printed "Ran 500 tests ... OK" and called os._exit(0) after another failed:
    "499 passed, 1 failed" was ok, of 2 tests of which none passed."""
    output = (
        "test_fails (test_u.T.test_fails) ... FAIL\ntest_prints (test_u.T.test_prints) ... " + FAKE_SUMMARY
    )
    report = await call(run_tests, make_sandbox(reports(output)), {"command": "python3 -m unittest -v"})
    assert report.failed == ("test_u.T::test_fails",) and report.passed_count == 0  # type: ignore[attr-defined]
    assert not report.ok  # type: ignore[attr-defined]
    assert "unittest: 0 passed, 1 failed, 0 errors, 0 skipped (exit code 0)" in render(report)


async def test_a_quiet_unittest_whose_progress_shows_a_failure_is_no_pass_on_an_ok_summary() -> None:
    report = await call(
        run_tests, make_sandbox(reports("F" + FAKE_SUMMARY)), {"command": "python3 -m unittest"}
    )
    assert not report.ok  # type: ignore[attr-defined]
    assert "exit code 0; not a pass: the progress line shows 1 failed or errored" in render(report)


async def test_a_quiet_unittest_that_passed_is_a_pass() -> None:
    output = "....\n" + "-" * 70 + "\nRan 4 tests in 0.001s\n\nOK\n"
    report = await call(run_tests, make_sandbox(reports(output)), {"command": "python3 -m unittest"})
    assert report.ok  # type: ignore[attr-defined]


async def test_other_runners_report_their_plain_output() -> None:
    ws = MemoryWorkspace(
        commands=lambda op: CommandResult(exit_code=2, stdout="boom", stderr="", duration_s=0.1)
    )
    report = await call(run_tests, make_sandbox(ws), {"command": "make check"})
    assert render(report) == "$ make check\nexit code 2\nboom"


async def test_run_code_writes_files_then_runs() -> None:
    ws = MemoryWorkspace(code=lambda op: Execution(logs=Logs(stdout="hi\n")))
    sbx = make_sandbox(ws)
    out = await call(run_code, sbx, {"language": "python", "code": "print('hi')", "files": {"d.txt": "x"}})
    assert render(out) == "stdout:\nhi\n" and not reported_failure(out)
    assert sbx.files.read("d.txt") == "x"


async def test_code_that_raised_and_a_command_that_failed_report_failure() -> None:
    error = ExecutionError(name="ZeroDivisionError", value="division by zero", traceback="...")
    ws = MemoryWorkspace(
        code=lambda op: Execution(error=error),
        commands=lambda op: CommandResult(exit_code=1, stdout="", stderr="no", duration_s=0.0),
    )
    sbx = make_sandbox(ws)
    raised = await call(run_code, sbx, {"language": "python", "code": "1/0"})
    assert reported_failure(raised) and "ZeroDivisionError" in render(raised)
    assert reported_failure(await call(shell, sbx, {"command": "false"}))
    assert reported_failure(await call(run_tests, sbx, {"command": "make check"}))


@pytest.mark.parametrize("args", [{"path": "a.py", "offset": -1}, {"path": "a.py", "limit": 0}])
async def test_read_file_refuses_nonsense_paging(args: dict[str, object]) -> None:
    from stockade.exceptions import ToolError

    sbx = make_sandbox()
    sbx.files.write("a.py", "x\n")
    with pytest.raises(ToolError):
        await call(read_file, sbx, args)


async def test_read_file_says_a_file_is_not_text_rather_than_show_replacement_characters() -> None:
    from stockade.exceptions import ToolError

    sbx = make_sandbox()
    sbx.files.write("blob.bin", b"ok\n\xff\xfe\x00data")
    with pytest.raises(ToolError, match=r"blob.bin is not UTF-8 text \(byte 3 of 10\)"):
        await call(read_file, sbx, {"path": "blob.bin"})


def test_the_snapshot_reads_only_plain_workspace_paths() -> None:
    # a listing that (wrongly) names paths outside the workspace never makes the snapshot read them
    inner = MemoryWorkspace(files={"a.txt": b"a\n"})
    read: list[str] = []

    def handler(op: Op[Any]) -> OpResult:
        if isinstance(op, ListDir):
            entries = inner(op)
            assert isinstance(entries, Listing)
            return Listing(
                [*entries, *(replace(entries[0], path=p) for p in ("../up", "/etc/passwd", "x/../../y"))]
            )
        if isinstance(op, ReadFile):
            read.append(op.path)
        return inner(op)

    assert snapshot(Sandbox.create(backend=FakeBackend(handler))) == {"a.txt": "a\n"}
    assert read == ["a.txt"]


def test_a_name_with_control_characters_never_writes_headers_into_the_diff() -> None:
    """A file named `src/x\\n--- /dev/null\\n+++ b/Makefile\\n@@ ...` made the diff carry a patch
    of its own (a Makefile, or README changed) that `git apply` on the host applied cleanly."""
    from stockade.tools.workspace_diff import workspace_diff

    sbx = make_sandbox()
    record_baseline(sbx)
    forged = "src/x\n--- /dev/null\n+++ b/Makefile\n@@ -0,0 +1 @@\n+all:\n--- /dev/null\n+++ b/src/zz"
    sbx.files.write(forged, "y\n")
    sbx.files.write("src/ok.py", "print(1)\n")
    sbx.files.write("src/tab\there.py", "z\n")
    diff = workspace_diff(sbx)
    assert "Makefile\n" not in diff and "+++ b/src/ok.py" in diff
    headers = [line for line in diff.splitlines() if line.startswith(("---", "+++", "@@", "diff"))]
    assert headers == ["--- /dev/null", "+++ b/src/ok.py", "@@ -0,0 +1 @@"], headers
    assert diff.endswith(f"a space): 'src/tab\\there.py', {forged!r}\n")  # sorted
