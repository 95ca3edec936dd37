"""The mark left where the middle of a text was cut (a long tool output, a quoted argument).

Apart from the cutters and the redactor, which both know it: the redactor treats what comes
before a mark as a text cut at its end and what comes after as one cut at its start, so that
no half of a secret the cut split is written (``stockade.audit.redact``).
"""

from __future__ import annotations

import re

__all__ = ["CUT_MARK", "cut_marker"]

# one line, its own: a newline, the mark, a newline
CUT_MARK = re.compile(r"\n\[… [\d,]+ characters cut(?: [^\n]*)? …\]\n")


def cut_marker(chars: int, note: str = "") -> str:
    """What replaces ``chars`` characters cut from the middle of a text; ``note`` (made one
    line) says where the rest is."""
    note = " ".join(note.split())
    return f"\n[… {chars:,} characters cut{' ' + note if note else ''} …]\n"
