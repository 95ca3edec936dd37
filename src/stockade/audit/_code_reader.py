"""A program's source in a language other than a shell's read statement by statement
(``CodeText``, ``code_pieces``): each line cut at a ``;`` outside a string and after the quote
that closes one, a private key block whole, and a string literal given to a credential's name
a piece of its own. Apart from the shell's reader: code quotes and ends its values otherwise.
"""

from __future__ import annotations

import re

from stockade.audit._secret_patterns import GIVES, LONGEST, NAMES, TOKEN_PATTERNS

__all__ = ["TRIPLES", "CodePiece", "CodeText", "code_pieces"]


class CodeText(str):
    """A program's source in a language other than a shell's (``run_code``'s Python, node,
    ...): a ``Redactor`` replaces only inside each of its statements (``Redactor.code``), so
    that a value never runs past the quote that closes its string (``P = "--password ";
    os.rmdir(...)`` was recorded as ``P = "--password "[REDACTED:flag]"...``). It stays one when
    redacted and cut, as ``ShellText`` does."""

    __slots__ = ()


# A key's lines in code: one piece, redacted whole (OpenPGP's armor too).
_CODE_KEY_BLOCK = re.compile(f"{TOKEN_PATTERNS['private_key']}|{TOKEN_PATTERNS['pgp_private_key']}")
_GIVEN = re.compile(rf"[ \t]*{GIVES}")  # after a string, a value given to it (a key: ``"password":``)
_QUOTES = "'\"`"
TRIPLES = ('"""', "'''")
# A credential's name right before where a value is given to it in code (what is looked back
# over: a name's end, then blanks and the quote that closes a key's string).
_CODE_NAME = re.compile(rf"(?i:{NAMES})['\"]?[ \t]*\Z")
_NAME_REACH = 32
# What a value given in code begins with, after blanks and a ``(``: a string (a literal, which
# is the value) or a name (an expression: ``password = os.system``, whose call is no secret).
_CODE_VALUE = re.compile(r"[ \t]*(?:\([ \t]*)?(?:(?P<quote>\"\"\"|'''|['\"`])|[A-Za-z_$])")
# A code piece: its span, and whether it is a string literal given to a credential's name
# (its text between its quotes is replaced whole: ``\'`` and ``;`` in it are its own).
CodePiece = tuple[int, int, bool]


def code_pieces(text: str) -> list[CodePiece]:
    """The spans of ``text``, a program's source, that are redacted each alone: each private
    key block, and elsewhere each line cut at a ``;`` outside a string and right after the
    quote that closes a string (but a key's: ``"token": "x"`` is one piece); a string given to
    a credential's name is a piece of its own, and what a name is given that is no string (an
    expression) begins one."""
    pieces: list[CodePiece] = []
    at = 0
    for key in _CODE_KEY_BLOCK.finditer(text):
        pieces += _statements(text, at, key.start())
        pieces.append((*key.span(), False))
        at = key.end()
    return pieces + _statements(text, at, len(text))


def _statements(text: str, start: int, end: int) -> list[CodePiece]:
    """The pieces of ``text[start:end]`` (see ``code_pieces``). Strings are read as most
    languages write them (``'``, ``"``, a backtick or Python's triple quotes, a backslash
    escaping the next character, none but a triple-quoted one running past its line): a
    language that reads them otherwise gets pieces cut at other quotes, never a value longer
    than a line but a triple-quoted string's that is given to a credential's name."""
    pieces: list[CodePiece] = []
    piece = i = start
    quote = ""
    unclosed: dict[str, int] = {}  # a triple quote: from where none closes one (read once)
    while i < end:
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if not quote and char in "=:" and (given := _given_at(text, piece, i, end)) is not None:
            value, literal_end = given
            if value > piece:
                pieces.append((piece, value, False))
            if literal_end is not None:
                pieces.append((value, literal_end, True))
            piece = i = literal_end if literal_end is not None else value
            continue
        if char == "\n" and quote not in TRIPLES:
            pieces.append((piece, i, False))
            piece, quote = i + 1, ""
        elif char == "\n" or (char == ";" and not quote):
            pieces.append((piece, i, False))
            piece = i + 1
        elif quote and text.startswith(quote, i):
            i += len(quote) - 1
            quote = ""
            if not _GIVEN.match(text, i + 1, end):
                pieces.append((piece, i + 1, False))
                piece = i + 1
        elif not quote and char in _QUOTES:
            quote = _opening(text, i, end, unclosed)
            i += len(quote) - 1
        i += 1
    pieces.append((piece, end, False))
    return [(a, b, literal) for a, b, literal in pieces if a < b]


def _opening(text: str, i: int, end: int, unclosed: dict[str, int]) -> str:
    """The quote that opens a string at ``i``: a triple one only when one closes it."""
    for triple in TRIPLES:
        if text.startswith(triple, i) and i + 3 < unclosed.get(triple, end + 1):
            if text.find(triple, i + 3, end) >= 0:
                return triple
            unclosed[triple] = i + 3
    return text[i]


def _given_at(text: str, piece: int, i: int, end: int) -> tuple[int, int | None] | None:
    """At ``i``, outside a string, a ``=`` or ``:`` that gives a credential's name a value:
    where that value begins, and where it ends when it is a string literal (its closing quote
    on its line, but a triple quote's; no longer than a credential). ``None``: none is given
    there, or a value that is neither (a number, a list: read as the patterns read it)."""
    gives = _GIVES_AT.match(text, i, end)
    if gives is None or (i > piece and text[i - 1] in "=!<>"):
        return None
    if _CODE_NAME.search(text, max(piece, i - _NAME_REACH), i) is None:
        return None
    value = _CODE_VALUE.match(text, gives.end(), end)
    if value is None:
        return None
    quote = value.group("quote")
    if quote is None:  # an expression: kept, but for a token's shape the patterns find in it
        return value.end() - 1, None
    close = _closing(text, value.end(), end, quote)
    if close is None:
        return None
    return value.end() - len(quote), close + len(quote)


_GIVES_AT = re.compile(GIVES)


def _closing(text: str, i: int, end: int, quote: str) -> int | None:
    """Where the string whose text starts at ``i`` closes, within ``LONGEST`` characters (and
    its line, but a triple quote's); ``None``: not there."""
    last = min(end, i + LONGEST + 1)
    while i < last:
        if text[i] == "\\":
            i += 2
        elif text.startswith(quote, i):
            return i
        elif text[i] == "\n" and quote not in TRIPLES:
            return None
        else:
            i += 1
    return None
