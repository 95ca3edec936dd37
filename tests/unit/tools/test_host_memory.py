"""What the file tools cost the host: a window of the file, never one object per line of it.

A file the sandboxed code wrote may be as large as the sandbox's disk. read_file read it whole
and split it into lines to show 400 of them, apply_patch split it to change one: 28 times the
file's size in the host (30 MB of short lines took 876 MB). The host's peak is measured in a
process of its own (its VmHWM), around one tool call over a 30 MB file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from typing import Any

import pytest

from stockade import Sandbox
from stockade.exceptions import PatchRejected, ToolError
from stockade.sandbox.base import OpResult
from stockade.sandbox.ops import Op, ReadFile, RunCommand
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.tools import ToolContext, read_file, run_tests
from stockade.tools.linewindow import MAX_SHOWN_BYTES, READ_CHUNK
from stockade.tools.patch import MAX_PATCH_BYTES, apply_patch_to_sandbox
from stockade.tools.testreport import (
    MAX_FAILURES_SHOWN,
    MAX_NAMED_PASSES,
    MAX_REPORT_BYTES,
    TestReport,
    parse_junit_xml,
    parse_unittest_output,
)
from stockade.types import CommandResult

LINES = 10_000_000  # of b"ab\n": 30 MB

CHILD = """
import asyncio, gc, json, sys
from pathlib import Path
from stockade import Sandbox
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.tools import ToolContext, apply_patch, read_file

def kb(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])

name, args, lines = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
sbx = Sandbox.create(backend=FakeBackend(MemoryWorkspace(files={"big.txt": b"ab\\n" * lines})))
tool = {"read_file": read_file, "apply_patch": apply_patch}[name]
gc.collect()
Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
before = kb("VmRSS")
try:
    reply = str(asyncio.run(tool.invoke(ToolContext(sandbox=sbx), tool.validate(args))))
except Exception as err:
    reply = f"error: {type(err).__name__}: {err}"
print(json.dumps({"grown_mb": (kb("VmHWM") - before) / 1024, "reply": reply[:300] + reply[-300:]}))
"""


def host_peak(tool: str, args: dict[str, object]) -> tuple[float, str]:
    """How much a call of ``tool`` over the 30 MB file grew its process, and its reply."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, tool, json.dumps(args), str(LINES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    outcome = json.loads(done.stdout)
    return float(outcome["grown_mb"]), str(outcome["reply"])


def test_read_file_of_a_large_file_costs_the_host_the_lines_it_shows() -> None:
    grown_mb, reply = host_peak("read_file", {"path": "big.txt", "offset": 5_000_000})
    assert reply.startswith("big.txt: lines 5000001-5000400 of 10000000\n5000001  ab\n")
    assert reply.endswith("(more: read_file('big.txt', offset=5000400))")
    assert grown_mb < 40, f"the host grew by {grown_mb:.0f} MiB"


def test_apply_patch_refuses_a_file_over_its_cap_without_taking_it_in() -> None:
    diff = "--- a/big.txt\n+++ b/big.txt\n@@ -1,2 +1,2 @@\n-ab\n+cd\n ab\n"
    grown_mb, reply = host_peak("apply_patch", {"diff": diff})
    assert "PatchRejected: big.txt is too large for apply_patch" in reply
    assert "Nothing was changed. Edit the file with run_code." in reply
    assert grown_mb < 40, f"the host grew by {grown_mb:.0f} MiB"


def reads_of(files: dict[str, bytes]) -> tuple[Sandbox, list[tuple[ReadFile, int]]]:
    """A sandbox over ``files`` and the list of the reads it is asked for, with the bytes each
    answered."""
    workspace = MemoryWorkspace(files=files)
    reads: list[tuple[ReadFile, int]] = []

    def handler(op: Op[Any]) -> OpResult:
        answer = workspace(op)
        if isinstance(op, ReadFile):
            assert isinstance(answer, bytes)
            reads.append((op, len(answer)))
        return answer

    return Sandbox.create(backend=FakeBackend(handler)), reads


async def test_read_file_asks_the_sandbox_for_a_chunk_at_a_time() -> None:
    sbx, reads = reads_of({"big.txt": b"ab\n" * (READ_CHUNK // 2)})
    await read_file.invoke(ToolContext(sandbox=sbx), read_file.validate({"path": "big.txt"}))
    assert len(reads) > 1 and all(size <= READ_CHUNK for _, size in reads)
    assert all(op.length is not None and op.length <= READ_CHUNK for op, _ in reads)


async def test_a_line_longer_than_a_reply_is_shown_in_part_with_its_size() -> None:
    sbx, _ = reads_of({"min.js": b"x" * (3 * MAX_SHOWN_BYTES) + b"\nend\n"})
    reply = await read_file.invoke(ToolContext(sandbox=sbx), read_file.validate({"path": "min.js"}))
    assert isinstance(reply, str) and len(reply) < MAX_SHOWN_BYTES + 300
    assert reply.startswith("min.js: lines 1-1 of 2\n1  xxx")
    assert reply.endswith(
        f"(line 1 is {3 * MAX_SHOWN_BYTES:,} bytes: only its first {MAX_SHOWN_BYTES:,} are shown;"
        " look at the rest with run_code)\n(more: read_file('min.js', offset=1))"
    )


async def test_read_file_still_names_the_first_byte_that_is_not_utf8_in_a_large_file() -> None:
    sbx, _ = reads_of({"blob": b"a" * (READ_CHUNK + 5) + b"\xff" + b"b" * READ_CHUNK})
    with pytest.raises(
        ToolError, match=rf"blob is not UTF-8 text \(byte {READ_CHUNK + 5:,} of {2 * READ_CHUNK + 6:,}\)"
    ):
        await read_file.invoke(ToolContext(sandbox=sbx), read_file.validate({"path": "blob"}))


def test_apply_patch_reads_no_more_than_its_cap_of_the_files_of_one_diff() -> None:
    sbx, reads = reads_of(
        {"a.txt": b"a\n" * (MAX_PATCH_BYTES // 4), "b.txt": b"b\n" * (MAX_PATCH_BYTES // 2)}
    )
    diff = "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-a\n+A\n--- a/b.txt\n+++ b/b.txt\n@@ -1 +1 @@\n-b\n+B\n"
    with pytest.raises(PatchRejected, match=r"b\.txt is too large for apply_patch"):
        apply_patch_to_sandbox(sbx, diff)  # half the cap, then all of it: over it together
    assert sum(size for _, size in reads) <= MAX_PATCH_BYTES + 1
    assert sbx.files.read("a.txt", format="bytes").startswith(b"a\n")  # nothing was changed


async def test_run_tests_reads_no_more_of_a_report_than_it_parses() -> None:
    """A report over the cap was read whole into the host before it was cut (a 200 MiB one took
    the host from 49 to 470 MB): it is read to one byte past the cap, and is no report."""
    report = b"<testsuite>" + b"<testcase name='t'/>" * (MAX_REPORT_BYTES // 20) + b"</testsuite>"
    workspace = MemoryWorkspace(files={})
    reads_of_report: list[tuple[ReadFile, int]] = []

    def handler(op: Op[Any]) -> OpResult:
        if isinstance(op, RunCommand):
            workspace.files[".stockade/reports/junit-1-c1.xml"] = report
            return CommandResult(exit_code=0, stdout="ok", stderr="", duration_s=0.1)
        answer = workspace(op)
        if isinstance(op, ReadFile):
            assert isinstance(answer, bytes)
            reads_of_report.append((op, len(answer)))
        return answer

    sbx = Sandbox.create(backend=FakeBackend(handler))
    ctx = ToolContext(sandbox=sbx, step=1, call_id="c1")
    out = await run_tests.invoke(ctx, run_tests.validate({"command": "pytest"}))
    assert isinstance(out, TestReport) and out.runner == "plain" and out.output == "ok" and not out.ok
    assert len(report) > MAX_REPORT_BYTES + 1 and reads_of_report
    assert sum(size for _, size in reads_of_report) <= MAX_REPORT_BYTES + 1


def junit_report(case: bytes) -> bytes:
    """A report of as many copies of ``case`` (``%d`` numbers them) as fit under the cap."""
    cases = [b"<testsuite>"]
    size, number = len(cases[0]) + len(b"</testsuite>"), 0
    while size + len(case) + 10 < MAX_REPORT_BYTES:
        cases.append(case % number)
        size += len(cases[-1])
        number += 1
    return b"".join([*cases, b"</testsuite>"])


@pytest.mark.parametrize(
    "case",
    [b'<testcase name="a%d"/>', b'<testcase name="t%d"><failure message="m">boom</failure></testcase>'],
)
def test_a_report_just_under_the_cap_costs_the_host_its_counts_not_a_tree(case: bytes) -> None:
    """Parsed as a tree, 327,000 passing cases just under the 8 MiB cap took 128 MiB of the
    host, 147,000 failing ones 114 MiB and a 2.4 MiB observation."""
    report = junit_report(case)
    tracemalloc.start()
    try:
        parsed = parse_junit_xml(report)
        assert parsed is not None
        shown = TestReport(
            command="pytest",
            runner="pytest",
            exit_code=1,
            passed=tuple(parsed.passed),
            passed_unnamed=parsed.passed_unnamed,
            failed=tuple(parsed.failed),
            failures=tuple(parsed.failures),
        ).observation()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 24 * 2**20, f"{peak / 2**20:.0f} MiB"
    assert len(shown) < 16_000
    cases = report.count(b"<testcase ")
    assert len(parsed.passed) + parsed.passed_unnamed + len(parsed.failed) == cases
    assert len(parsed.passed) <= MAX_NAMED_PASSES and len(parsed.failures) <= MAX_FAILURES_SHOWN
    if parsed.failed:
        assert f"({cases - MAX_FAILURES_SHOWN} more failed or errored tests not shown)" in shown


def test_a_quiet_unittest_run_with_thousands_of_failures_keeps_fifty_messages_and_names_all() -> None:
    """Every failure block's text was cut and kept before all but 50 were dropped: 5,000
    failures of 4 KB (20 MB of output) took 40 MB of the host to show 50 of them."""
    trace = "Traceback (most recent call last):\n" + "  x\n" * 1000 + "AssertionError\n"
    blocks = "".join(
        f"{'=' * 70}\nFAIL: test_{i} (test_m.T.test_{i})\n{'-' * 70}\n{trace}\n" for i in range(5000)
    )
    output = f"{'F' * 5000}\n{blocks}{'-' * 70}\nRan 5000 tests in 1.0s\n\nFAILED (failures=5000)\n"
    tracemalloc.start()
    try:
        parsed = parse_unittest_output(output)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"{peak / 2**20:.0f} MiB"
    assert len(parsed.failed) == 5000 and parsed.failed[-1] == "test_m.T::test_4999"
    assert [f.test_id for f in parsed.failures] == [f"test_m.T::test_{i}" for i in range(MAX_FAILURES_SHOWN)]
