"""Structured test results from the runner's own report.

pytest writes JUnit XML (``--junitxml``), which is parsed here; ``python -m unittest -v``
prints one line per test, which is parsed too; any other runner gives its plain output.
The XML comes out of the sandbox, so it is untrusted: a report over its size cap is not parsed
(expat, bundled with CPython >= 3.11, refuses entity-expansion bombs), nothing in it is
followed or executed, and one that cannot be read is no report: the plain output stands.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from stockade.tools.deadline import checkpoint

__all__ = [
    "MAX_REPORT_BYTES",
    "TestFailure",
    "TestReport",
    "UnittestCounts",
    "parse_junit_xml",
    "parse_unittest_output",
    "unittest_counts",
]

MAX_REPORT_BYTES = 8 * 1024 * 1024
_SHOWN_OUTPUT = 3000


@dataclass(frozen=True, kw_only=True)
class TestFailure:
    test_id: str
    kind: str  # "failed" or "error"
    message: str


@dataclass(frozen=True, kw_only=True)
class TestReport:
    """The outcome of one test command."""

    __test__ = False  # not a pytest test class, despite the name

    command: str
    runner: str  # "pytest", "unittest" or "plain"
    exit_code: int
    passed: tuple[str, ...] = ()
    passed_unnamed: int = 0  # passing tests the runner counted without naming (unittest without -v)
    failed: tuple[str, ...] = ()
    errored: tuple[str, ...] = ()
    skipped: int = 0
    failures: tuple[TestFailure, ...] = ()
    output: str = ""
    duration_s: float = 0.0
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def passed_count(self) -> int:
        return len(self.passed) + self.passed_unnamed

    def observation(self) -> str:
        if self.runner == "plain":
            head = f"$ {self.command}\nexit code {self.exit_code}" + (
                " (timed out)" if self.timed_out else ""
            )
            return f"{head}\n{self.output}"
        lines = [
            f"$ {self.command}",
            f"{self.runner}: {self.passed_count} passed, {len(self.failed)} failed, "
            f"{len(self.errored)} errors, {self.skipped} skipped (exit code {self.exit_code})"
            + (" (timed out)" if self.timed_out else ""),
        ]
        for failure in self.failures:
            lines.append(f"\n{failure.kind.upper()} {failure.test_id}\n{failure.message.rstrip()}")
        if not self.failures and not self.ok:
            tail = self.output[-_SHOWN_OUTPUT:]
            lines.append(f"\noutput (last {len(tail)} characters):\n{tail}")
        return "\n".join(lines)


def parse_junit_xml(xml: bytes) -> tuple[list[str], list[str], list[str], int, list[TestFailure]] | None:
    """(passed, failed, errored, skipped, failures) from a JUnit XML report; None when it is
    not one this reads: over ``MAX_REPORT_BYTES``, not well-formed, or in an encoding expat
    refuses (ValueError for a multi-byte one such as shift_jis, LookupError for an unknown
    name or a codec that is not text, such as hex)."""
    if len(xml) > MAX_REPORT_BYTES:
        return None
    try:
        root = ET.fromstring(xml)
    except (SyntaxError, ValueError, LookupError):
        return None
    passed: list[str] = []
    failed: list[str] = []
    errored: list[str] = []
    skipped = 0
    failures: list[TestFailure] = []
    for case in root.iter("testcase"):
        checkpoint()
        classname, name = case.get("classname", ""), case.get("name", "")
        test_id = f"{classname}::{name}" if classname else name
        failure, error = case.find("failure"), case.find("error")
        if case.find("skipped") is not None:
            skipped += 1
        elif failure is not None or error is not None:
            node = failure if failure is not None else error
            assert node is not None
            kind = "failed" if failure is not None else "error"
            (failed if kind == "failed" else errored).append(test_id)
            detail = (node.text or "").strip()
            message = node.get("message", "")
            failures.append(TestFailure(test_id=test_id, kind=kind, message=detail or message))
        else:
            passed.append(test_id)
    return passed, failed, errored, skipped, failures


_UNITTEST_LINE = re.compile(
    r"^(\w+) \(([\w.]+)\)(?:\n.*?)? \.\.\. (ok|FAIL|ERROR|skipped.*|expected failure)$", re.M
)
_UNITTEST_BLOCK = re.compile(
    r"^={50,}\n(FAIL|ERROR): (\w+) \(([\w.]+)\)\n-{50,}\n(.*?)(?=^={50,}|^-{50,}\nRan )", re.M | re.S
)


def parse_unittest_output(output: str) -> tuple[list[str], list[str], list[str], int, list[TestFailure]]:
    """(passed, failed, errored, skipped, failures) from ``python -m unittest -v`` output."""
    passed: list[str] = []
    failed: list[str] = []
    errored: list[str] = []
    skipped = 0
    for name, where, outcome in _UNITTEST_LINE.findall(output):
        test_id = f"{where.removesuffix('.' + name)}::{name}"
        if outcome == "ok":
            passed.append(test_id)
        elif outcome == "FAIL":
            failed.append(test_id)
        elif outcome == "ERROR":
            errored.append(test_id)
        else:
            skipped += 1
    failures = [
        TestFailure(
            test_id=f"{where.removesuffix('.' + name)}::{name}",
            kind="failed" if kind == "FAIL" else "error",
            message=body.strip(),
        )
        for kind, name, where, body in _UNITTEST_BLOCK.findall(output)
    ]
    if not (passed or failed or errored or skipped):  # not verbose: the failure blocks still name them
        failed = [f.test_id for f in failures if f.kind == "failed"]
        errored = [f.test_id for f in failures if f.kind == "error"]
    return passed, failed, errored, skipped, failures


@dataclass(frozen=True, kw_only=True)
class UnittestCounts:
    """The closing summary of a unittest run (``Ran 3 tests`` ... ``FAILED (failures=1)``)."""

    ran: int
    skipped: int = 0
    not_passed_unnamed: int = 0  # skipped, expected failures and unexpected successes


_UNITTEST_RAN = re.compile(r"^Ran (\d+) tests? in ", re.M)
_UNITTEST_VERDICT = re.compile(r"^(?:OK|FAILED)(?: \((.*)\))?$", re.M)


def unittest_counts(output: str) -> UnittestCounts | None:
    """The counts of the last unittest summary in ``output``, if there is one."""
    ran = _UNITTEST_RAN.findall(output)
    if not ran:
        return None
    counts: dict[str, int] = {}
    verdicts = _UNITTEST_VERDICT.findall(output)
    for item in (verdicts[-1] if verdicts else "").split(","):
        key, _, value = item.strip().partition("=")
        if value.isdigit():
            counts[key] = int(value)
    skipped = counts.get("skipped", 0)
    others = counts.get("expected failures", 0) + counts.get("unexpected successes", 0)
    return UnittestCounts(ran=int(ran[-1]), skipped=skipped, not_passed_unnamed=skipped + others)
