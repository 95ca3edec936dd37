"""The agent on the real process tier: the demo end to end, and run_tests under both runners."""

from __future__ import annotations

import pytest

from stockade import Sandbox
from stockade.agent import AgentEvent, ToolReturned
from stockade.demo import SAMPLE_PROJECT, run_demo
from stockade.runtime.events import RetryScheduled, RuntimeEvent
from stockade.tools import ToolContext, run_tests
from stockade.tools.testreport import TestReport
from tests.conftest import require, require_tier

pytestmark = pytest.mark.process


def test_the_demo_fixes_the_sample_project_with_a_retry_on_the_way() -> None:
    require_tier("process")
    events: list[AgentEvent] = []
    retries: list[RuntimeEvent] = []
    result = run_demo(observers=[events.append], on_retry=retries.append)

    assert result.ok, result.error
    assert result.check is not None and result.check.passed  # "success" is the check's word, too
    reports = [e.value for e in events if isinstance(e, ToolReturned) and isinstance(e.value, TestReport)]
    assert [r.ok for r in reports] == [False, True]  # tests fail, then pass
    assert reports[0].failed[0].endswith("test_restock_includes_items_at_the_threshold")
    assert "+    return sorted(name for name, count in stock.items() if count <= threshold)" in result.diff
    assert [type(r) for r in retries] == [RetryScheduled]
    assert "ResourceContention" in retries[0].reason  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "command",
    [
        "python3 -m unittest -v",
        "python3 -m pytest -q -p no:cacheprovider",
        # what runs is the line as given: a sequence, a cd, an assignment and a pipe
        "echo first; cd proj && X='a b' python3 -m unittest -v 2>&1 | cat; exit 1",
        "sleep 0.1; cd proj && X='a b' python3 -m pytest -q -p no:cacheprovider | cat; exit 1",
    ],
)
async def test_run_tests_reports_each_test_from_the_runner(command: str) -> None:
    require_tier("process")
    nested = "cd proj" in command
    with Sandbox.create(tier="process", workspace=None if nested else SAMPLE_PROJECT) as sbx:
        if nested:
            sbx.files.upload_dir(SAMPLE_PROJECT, "proj")
        if "pytest" in command:
            has_pytest = sbx.commands.run(["python3", "-c", "import pytest"]).ok
            require("pytest in the sandbox", has_pytest, "scripts/bootstrap.sh installs python3-pytest")
        ctx = ToolContext(sandbox=sbx, step=1, call_id="t")
        report = await run_tests.invoke(ctx, run_tests.validate({"command": command}))
    assert isinstance(report, TestReport)
    assert report.runner in command and report.exit_code == 1
    assert len(report.passed) == 2 and len(report.failed) == 1
    assert "AssertionError" in report.failures[0].message
    if command.startswith("echo first;"):
        assert report.output.startswith("first\n")  # not `echo 'first;' cd proj ...`
