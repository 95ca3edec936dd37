"""What a ``run_code`` report carries besides stdout and stderr (results, figures, an error's
texts) is held to the sandbox's ``output_bytes`` inside, where the interpreter makes it: the
bytes past it never cross the channel, and what was cut is marked where it was."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from stockade._cuts import CUT_MARK, cut_marker
from stockade.sandbox._replies import OutputCollector, execution
from stockade.sandbox.supervisor.protocol import CODE_REPORT_MARKS
from tests.unit.sandbox.conftest import SUPERVISOR

KiB = 1024
MiB = 1024 * KiB

# An object that shows itself as a PNG of ``size`` bytes, as a matplotlib figure does.
PICTURE = """
class Picture:
    def __init__(self, size):
        self.png = (bytes(range(256)) * (size // 256 + 1))[:size]
    def _repr_png_(self):
        return self.png
"""


@pytest.fixture(scope="module")
def interpreter() -> Iterator[Any]:
    sys.path.insert(0, str(SUPERVISOR))  # the supervisor's modules import each other by name
    try:
        module = importlib.import_module("interpreter")
        interp = module.Interpreter()
        interp.run(PICTURE)
        yield interp
    finally:
        sys.path.remove(str(SUPERVISOR))


def json_size(report: dict[str, Any]) -> int:
    return len(json.dumps({k: report[k] for k in ("results", "error")}))


def test_a_huge_repr_comes_back_cut_to_output_bytes_with_a_mark(interpreter: Any) -> None:
    report = interpreter.run("'x' * 10_000_000", 64 * KiB)
    (result,) = report["results"]
    text = result["text/plain"]
    assert report["truncated"] is True
    assert json_size(report) <= 64 * KiB + CODE_REPORT_MARKS
    mark = CUT_MARK.search(text)
    assert mark is not None and mark.end() == len(text), "the mark ends the text: its head is kept"
    assert text.startswith("'xxxx") and 60 * KiB < mark.start() <= 64 * KiB


def test_the_mark_is_the_one_the_redactor_knows(interpreter: Any) -> None:
    module = sys.modules["interpreter"]
    assert module.cut_mark(1_234, "past x") == cut_marker(1_234, "past x")


def test_figures_at_the_default_output_bytes_come_back_whole(interpreter: Any) -> None:
    report = interpreter.run("for _ in range(3): display(Picture(60_000))", 1 * MiB)
    assert "truncated" not in report
    assert [len(r["image/png"]) for r in report["results"]] == [80_000] * 3  # base64 of 60,000 bytes


def test_many_figures_keep_those_that_fit_and_say_how_many_were_dropped(interpreter: Any) -> None:
    report = interpreter.run("for _ in range(60): display(Picture(60_000))", 1 * MiB)
    results = report["results"]
    whole = [r for r in results if "image/png" in r]
    assert report["truncated"] is True and len(whole) == 13  # 13 x 80 KB fit in 1 MiB
    assert json_size(report) <= 1 * MiB + CODE_REPORT_MARKS
    assert "image/png dropped: 80000 characters, past the sandbox's output_bytes" in results[13]["text/plain"]
    assert results[14] == {
        "text/plain": "[stockade: 46 more results dropped, past the sandbox's output_bytes]"
    }


def test_a_figure_larger_than_output_bytes_leaves_its_text_and_a_note(interpreter: Any) -> None:
    report = interpreter.run("Picture(60_000)", 64 * KiB)
    (result,) = report["results"]
    assert set(result) == {"text/plain"} and result["text/plain"].startswith("<__main__.Picture object")
    assert "image/png dropped" in result["text/plain"]


def test_an_errors_texts_take_at_most_half_of_output_bytes_keeping_the_tracebacks_end(
    interpreter: Any,
) -> None:
    report = interpreter.run("raise ValueError('v' * 100_000 + ' the end')", 16 * KiB)
    error = report["error"]
    assert report["truncated"] is True and error["name"] == "ValueError"
    for text in (error["value"], error["traceback"]):  # a quarter each, and the mark
        assert 3 * KiB < len(json.dumps(text)) <= 4 * KiB + 100
    assert CUT_MARK.search(error["value"]) and error["value"].startswith("vvv")
    assert CUT_MARK.match(error["traceback"]) and error["traceback"].endswith("v the end\n")
    assert json_size(report) <= 16 * KiB + CODE_REPORT_MARKS


def test_the_cap_counts_bytes_of_json_whatever_the_characters(interpreter: Any) -> None:
    for text in ("é", "😀", "\x00"):  # 6, 12 and 6 bytes of JSON a character
        report = interpreter.run(f"{text!r} * 1_000_000", 64 * KiB)
        assert report["truncated"] is True
        assert json_size(report) <= 64 * KiB + CODE_REPORT_MARKS
        assert len(json.dumps(report["results"][0]["text/plain"])) > 32 * KiB, "room is used, not wasted"


def test_nothing_fits_in_a_cap_of_one_byte_but_the_marks(interpreter: Any) -> None:
    report = interpreter.run("for i in range(5): display(i)", 1)
    assert report["truncated"] is True and json_size(report) < CODE_REPORT_MARKS
    assert "4 more results dropped" in report["results"][-1]["text/plain"]


def test_the_host_says_a_report_the_interpreter_cut_was_truncated(interpreter: Any) -> None:
    report = interpreter.run("'x' * 100_000", 64 * KiB)
    streams = {1: OutputCollector(10), 2: OutputCollector(10)}
    result = execution({}, report, streams, lambda settle: False)
    assert result.truncated and result.text is not None and CUT_MARK.search(result.text)
    whole = execution({}, interpreter.run("'x'", 64 * KiB), streams, lambda settle: False)
    assert not whole.truncated
