"""What a cut may have kept of a credential, at the edges of a text someone cut before the
redactor saw it (``Redactor.head``, a text holding ``stockade._cuts.cut_marker``): where at its
end one may begin (``tail_start``: the ``TAIL_PATTERNS``, searched for in linear time) and how
much at the start of what follows a cut may end one (``LEAD``). Apart from the whole-text
patterns: only a cut text needs it, and its cost rules are its own.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

from stockade.audit._personal_data import PERSONAL_TAIL_PATTERNS
from stockade.audit._secret_patterns import LONGEST, SHELL, TAIL_PATTERNS, compile_patterns

__all__ = [
    "CUT_REDACTED",
    "HEAD_ROUNDS",
    "LEAD",
    "PERSONAL_LEAD",
    "PERSONAL_TAILS",
    "TAILS",
    "tail_start",
]

CUT_REDACTED = "[REDACTED:cut]"  # what may have begun a credential where a text was cut
# What right after a cut may be the end of a credential: the rest of its word, which ends where
# the shell ends one (``;`` ``|`` ``$`` ...; a backslash escapes one); for personal data, the
# rest of a number (a phone number's groups) too.
LEAD = re.compile(rf"(?:[^\s\"',\\\[\]{{}}{SHELL}]|\\[^\n])*")
PERSONAL_LEAD = re.compile(r"[^\s\"',;&|<>$`\[\]{}]*(?:[\d .\-()]*\d)?")
HEAD_ROUNDS = 8  # a tail held back, then the tail of what is left, ...: past this, nothing is kept

# name -> the characters a tail pattern's whole match is made of: it lies in the last run of
# them, and is searched for there. From the text's start, each of its starts in an earlier run
# (every ``sk-`` of ``sk-sk-…sk-!``) was a scan to that run's end: a time quadratic in the run.
_WORD_CHARS = string.ascii_letters + string.digits + "_"
_TAIL_RUNS = {
    "api_key": _WORD_CHARS + "-",
    "github_token": _WORD_CHARS,
    "slack_token": _WORD_CHARS + "-",
    "stripe_key": _WORD_CHARS,
    "gitlab_token": _WORD_CHARS + "-",
    "huggingface_token": _WORD_CHARS,
    "npm_token": _WORD_CHARS,
    "jwt": _WORD_CHARS + "-.",
    "email": _WORD_CHARS + ".%+-@",
    "number": string.digits + " .-()+",
    "iban": string.ascii_uppercase + string.digits + " ",
    "ipv6": string.hexdigits + ":",
}
# Other tail patterns are searched for in the text's last characters: one starting before them
# holds a value longer than a complete match needs, which the whole-text patterns replace.
_TAIL_WINDOW = 2 * LONGEST
_Tail = tuple[re.Pattern[str], str | None]
TAILS: list[_Tail] = [(pattern, _TAIL_RUNS.get(name)) for name, pattern in compile_patterns(TAIL_PATTERNS)]
PERSONAL_TAILS: list[_Tail] = [
    (pattern, _TAIL_RUNS.get(name)) for name, pattern in compile_patterns(PERSONAL_TAIL_PATTERNS)
]


def tail_start(text: str, patterns: Sequence[_Tail]) -> int:
    """Where the earliest of ``patterns`` begins a match that runs to the end of ``text`` (its
    ``keep`` group stays); ``len(text)`` when none does."""
    start = len(text)
    for pattern, run in patterns:
        at = len(text.rstrip(run)) if run is not None else len(text) - _TAIL_WINDOW
        match = pattern.search(text, max(at, 0))
        if match is not None:
            start = min(start, match.end("keep") if "keep" in pattern.groupindex else match.start())
    return start
