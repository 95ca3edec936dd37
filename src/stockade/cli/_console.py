"""The consoles every command prints through.

On a terminal, long lines wrap at its width. Anywhere else (a file, a pipe, a test runner)
nothing is wrapped or cut: a line of a diff or of a command's output arrives whole, whatever
``COLUMNS`` rich would otherwise assume (80).
"""

from __future__ import annotations

import json

from rich.console import Console, ConsoleDimensions
from rich.markup import escape as escape_markup
from rich.syntax import Syntax

from stockade._display import visible, visible_json

__all__ = ["CliConsole", "escape", "print_diff", "print_json"]


def escape(text: str, *, one_line: bool = False) -> str:
    """``text`` for a console: rich's markup escaped, and every terminal control character
    shown as its escape (``\\x1b``), never acted on (``stockade._display``). Rich drops a
    few controls itself (BEL, BS, VT, FF, CR), not ESC. ``one_line``: newlines and tabs too
    (an exec's argv: a newline in it printed a line that looked like another exec)."""
    return escape_markup(visible(text, one_line=one_line))


def print_json(value: object) -> None:
    """``value`` as one line of JSON on stdout (``--json``), what code or a model chose in it
    (U+009B, an 8-bit CSI; U+202E, a bidi override) as JSON escapes: it decodes to the same
    value and shows nothing raw on a terminal (``stockade._display``)."""
    print(visible_json(json.dumps(value, ensure_ascii=False)))


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
    diff = visible(diff)
    if console.is_terminal:
        console.print(Syntax(diff, "diff", theme="ansi_dark", background_color="default", word_wrap=True))
    else:
        console.file.write(diff if diff.endswith("\n") else diff + "\n")
