"""The run's diff on the real process tier, for a workspace whose text and names are not all
Latin-1: the baseline holds them, and the diff shows the run's change and nothing else."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stockade import Sandbox
from stockade.agent import Agent
from stockade.testing import ScriptedModel, tool_call
from stockade.tools.workspace_diff import record_baseline, workspace_diff
from tests.conftest import require_tier

pytestmark = pytest.mark.process

DEBUG_PATCH = "--- a/config.py\n+++ b/config.py\n@@ -1 +1 @@\n-DEBUG = False\n+DEBUG = True\n"
UNNAMED = "Left out (names not UTF-8, shown with U+FFFD; not read or compared): 'caf\ufffd.txt'\n"


def _workspace(root: Path) -> Path:
    """A curly apostrophe (U+2019), a euro sign, an emoji, CJK, and a name not UTF-8."""
    require_tier("process")
    (root / "README.md").write_text("It\u2019s a project.\n", encoding="utf-8")
    (root / "prices.txt").write_text("5 \u20ac\n", encoding="utf-8")
    (root / "notes.md").write_text("done \U0001f600\n", encoding="utf-8")
    (root / "\u6f22\u5b57.txt").write_text("\u6f22\u5b57\n", encoding="utf-8")
    (root / os.fsdecode(b"caf\xe9.txt")).write_text("latin-1 name\n")
    (root / "config.py").write_text("DEBUG = False\n")
    return root


def test_a_workspace_past_latin_1_diffs_only_its_real_change(tmp_path: Path) -> None:
    """One such character wiped the baseline: every file showed as new (--- /dev/null) and
    DEBUG = False -> True was nowhere to be seen."""
    with Sandbox.create(tier="process", workspace=_workspace(tmp_path)) as sbx:
        baseline = record_baseline(sbx)
        sbx.files.write("config.py", "DEBUG = True\n")
        assert workspace_diff(sbx, baseline=baseline) == DEBUG_PATCH + UNNAMED


def test_a_runs_diff_and_git_diff_show_only_its_real_change(tmp_path: Path) -> None:
    """What the run keeps and what git_diff shows the model: the change, not the workspace."""
    write = tool_call("write_file", {"path": "config.py", "content": "DEBUG = True\n"})
    model = ScriptedModel([write, tool_call("git_diff"), "done"])
    with Sandbox.create(tier="process", workspace=_workspace(tmp_path)) as sbx:
        result = Agent(model).run_sync("go", sandbox=sbx)
    shown = result.steps[1].tool_calls[0]
    assert not shown.is_error, shown.observation
    assert shown.observation == f"(changes since the run began; not a git repository)\n{DEBUG_PATCH}{UNNAMED}"
    assert result.diff == DEBUG_PATCH + UNNAMED
