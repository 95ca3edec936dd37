"""What the command line prints of what came from a sandbox or a model: terminal controls
shown as escapes, never acted on."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console
from typer.testing import CliRunner

from stockade.cli._console import escape, print_diff
from stockade.cli.main import app
from stockade.policy.approval import ApprovalRequest, ApprovalStore

CLEAR = "\x1b[2J\x1b]0;title\x07"


def test_a_diff_is_printed_with_its_controls_escaped_on_a_terminal_or_not() -> None:
    """A file the model wrote held `ESC[2J`: `stockade runs show` and `stockade agent` wrote
    the diff raw, and cleared the screen."""
    diff = f"--- /dev/null\n+++ b/NOTES.md\n@@ -0,0 +1 @@\n+{CLEAR}\ttab kept\n"
    for terminal in (False, True):
        out = io.StringIO()
        print_diff(Console(file=out, force_terminal=terminal, color_system=None, width=200), diff)
        assert "\x1b[2J" not in out.getvalue() and "\x07" not in out.getvalue()
        assert "\\x1b[2J" in out.getvalue() and "tab kept" in out.getvalue()


def test_an_answer_is_escaped_markup_and_controls_alike() -> None:
    shown = escape(f"[red]done[/] {CLEAR}\u202e")
    assert "\x1b" not in shown and "\u202e" not in shown and "\\[red]" in shown


def test_an_action_waiting_for_approval_is_listed_with_its_controls_shown(tmp_path: Path) -> None:
    """Code chose the action's words: `rm -r b; echo ESC[2J...FAKE: approved by admin` cleared
    the approver's screen in `stockade approvals` and drew a line of its own."""
    action = f"run `rm -r b; echo '{CLEAR}\x1b[1;31mFAKE: approved by admin'`"
    ApprovalStore(tmp_path).submit(
        ApprovalRequest(run_id="r1", action=action, rule="commands.approve", reason="rm -r")
    )
    listed = CliRunner().invoke(app, ["approvals", "--dir", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    assert "\x1b" not in listed.output and "\x07" not in listed.output
    assert "\\x1b[2J" in listed.output and "FAKE" in listed.output


def test_a_zero_width_character_in_an_action_is_listed_as_its_escape(tmp_path: Path) -> None:
    """`rm -r ./sr<ZWSP>c` was listed by `stockade approvals` as `rm -r ./src`."""
    ApprovalStore(tmp_path).submit(
        ApprovalRequest(
            run_id="r1", action="run `rm -r ./sr\u200bc`", rule="commands.approve", reason="rm -r"
        )
    )
    listed = CliRunner().invoke(app, ["approvals", "--dir", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    assert "\u200b" not in listed.output and "./sr\\u200bc" in listed.output
