"""Text from a sandbox, made safe to show on a terminal.

What a terminal acts on rather than shows: C0 controls (ESC starts the sequences that clear
the screen, move the cursor, erase a line), DEL, C1 controls, and the bidirectional overrides
that reorder what is shown. Text that code in a sandbox chose (an action waiting for
approval, a record, a file name) passes through ``controls_shown`` before it reaches one, so
that it cannot clear the screen or overwrite a ``deny`` with a line of its own.
"""

from __future__ import annotations

import re

__all__ = ["controls_shown"]

_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_CONTROLS_AND_LINES = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def controls_shown(text: str, *, one_line: bool = False) -> str:
    """Every control character in ``text`` shown as its escape (``\\x1b``), never acted on;
    ``one_line``: newlines and tabs too."""
    pattern = _CONTROLS_AND_LINES if one_line else _CONTROLS
    return pattern.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
