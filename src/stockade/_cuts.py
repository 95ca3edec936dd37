"""The mark left where the middle of a text was cut (a long tool output, a quoted argument).

Apart from the cutters and the redactor, which both know it: the redactor treats what comes
before a mark as a text cut at its end and what comes after as one cut at its start, so that
no half of a secret the cut split is written (``stockade.audit.redact``). A text that says what
was done (a command, code, a call's arguments) is never one stockade cut so: ``plain`` makes a
mark typed into it plain text first, or the word after it would be hidden from the trail.
"""

from __future__ import annotations

import re

__all__ = ["CUT_MARK", "cut_marker", "plain"]

# one line, its own: a newline, the mark, a newline
CUT_MARK = re.compile(r"\n\[… [\d,]+ characters cut(?: [^\n]*)? …\]\n")
# the same line, its newlines looked at, not taken: two marks back to back share a newline,
# which ``CUT_MARK.sub`` took with the first, leaving the second a mark
_MARK_LINE = re.compile(r"(?<=\n)\[… [\d,]+ characters cut(?: [^\n]*)? …\](?=\n)")


def cut_marker(chars: int, note: str = "") -> str:
    """What replaces ``chars`` characters cut from the middle of a text; ``note`` (made one
    line) says where the rest is."""
    note = " ".join(note.split())
    return f"\n[… {chars:,} characters cut{' ' + note if note else ''} …]\n"


def plain(text: str) -> str:
    """``text``, which nobody cut, with each mark-shaped line in it written with "..." for "…":
    read as its author's text, by the redactor too (``ls`` + a mark + ``rm -rf src`` recorded
    the ``rm`` as ``[REDACTED:cut]``; so did a second mark right after a first)."""
    if "characters cut" not in text:
        return text
    return _MARK_LINE.sub(lambda mark: mark.group().replace("…", "..."), text)
