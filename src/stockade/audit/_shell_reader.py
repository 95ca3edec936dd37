"""A command's text read as the shell reads it (``ShellText``): its words, quotes, ``$(...)``,
backticks and here-documents, as the spans a ``Redactor`` redacts each alone
(``shell_pieces``); a word as the shell joins its quoted parts (``unquoted``); and an argv's
words (``command_program``, ``flag_value``). Apart from the patterns: it knows the shell's
grammar, not what a credential looks like (but for the words whose value is the next word).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from stockade.audit._secret_patterns import NAMES

__all__ = [
    "QUOTING",
    "ShellText",
    "changed",
    "command_program",
    "flag_value",
    "shell_pieces",
    "unquoted",
]

# A word of an argv that is a credential's flag alone (``--password``, ``--api-key``; not ``-p``,
# which is a port, a parent or a path as often), and the user flag of curl and its kin.
_FLAG_WORD = re.compile(rf"--?[\w\-]*(?i:{NAMES})")
_USER_FLAGS = frozenset({"-u", "--user"})
_USER_WORD = re.compile(r"([^:]+:)(?!\d+\Z)(.+)", re.DOTALL)  # user:password, not uid:gid
_COOKIE_FLAGS = frozenset({"-b", "--cookie"})
_COOKIE_WORD = re.compile(r"([^=;\s]+=)(.+)", re.DOTALL)  # name=value, not a cookie file
_OPENSSL_PASS = frozenset({"-pass", "-passin", "-passout"})
_AWS_NAME = re.compile(r"(?i:aws_(?:secret_access_key|session_token))")
# curl and its kin: the programs whose ``-u`` is a user and password and ``-b`` cookies
# (``python3 -u`` is unbuffered, ``sort -u`` unique, ``cp -b`` a backup).
_HTTP_CLIENTS = frozenset({"curl", "curlie", "wget", "http", "https", "xh", "xhs"})
# What runs the program its next word names (``sudo curl``), and an assignment before it.
_WRAPPERS = frozenset({"sudo", "env", "command", "exec", "nohup", "time", "builtin", "xargs"})
_ASSIGNS = re.compile(r"[A-Za-z_]\w*=")


def command_program(words: Iterable[str]) -> str:
    """The name of the program a command's words run (``/usr/bin/curl`` is ``curl``): its first
    word that is no assignment, option nor wrapper (``FOO=1 sudo -E curl`` runs ``curl``)."""
    for word in words:
        if not _before_program(word):
            return word.rsplit("/", 1)[-1]
    return ""


def _before_program(word: str) -> bool:
    return _ASSIGNS.match(word) is not None or word.startswith("-") or word in _WRAPPERS


def flag_value(words: Sequence[str], at: int) -> str | None:
    """What replaces ``words[at]``, a word of an argv, when it is the value of a credential's
    flag given as a word of its own (``["--password", "x"]``, curl's ``["-u", "user:x"]``,
    openssl's ``["-passin", "pass:x"]``): each word redacted alone shows none of them.
    ``None``: it is not one."""
    before, word = (words[at - 1] if at else ""), words[at]
    if not word or word.startswith(("-", "[REDACTED")):
        return None
    if _FLAG_WORD.fullmatch(before) or _AWS_NAME.fullmatch(before):
        return "[REDACTED:flag]"
    if before in _OPENSSL_PASS and word.startswith("pass:"):
        return "pass:[REDACTED:openssl_pass]"
    http = before in _USER_FLAGS | _COOKIE_FLAGS and command_program(words[:at]) in _HTTP_CLIENTS
    found = (_USER_WORD if before in _USER_FLAGS else _COOKIE_WORD).fullmatch(word) if http else None
    kind = "user_password" if before in _USER_FLAGS else "cookie"
    return None if found is None else f"{found.group(1)}[REDACTED:{kind}]"


class ShellText(str):
    """A text a shell runs (``sh -c``'s script, a command tool's ``command``): a ``Redactor``
    replaces only inside each word the shell reads in it, never across one (``Redactor.shell``).
    It stays one when redacted and cut, so that the log's own pass over an event reads it so too.
    """

    __slots__ = ()


# Why a reader of our own: ``shlex`` gives no positions, knows no ``$(...)`` nor backticks, and
# takes ``#`` and ``;`` for words. A regex cannot tell a quote that opens a value from one that
# closes an earlier string: ``X="PASSWORD="ab rm -rf src""`` runs ``rm``, and the whole-text
# pass recorded ``X="PASSWORD="[REDACTED:quoted_assignment]""``.
_ENDS = frozenset(" \t\n;&|<>()")  # what ends a word that is not quoted: a blank, an operator
# A run of characters no shell ends a word in, whatever the quoting: no blank, operator or
# backtick, and a backslash takes the next character but a newline (what it escapes, or
# inside quotes what is quoted too). Every such run lies inside one word the shell reads.
_RUN = re.compile(r"(?:[^\s;&|<>()`\\]|\\[^\n])+")
# A word whose value is the next word: a credential's flag, openssl's ``-passin``, an HTTP
# scheme, the word password, a name given with ``:`` or ``=>`` (never ``NAME= x``: the shell
# runs ``x``), ``aws configure set``'s secret names; and curl's user and cookies, only in a
# command of curl and its kin (``_HTTP_CLIENTS``).
_VALUE_NEXT = re.compile(
    rf"--?[\w\-]*(?i:{NAMES})|-pass(?:in|out)?|[Bb]earer|Basic|[Tt]oken|(?i:password|passwd|passphrase)"
    rf"|\S*(?i:{NAMES})\\?[\"']?(?:=>|:)|(?i:cookie):|{_AWS_NAME.pattern}"
)
_HTTP_VALUE_NEXT = _USER_FLAGS | _COOKIE_FLAGS
# What parts a command from the one before it (``;``, ``&&``, ``|``, a newline, ``$(``, ...).
_COMMAND_ENDS = frozenset(";&|()\n`")
# In a here-document's text (a config file, a script for another language) a name is given its
# value with blanks around too (``PASSWORD = "x"``): a word naming a credential, and ``=``.
_NAME_WORD = re.compile(rf"\S*(?i:{NAMES})\\?[\"']?")
_GIVES_WORD = frozenset({"=", ":", "=>"})
# And a YAML name's value on the next line, indented (``password:\n  x``, ``token: |\n  x``).
_YAML_GAP = re.compile(r"[ \t]*(?:[|>][+\-]?[1-9]?[ \t]*)?\r?\n[ \t]+")
# A private key in a here-document's text, from its BEGIN line to its END line: a piece of its
# own, since its lines are no shell words. Its lines: base64, or a header of words.
_KEY_BLOCK = re.compile(
    r"^[ \t]*-----BEGIN (?P<kind>[A-Z ]*PRIVATE KEY(?: BLOCK)?)-----[ \t]*\r?\n"
    r"(?:[ \t]*(?:[\w\-]+:[ \t][\w .,@+/:=\t\-]*|[A-Za-z0-9+/=]*[ \t]*)\r?\n)*"
    r"[ \t]*-----END (?P=kind)-----",
    re.MULTILINE,
)
_DEEPEST = 3  # here-documents in here-documents: past this, the text is read as runs


QUOTING = re.compile(r"['\"\\]")
_MARK = re.compile(r"\[REDACTED[^\]]*\]")


# Where a character of a word read as the shell reads it comes from: its span in the word (with
# the backslash that escapes it), and the span of the quotes around it (its own span when none).
_Source = tuple[int, int, tuple[int, int]]


def unquoted(word: str) -> tuple[str, list[_Source]]:
    """``word`` as the shell reads it, its quotes gone and what they escape kept (``"a"'b'`` is
    ``ab``, bash's ``$'x'`` is ``x``, an unclosed quote runs to the end); and where each of its
    characters comes from."""
    chars: list[str] = []
    sources: list[_Source] = []
    quote, opened, inside, i = "", 0, 0, 0
    while i < len(word):
        char, escaped = word[i], word[i + 1 : i + 2]
        size = (
            2 if char == "\\" and escaped and (quote != "'" and (quote != '"' or escaped in '$`"\\\n')) else 1
        )
        if not quote and word.startswith(("$'", '$"'), i):
            quote, opened, inside, i = word[i : i + 2].replace('$"', '"'), i, len(chars), i + 2
        elif size == 1 and ((not quote and char in "'\"") or (quote and quote[-1] == char)):
            if quote:  # closed: its characters lie inside it
                sources[inside:] = [(a, b, (opened, i + 1)) for a, b, _ in sources[inside:]]
            quote, opened, inside, i = ("" if quote else char), i, len(chars), i + 1
        else:
            chars.append(word[i + size - 1])
            sources.append((i, i + size, (opened, len(word)) if quote else (i, i + size)))
            i += size
    return "".join(chars), sources


def changed(text: str, redacted: str) -> tuple[int, int]:
    """How many characters at the start and at the end of ``text`` its redaction kept: what
    lies between was replaced (never half a mark: a value may end as a mark does)."""
    start = 0
    most = min(len(text), len(redacted))
    while start < most and text[start] == redacted[start]:
        start += 1
    end = 0
    while end < most - start and text[-1 - end] == redacted[-1 - end]:
        end += 1
    for mark in _MARK.finditer(redacted):
        if mark.start() < start < mark.end():
            start = mark.start()
        if mark.start() < len(redacted) - end < mark.end():
            end = len(redacted) - mark.end()
    return start, end


class _Unread(Exception):
    """A text whose words this reader may not read as the shell does (private: never raised
    out of ``shell_pieces``)."""


def shell_pieces(text: str, *, depth: int = 0, data: bool = False) -> list[tuple[int, int]]:
    """The spans of ``text``, a shell's script, that are redacted each alone: each word the
    shell reads (with its quotes), a credential's flag with the word after it, in a word
    holding ``$(...)`` or backticks the parts around them and the words inside, and the text
    of a here-document (``_here_text``). ``data``: ``text`` is a here-document's, where a name
    is also given its value as ``NAME = value``.

    A text this reader may misread (an unclosed quote, ``$'...'`` which bash and dash read
    apart, ``case`` inside ``$(...)``) is cut into runs no shell ends a word in (``_RUN``)
    instead; never the whole text: a shell runs the lines before the one it cannot parse, and a
    value the regexes took past a quote they misread hid them."""
    try:
        segments = _segments(text, 0, nested=False, depth=depth)[0]
    except (_Unread, RecursionError):  # RecursionError: ``$(`` in ``$(`` ... past Python's stack
        segments = [(*match.span(), True) for match in _RUN.finditer(text)]
    return _paired(text, segments, data=data)


def _paired(text: str, segments: list[tuple[int, int, bool]], *, data: bool) -> list[tuple[int, int]]:
    """``segments`` as pieces, a word whose value is the next word (``_VALUE_NEXT``; in a
    here-document's text, a name and ``=``) joined with it when only blanks part them."""
    pieces: list[tuple[int, int]] = []
    programs = _programs(text, segments)
    at = 0
    while at < len(segments):
        start, end, whole = segments[at]
        last = _value_end(text, segments, at, data=data, program=programs[at]) if whole else None
        if last is None:
            pieces.append((start, end))
            at += 1
        else:
            pieces.append((start, segments[last][1]))
            at = last + 1
    return pieces


def _programs(text: str, segments: list[tuple[int, int, bool]]) -> list[str]:
    """For each segment, the program its command runs (``command_program``)."""
    programs: list[str] = []
    program = ""
    for at, (start, end, _) in enumerate(segments):
        if not at or any(char in _COMMAND_ENDS for char in text[segments[at - 1][1] : start]):
            program = ""
        if not program:
            program = command_program((text[start:end],))
        programs.append(program)
    return programs


def _value_end(
    text: str, segments: list[tuple[int, int, bool]], at: int, *, data: bool, program: str
) -> int | None:
    """The index of the value's segment when the one at ``at`` is given the value after it."""
    start, end = segments[at][:2]
    value = at + 1
    if data and value + 1 < len(segments) and _NAME_WORD.fullmatch(text, start, end):
        gives = segments[value]
        if gives[2] and text[gives[0] : gives[1]] in _GIVES_WORD and _blank(text, end, gives[0]):
            value, end = value + 1, gives[1]
    http = program in _HTTP_CLIENTS and text[start:end] in _HTTP_VALUE_NEXT
    if value == at + 1 and not (http or _VALUE_NEXT.fullmatch(text, start, end)):
        return None
    if value >= len(segments):
        return None
    after, _, whole = segments[value]
    gap = _blank(text, end, after) or (
        data and text[end - 1] == ":" and _YAML_GAP.fullmatch(text, end, after)
    )
    return value if whole and gap and text[after] != "-" else None


def _blank(text: str, start: int, end: int) -> bool:
    return not text[start:end].strip(" \t")


def _segments(text: str, i: int, *, nested: bool, depth: int) -> tuple[list[tuple[int, int, bool]], int]:
    """``(start, end, whole)`` of the words from ``i`` (``whole``: a word with no substitution
    in it), up to the end, or when ``nested`` up to the ``)`` that closes a ``$(``; and where
    that stopped. A here-document's text is read at the end of the line that gave it."""
    out: list[tuple[int, int, bool]] = []
    here: list[tuple[str, bool, bool]] = []  # the here-documents whose text the next line begins
    parens = 0
    while i < len(text):
        char = text[i]
        if char == "#":  # a comment, to the end of its line: not run, but it may hold a secret
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            out.append((i, end, False))
            i = end
            continue
        if char not in _ENDS:
            start = i
            i = _word(text, i, out, depth)
            if here and "\n" in text[start:i]:  # the text begins inside the word: not read
                raise _Unread
            if nested and text[start:i] == "case":  # its patterns end in a ")" of their own
                raise _Unread
            continue
        if char == "<" or (char == "\n" and here):
            i = _here(text, i, out, here, depth)
            continue
        if char == "(":
            parens += 1
        elif char == ")":
            if nested and parens == 0:
                if here:  # its text would be read after the ")"
                    raise _Unread
                return out, i + 1
            parens -= 1
        i += 1
    if nested:
        raise _Unread
    return out, i


def _here(
    text: str, i: int, out: list[tuple[int, int, bool]], here: list[tuple[str, bool, bool]], depth: int
) -> int:
    """Reads a here-document's ``<<`` and word at ``i``, or at a line's end the texts of those
    its line gave; past a ``<`` or a here-string's ``<<<`` otherwise."""
    if text[i] == "\n":
        return _here_text(text, i + 1, out, here, depth)
    if text.startswith("<<<", i):  # a here-string: its word follows, on its line
        return i + 3
    if text.startswith("<<", i):
        return _here_word(text, i, out, here, depth)
    return i + 1


def _here_word(
    text: str, i: int, out: list[tuple[int, int, bool]], here: list[tuple[str, bool, bool]], depth: int
) -> int:
    """Reads the ``<<`` (or ``<<-``) at ``i`` and the word after it, which ends the here-document
    (quoted: its text is the shell's to read as it is); where that word ends."""
    i += 2
    tabs = text.startswith("-", i)
    i += tabs
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text) or text[i] in _ENDS:
        raise _Unread
    start, words = i, list[tuple[int, int, bool]]()
    i = _word(text, i, words, depth)
    if len(words) != 1 or not words[0][2]:  # a substitution in it: the shells differ
        raise _Unread
    written = text[start:i]
    delimiter = re.sub(r"\\(.)|['\"]", lambda match: match.group(1) or "", written)
    out.extend(words)
    here.append((delimiter, tabs, delimiter != written))
    return i


def _here_text(
    text: str, i: int, out: list[tuple[int, int, bool]], here: list[tuple[str, bool, bool]], depth: int
) -> int:
    """Reads the texts of ``here``'s documents, the first from ``i``, each up to the line that
    is its word (``<<-``: after its tabs), or to the end of ``text``; where they end."""
    for delimiter, tabs, quoted in here:
        start = end = i
        while i < len(text):
            eol = text.find("\n", i)
            eol = len(text) if eol < 0 else eol
            line = text[i:eol]
            end, i = i, eol + 1
            if (line.lstrip("\t") if tabs else line) == delimiter:
                break
            if not quoted and line.endswith("\\"):  # joined to the next line: the shells differ
                raise _Unread
        else:
            end = len(text)
        if depth >= _DEEPEST:
            raise _Unread
        out.extend((a, b, False) for a, b in _document(text, start, end, depth + 1))
    here.clear()
    return min(i, len(text))


def _document(text: str, start: int, end: int, depth: int) -> list[tuple[int, int]]:
    """The pieces of a here-document's text, ``text[start:end]``: what a program reads (a
    config file, a script, a key), whose words hold its values; and each private key whole.

    Read word by word as a script (``shell_pieces``): a value never takes in what follows its
    word, whatever the program makes of it, since it may be a shell (``sh <<EOF``)."""
    pieces: list[tuple[int, int]] = []
    at = start
    for key in _KEY_BLOCK.finditer(text, start, end):
        pieces += [(at + a, at + b) for a, b in shell_pieces(text[at : key.start()], depth=depth, data=True)]
        pieces.append(key.span())
        at = key.end()
    pieces += [(at + a, at + b) for a, b in shell_pieces(text[at:end], depth=depth, data=True)]
    return pieces


def _word(text: str, i: int, out: list[tuple[int, int, bool]], depth: int) -> int:
    """Reads the word at ``i`` into ``out``; where it ends."""
    start = part = i
    whole, quoted = True, False  # quoted: inside "..."
    while i < len(text):
        char = text[i]
        if not quoted and char in _ENDS:
            break
        if char == "\\":
            i += 2
        elif char == "'" and not quoted:
            end = text.find("'", i + 1)
            if end < 0 or text.startswith("$'", i - 1):
                raise _Unread
            i = end + 1
        elif char == '"':
            quoted, i = not quoted, i + 1
        elif text.startswith("$(", i) or char == "`":
            if part < i:
                out.append((part, i, False))
            whole = False
            i = _backticks(text, i, out, quoted=quoted) if char == "`" else _nested(text, i + 2, out, depth)
            part = i
        else:
            i += 1
    if quoted:
        raise _Unread
    i = min(i, len(text))
    if part < i:
        out.append((start if whole else part, i, whole))
    return i


def _nested(text: str, i: int, out: list[tuple[int, int, bool]], depth: int) -> int:
    """Reads the words of the ``$(...)`` whose script starts at ``i``; where it ends."""
    inner, end = _segments(text, i, nested=True, depth=depth)
    out.extend(inner)
    return end


def _backticks(text: str, i: int, out: list[tuple[int, int, bool]], *, quoted: bool) -> int:
    """Reads the command in the backticks at ``i`` as runs (``_RUN``); where it ends. Inside
    double quotes, the shells read quotes in it apart: such a text is not read."""
    end = i + 1
    while end < len(text) and text[end] != "`":
        end += 2 if text[end] == "\\" else 1
    if end >= len(text) or (quoted and any(q in text[i + 1 : end] for q in "'\"")):
        raise _Unread
    out.extend((*match.span(), False) for match in _RUN.finditer(text, i + 1, end))
    return end + 1
