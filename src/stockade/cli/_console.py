"""The consoles every command prints through.

On a terminal, long lines wrap at its width. Anywhere else (a file, a pipe, a test runner)
nothing is wrapped or cut: a line of a diff or of a command's output arrives whole, whatever
``COLUMNS`` rich would otherwise assume (80).
"""

from __future__ import annotations

import re

from rich.console import Console, ConsoleDimensions
from rich.markup import escape as escape_markup
from rich.syntax import Syntax

__all__ = ["CliConsole", "escape", "print_diff"]

# What a terminal acts on rather than shows: C0 controls (ESC starts the sequences that clear
# the screen, move the cursor, erase a line), DEL, C1 controls, and the bidirectional
# overrides that reorder what is shown. Rich drops a few (BEL, BS, VT, FF, CR), not ESC.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_CONTROLS_AND_LINES = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def escape(text: str, *, one_line: bool = False) -> str:
    """``text`` for a console: rich's markup escaped, and every terminal control character
    shown as its escape (``\\x1b``), never acted on: what a record shows came from code in a
    sandbox, which could otherwise clear the screen, or overwrite a ``deny`` with a line of
    its own. ``one_line``: newlines and tabs too (an exec's argv: a newline in it printed a
    line that looked like another exec)."""
    return escape_markup(_controls_shown(text, _CONTROLS_AND_LINES if one_line else _CONTROLS))


def _controls_shown(text: str, pattern: re.Pattern[str] = _CONTROLS) -> str:
    return pattern.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


# Wide enough for any line; rich sizes tables and text to their content, so nothing is padded.
UNBOUNDED_WIDTH = 1_000_000


class CliConsole(Console):
    def __init__(self, *, stderr: bool = False) -> None:
        super().__init__(stderr=stderr, soft_wrap=True)

    @property
    def size(self) -> ConsoleDimensions:
        if not self.is_terminal:
            return ConsoleDimensions(UNBOUNDED_WIDTH, 25)
        return Console.size.fget(self)  # type: ignore[attr-defined,no-any-return]

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


def print_diff(console: Console, diff: str) -> None:
    """A unified diff: coloured on a terminal (wrapped, never cropped), plain text elsewhere;
    its terminal controls shown as escapes either way (a file the model wrote held `ESC[2J`,
    and `stockade runs show` cleared the screen)."""
    diff = _controls_shown(diff)
    if console.is_terminal:
        console.print(Syntax(diff, "diff", theme="ansi_dark", background_color="default", word_wrap=True))
    else:
        console.file.write(diff if diff.endswith("\n") else diff + "\n")
