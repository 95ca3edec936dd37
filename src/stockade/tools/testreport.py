"""Structured test results from the runner's own report.

pytest writes JUnit XML (``--junitxml``), which is parsed here; ``python -m unittest -v``
prints one line per test, which is parsed too; any other runner gives its plain output.
The XML comes out of the sandbox, so it is untrusted: a report over its size cap is not parsed
(expat, bundled with CPython >= 3.11, refuses entity-expansion bombs), nothing in it is
followed or executed, and one that cannot be read is no report: the plain output stands. It
is read a test case at a time, keeping counts, a bounded number of passing names and the
first ``MAX_FAILURES_SHOWN`` failure messages: a report just under the cap held ~128 MiB of
host memory as a tree.

``TestReport.ok`` is a pass: exit code 0, not timed out, no failed or errored test in what was
parsed, and nothing that contradicts it (``doubt``). Code in the sandbox can still forge a
report or a summary; what it cannot do is have a run counted a pass next to failures that
were parsed, or a pytest run that wrote no report counted a pass on its exit code alone.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from stockade.tools.deadline import checkpoint

__all__ = [
    "MAX_FAILURES_SHOWN",
    "MAX_NAMED_PASSES",
    "MAX_REPORT_BYTES",
    "ParsedTests",
    "TestFailure",
    "TestReport",
    "UnittestCounts",
    "parse_junit_xml",
    "parse_unittest_output",
    "unittest_counts",
]

MAX_REPORT_BYTES = 8 * 1024 * 1024
MAX_FAILURES_SHOWN = 50  # failures kept with their messages; the others are named only
MAX_NAMED_PASSES = 1000  # passing tests kept by name; the others are counted
_MAX_MESSAGE_CHARS = 4000  # of one failure's message (its head and tail)
_SHOWN_OUTPUT = 3000
_FEED_BYTES = 64 * 1024


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
    doubt: str = ""  # why the exit code is not a pass though it is 0, e.g. pytest wrote no report

    @property
    def ok(self) -> bool:
        """A pass: exit code 0 in time, no failed or errored test parsed, nothing to doubt it."""
        return (
            self.exit_code == 0
            and not self.timed_out
            and not self.failed
            and not self.errored
            and not self.doubt
        )

    @property
    def passed_count(self) -> int:
        return len(self.passed) + self.passed_unnamed

    def observation(self) -> str:
        if self.runner == "plain":
            head = f"$ {self.command}\nexit code {self.exit_code}" + (
                " (timed out)" if self.timed_out else ""
            )
            return f"{head}{self._doubted()}\n{self.output}"
        lines = [
            f"$ {self.command}",
            f"{self.runner}: {self.passed_count} passed, {len(self.failed)} failed, "
            f"{len(self.errored)} errors, {self.skipped} skipped (exit code {self.exit_code})"
            + (" (timed out)" if self.timed_out else "")
            + self._doubted(),
        ]
        for failure in self.failures:
            lines.append(f"\n{failure.kind.upper()} {failure.test_id}\n{failure.message.rstrip()}")
        unshown = len(self.failed) + len(self.errored) - len(self.failures)
        if self.failures and unshown > 0:
            lines.append(f"\n({unshown} more failed or errored tests not shown)")
        if not self.failures and not self.ok:
            tail = self.output[-_SHOWN_OUTPUT:]
            lines.append(f"\noutput (last {len(tail)} characters):\n{tail}")
        return "\n".join(lines)

    def _doubted(self) -> str:
        return f"; not a pass: {self.doubt}" if self.doubt and self.exit_code == 0 else ""


@dataclass(frozen=True, kw_only=True)
class ParsedTests:
    """What a runner's report or output says of each test."""

    passed: list[str] = field(default_factory=list)
    passed_unnamed: int = 0  # passes past MAX_NAMED_PASSES, counted only
    failed: list[str] = field(default_factory=list)
    errored: list[str] = field(default_factory=list)
    skipped: int = 0
    failures: list[TestFailure] = field(default_factory=list)  # the first MAX_FAILURES_SHOWN
    verbose: bool = False  # unittest: one line per test was printed (-v)

    @property
    def empty(self) -> bool:
        return not (self.passed or self.passed_unnamed or self.failed or self.errored or self.skipped)


def _cut(message: str) -> str:
    if len(message) <= _MAX_MESSAGE_CHARS:
        return message
    half = _MAX_MESSAGE_CHARS // 2
    return f"{message[:half]}\n[... {len(message) - 2 * half:,} characters cut ...]\n{message[-half:]}"


class _Element:
    """An open element of the report: a test case's outcome is held on it until it closes."""

    __slots__ = ("case", "childless", "error", "failure", "skipped", "text")

    def __init__(self, case: str | None) -> None:
        self.case = case  # the test id of a testcase
        self.failure: _Element | None = None
        self.error: _Element | None = None
        self.skipped = False
        self.text: list[str] | None = None  # of a failure or error being kept: its text
        self.childless = True


class _JUnitTarget:
    """Counts a JUnit report's test cases as expat reads them; no tree is built, and a
    passing case is a count once ``MAX_NAMED_PASSES`` are named."""

    def __init__(self) -> None:
        self.open: list[_Element] = []
        self.passed: list[str] = []
        self.unnamed = 0
        self.failed: list[str] = []
        self.errored: list[str] = []
        self.skipped = 0
        self.failures: list[TestFailure] = []

    def start(self, tag: str, attrib: dict[str, str]) -> None:
        parent = self.open[-1] if self.open else None
        if parent is not None:
            parent.childless = False
        if tag == "testcase":
            classname, name = attrib.get("classname", ""), attrib.get("name", "")
            element = _Element(f"{classname}::{name}" if classname else name)
        else:
            element = _Element(None)
        if parent is not None and parent.case is not None:
            # The first of each, as Element.find gave it.
            if tag == "skipped":
                parent.skipped = True
            elif tag in ("failure", "error") and getattr(parent, tag) is None:
                setattr(parent, tag, element)
                if len(self.failures) < MAX_FAILURES_SHOWN:
                    element.text = [attrib.get("message", "")]  # the message attribute, then text
        self.open.append(element)

    def data(self, text: str) -> None:
        top = self.open[-1] if self.open else None
        if top is not None and top.text is not None and top.childless:  # what Element.text was
            top.text.append(text)

    def end(self, tag: str) -> None:
        element = self.open.pop()
        if element.case is None:
            return
        checkpoint()
        test_id = element.case
        if element.skipped:
            self.skipped += 1
        elif element.failure is not None or element.error is not None:
            node = element.failure if element.failure is not None else element.error
            assert node is not None
            kind = "failed" if element.failure is not None else "error"
            (self.failed if kind == "failed" else self.errored).append(test_id)
            if node.text is not None and len(self.failures) < MAX_FAILURES_SHOWN:
                message, *text = node.text
                detail = "".join(text).strip()
                self.failures.append(TestFailure(test_id=test_id, kind=kind, message=_cut(detail or message)))
        elif len(self.passed) < MAX_NAMED_PASSES:
            self.passed.append(test_id)
        else:
            self.unnamed += 1

    def close(self) -> None:
        return None


def parse_junit_xml(xml: bytes) -> ParsedTests | None:
    """What a JUnit XML report says; None when it is not one this reads: over
    ``MAX_REPORT_BYTES``, not well-formed, or in an encoding expat refuses (ValueError for a
    multi-byte one such as shift_jis, LookupError for an unknown name or a codec that is not
    text, such as hex). Expat feeds it a test case at a time; no tree is built."""
    if len(xml) > MAX_REPORT_BYTES:
        return None
    target = _JUnitTarget()
    try:
        parser = ET.XMLParser(target=target)
        view = memoryview(xml)
        for at in range(0, len(xml), _FEED_BYTES):
            parser.feed(view[at : at + _FEED_BYTES])
        parser.close()
    except (SyntaxError, ValueError, LookupError):
        return None
    return ParsedTests(
        passed=target.passed,
        passed_unnamed=target.unnamed,
        failed=target.failed,
        errored=target.errored,
        skipped=target.skipped,
        failures=target.failures,
    )


_UNITTEST_LINE = re.compile(
    r"^(\w+) \(([\w.]+)\)(?:\n.*?)? \.\.\. (ok|FAIL|ERROR|skipped.*|expected failure)$", re.M
)
_UNITTEST_BLOCK = re.compile(
    r"^={50,}\n(FAIL|ERROR): (\w+) \(([\w.]+)\)\n-{50,}\n(.*?)(?=^={50,}|^-{50,}\nRan )", re.M | re.S
)


def parse_unittest_output(output: str) -> ParsedTests:
    """What ``python -m unittest`` output says of each test: every test by name with ``-v``,
    only those that failed or errored (their blocks) without."""
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
    # Every failure block names its test; only the first MAX_FAILURES_SHOWN keep their text.
    failures: list[TestFailure] = []
    named: dict[str, list[str]] = {"FAIL": [], "ERROR": []}
    for block in _UNITTEST_BLOCK.finditer(output):
        kind, name, where = block.group(1, 2, 3)
        test_id = f"{where.removesuffix('.' + name)}::{name}"
        named[kind].append(test_id)
        if len(failures) < MAX_FAILURES_SHOWN:
            failures.append(
                TestFailure(
                    test_id=test_id,
                    kind="failed" if kind == "FAIL" else "error",
                    message=_cut(block.group(4).strip()),
                )
            )
    verbose = bool(passed or failed or errored or skipped)
    if not verbose:  # the failure blocks still name them
        failed, errored = named["FAIL"], named["ERROR"]
    return ParsedTests(
        passed=passed, failed=failed, errored=errored, skipped=skipped, failures=failures, verbose=verbose
    )


@dataclass(frozen=True, kw_only=True)
class UnittestCounts:
    """The closing summary of a unittest run (``Ran 3 tests`` ... ``FAILED (failures=1)``)."""

    ran: int
    skipped: int = 0
    not_passed_unnamed: int = 0  # skipped, expected failures and unexpected successes
    verdict_ok: bool = False  # the summary closed with OK
    progress_failed: int = 0  # F and E in the progress line (quiet runs) that precedes it


_UNITTEST_RAN = re.compile(r"^Ran (\d+) tests? in ", re.M)
_UNITTEST_VERDICT = re.compile(r"^(OK|FAILED)(?: \((.*)\))?$", re.M)
# A quiet run's progress, one character a test, ends on the line before the failure blocks or
# the closing rule: a summary after an F there that says OK is not unittest's.
_UNITTEST_PROGRESS = re.compile(r"^([.FEsxu]+)\n(?:={50,}|-{50,})$", re.M)


def unittest_counts(output: str) -> UnittestCounts | None:
    """The counts of the last unittest summary in ``output``, if there is one."""
    ran = _UNITTEST_RAN.findall(output)
    if not ran:
        return None
    counts: dict[str, int] = {}
    verdicts = _UNITTEST_VERDICT.findall(output)
    verdict, details = verdicts[-1] if verdicts else ("", "")
    for item in details.split(","):
        key, _, value = item.strip().partition("=")
        if value.isdigit():
            counts[key] = int(value)
    skipped = counts.get("skipped", 0)
    others = counts.get("expected failures", 0) + counts.get("unexpected successes", 0)
    progress = _UNITTEST_PROGRESS.findall(output)
    return UnittestCounts(
        ran=int(ran[-1]),
        skipped=skipped,
        not_passed_unnamed=skipped + others,
        verdict_ok=verdict == "OK",
        progress_failed=sum(line.count("F") + line.count("E") for line in progress[-1:]),
    )
