"""Untrusted text made safe to show: on a terminal, in the run viewer, to a human approving.

Text that a model or code in a sandbox chose (an action waiting for approval, a task, a
record, a file name, an observation) can hold characters that are acted on or reorder what is
shown rather than being shown themselves:

- C0 controls (ESC starts the sequences that clear a screen, move the cursor, erase a line),
  DEL, and C1 controls (U+009B is an 8-bit CSI a terminal acts on);
- bidirectional controls (U+202A-U+202E, U+2066-U+2069, U+061C): a browser drew
  ``echo "clean<RLO><LRI>"<PDI><LRI> ; rm -r src ; true <PDI><PDF>`` as if ``rm -r src`` were
  inside the echoed string, and the human approved it;
- invisible characters (U+200B-U+200F, U+2060-U+2064, U+FEFF, the tag characters
  U+E0000-U+E007F): ``./sr<ZWSP>c`` reads as ``./src``;
- lone surrogates, which are no text at all (UTF-8 cannot write them).

``visible`` shows each as its escape (``\\u202e``, ``\\x1b``), and ``visible_json`` does the
same inside JSON text with JSON's own escapes (the JSON decodes to the same value). Every
surface uses them: the CLI, the run viewer (each rendered value), and the words of an
approval themselves (``policy.guards.shown``), so that all of them show the same text.
"""

from __future__ import annotations

import re

__all__ = ["UNSHOWN", "visible", "visible_json"]

# What is never shown raw. Newline and tab are text, kept but on one line. Besides controls
# and bidi marks, what draws as nothing or as a space, or joins what it follows unseen: the
# soft hyphen and grapheme joiner, Hangul and Mongolian fillers, line and paragraph separators
# (a line break to a browser, none to a terminal), deprecated format characters, variation
# selectors (bytes hidden after a visible character), interlinear annotations and musical
# format characters: an approver saw `./src/` for `./sr\xadc/`, found from outside.
UNSHOWN = (
    "\x00-\x08\x0b-\x1f\x7f-\x9f\xad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180e"
    "\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0"
    "\ufff9-\ufffb\ud800-\udfff\U0001d173-\U0001d17a\U000e0000-\U000e007f\U000e0100-\U000e01ef"
)
_UNSHOWN = re.compile(f"[{UNSHOWN}]")
_UNSHOWN_OR_LINES = re.compile(f"[{UNSHOWN}\n\t]")
_NAMED = {"\n": "\\n", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def visible(text: str, *, one_line: bool = False) -> str:
    """``text`` with every character that would be acted on, reorder the text or not be seen
    shown as its escape (``\\x1b``, ``\\u202e``, ``\\U000e0041``); ``one_line``: newlines and
    tabs too (``\\n``, ``\\t``)."""
    return (_UNSHOWN_OR_LINES if one_line else _UNSHOWN).sub(_escape, text)


def _json_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000  # JSON writes a character beyond the BMP as its surrogate pair
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def visible_json(text: str) -> str:
    """JSON text (``json.dumps(..., ensure_ascii=False)``) with the same characters as
    ``visible`` written as JSON escapes: it decodes to the same value, shows nothing raw, and
    UTF-8 can write it (a lone surrogate too). Those characters are only ever in its strings."""
    return _UNSHOWN.sub(_json_escape, text)
