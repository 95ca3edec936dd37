"""Redaction: secrets are removed before anything is written (store, logs, spans).

A ``Redactor`` is a pipeline of plain callables ``(text) -> text`` applied to every string
of an event (keys and values, at any depth), as structlog processors are applied to an event
dict; add your own to the pipeline. Two more rules need no pipeline entry:

- values whose *key* names a credential (``password``, ``api_key``, ``accessToken``,
  ``PGPASSWORD``, ``X-Api-Key``, ``api_key_list``, ...) are replaced whole, whatever they are
  (a string, a number, a list, an object); not the paths of a map keyed by paths (``files``:
  path -> content), whose contents are redacted as text;
- ``SecretValues``: the caller registers the exact values it hands to sandboxes (environment
  variables, tokens) with ``redactor.add_secret(value)``; they are replaced wherever they
  appear, even inside longer text.

``redact_tokens`` catches what looks like a credential even when nobody registered it:
``sk-...`` API keys, GitHub, Stripe, GitLab, Hugging Face and npm tokens, AWS access key ids,
``Bearer ...`` (``token ...``), JWTs, private key blocks (OpenPGP's too), the cookies of a
``Cookie:`` header and of curl's ``-b``, a Digest's ``response``, a signed URL's signature,
openssl's ``-passin pass:x``, ``aws configure set``'s secrets, XML's ``<password>x</password>``, a
YAML value on the next line, values assigned to a credential's name (``PGPASSWORD=x``,
``SECRET_KEY=x``, ``OPENAI_KEY=x``, ``"password": "x"``, ``secret='a b'``, ``password => x``),
given to a credential's flag (``--password x``, ``--api-key x``, ``curl -u user:x``), and the password of
a URL (``https://user:x@host``). A value ends where a shell would end it (``;``, ``|``, ``$(``
..., a quote or a newline; a character a backslash escapes does not end it): what follows is
what a command did, never hidden. A private key block ends at its END line, or at the first
line a key's body does not hold. ``flag_value`` finds a flag's value given as an argv word of
its own (``["--password", "x"]``).

A command's text (``ShellText``: ``sh -c``'s script, a command tool's ``command``) is read as
the shell reads it, from its start through its quotes (``Redactor.shell``): the patterns are
applied to each of its words alone, since a regex cannot tell a quote that opens a value from
one that closes an earlier string (``X="PASSWORD="ab rm -rf src""`` runs ``rm``); and to each
as the shell joins its quoted parts (``PASSWORD=""x``, ``PASSWORD="a"'b'``). A
here-document's text is read so too, from the line after its ``<<`` to its word: its words, a
name with ``=`` and its value (``PASSWORD = "x"``), and each private key in it whole.
A program's source in another language (``CodeText``: run_code's Python, node, ...) is
redacted statement by statement (``Redactor.code``): a value ends at its line's end, at a ``;``
and at the quote that closes its string; a string given to a credential's name is hidden whole,
as the language reads it (triple quotes, ``\\'``), and an expression given to one is kept.

A text someone cut before it reached the redactor (a sandbox caps the words of an exec it
reports) may end with half a credential, which no pattern and no registered value matches:
``Redactor.head`` replaces what at its end may begin one (``TAIL_PATTERNS``, a registered
secret's prefix) by ``[REDACTED:cut]``. A text cut in the middle says so with ``stockade._cuts.cut_marker``
(a long tool output, a quoted argument): the redactor treats what comes before each such mark
so, and replaces what comes right after it that may end a secret (a registered secret's
suffix, the rest of a word) by ``[REDACTED:cut]`` too. A text nobody cut (a command) has its
mark-shaped lines made plain first (``stockade._cuts.plain``), so that none hides a word.

``redact_personal_data`` (``Redactor(personal_data=True)``; what the GDPR compliance profile
turns on) replaces what looks like personal data: e-mail addresses, phone numbers, IP
addresses, payment card numbers (Luhn-checked), IBANs and US social security numbers. Patterns
find shapes, not meaning: a name, an address in words or an identifier of your own domain
passes; add a processor for those.

This module holds the pipeline (``Redactor``, ``SecretValues``, the rule of a credential's
key); the shapes of credentials are in ``_secret_patterns``, personal data's in
``_personal_data``, what a cut may have kept of one in ``_cut_edges``, and the readers of a
command and of a program's source in ``_shell_reader`` and ``_code_reader``.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from stockade import exceptions as exc
from stockade._cuts import CUT_MARK
from stockade.audit._code_reader import TRIPLES, CodePiece, CodeText, code_pieces
from stockade.audit._cut_edges import (
    CUT_REDACTED,
    HEAD_ROUNDS,
    LEAD,
    PERSONAL_LEAD,
    PERSONAL_TAILS,
    TAILS,
    tail_start,
)
from stockade.audit._personal_data import PERSONAL_DATA_PATTERNS, PERSONAL_TAIL_PATTERNS, redact_personal_data
from stockade.audit._secret_patterns import SECRET_KEYS, TAIL_PATTERNS, TOKEN_PATTERNS, redact_tokens
from stockade.audit._shell_reader import QUOTING, ShellText, changed, flag_value, shell_pieces, unquoted
from stockade.audit.events import JSONValue

__all__ = [
    "CUT_REDACTED",
    "MIN_SECRET_LENGTH",
    "PERSONAL_DATA_PATTERNS",
    "PERSONAL_TAIL_PATTERNS",
    "REDACTED",
    "TAIL_PATTERNS",
    "TOKEN_PATTERNS",
    "CodeText",
    "Redactor",
    "SecretValues",
    "ShellText",
    "StringProcessor",
    "flag_value",
    "redact_personal_data",
    "redact_tokens",
]

StringProcessor = Callable[[str], str]
REDACTED = "[REDACTED]"
MIN_SECRET_LENGTH = 4
# Keys, names and ids repeat in nearly every event: their redaction is remembered.
CACHED_LENGTH = 64
CACHE_SIZE = 4096

# A key naming a credential, once spelled snake_case (``accessToken`` -> ``access_token``,
# ``X-Api-Key`` -> ``x_api_key``): it ends with one of these words (``PGPASSWORD`` too), or
# names a list of them. Not ``tokens`` (``max_tokens`` is a count), nor a bare ``key``.
_SENSITIVE_KEY = re.compile(
    r"(?:password|passwd|passphrase|secret|token|api_?key|authorization|credential|cookie"
    rf"|(?:^|_)(?:access|{SECRET_KEYS})_?key)(?:_list)?$"
    r"|(?:password|passwd|passphrase|secret|api_?key|credential|cookie)s(?:_list)?$"
)

# A key whose map is keyed by paths (``run_code``'s ``files``: path -> content): its keys name
# files, not credentials; a file's content is redacted as any text (``x_token``'s content was
# replaced whole, and the script it held was recorded nowhere).
_PATH_MAPS = frozenset({"files"})


@functools.lru_cache(maxsize=CACHE_SIZE)
def _sensitive_key(name: str) -> bool:
    snake = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
    return _SENSITIVE_KEY.search(re.sub(r"[\s.\-]+", "_", snake)) is not None


def _held(value: object) -> bool:
    """Whether a value under a credential's key holds anything (``None``, a flag, "" do not)."""
    return value is not None and not isinstance(value, bool) and value != ""


_CODE_REDACTED = "[REDACTED:quoted_assignment]"  # a string literal given to a credential's name
# A piece of a text redacted alone: a shell's span (``shell_pieces``) or a code piece.
_Piece = tuple[int, int] | CodePiece


def _literal_redacted(literal: str) -> str:
    """A string literal given to a credential's name (with its quotes), its text replaced;
    one too short to be a credential, or a mark already, stays."""
    quote = literal[:3] if literal.startswith(TRIPLES) else literal[0]
    inside = literal[len(quote) : len(literal) - len(quote)]
    if len(inside) < MIN_SECRET_LENGTH or inside.startswith("[REDACTED"):
        return literal
    return f"{quote}{_CODE_REDACTED}{quote}"


class SecretValues:
    """Registered secret values, replaced wherever they occur. Thread-safe."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        self._values: set[str] = set()
        self._pattern: re.Pattern[str] | None = None
        self._lock = threading.Lock()
        for value in values:
            self.add(value)

    def add(self, value: str) -> None:
        if len(value) < MIN_SECRET_LENGTH:
            raise exc.ConfigurationError(
                f"a secret shorter than {MIN_SECRET_LENGTH} characters would redact ordinary text"
            )
        with self._lock:
            self._values.add(value)
            # Longest first, so that a secret containing another is replaced whole.
            ordered = sorted(self._values, key=len, reverse=True)
            self._pattern = re.compile("|".join(re.escape(v) for v in ordered))

    def __len__(self) -> int:
        return len(self._values)

    def prefix_at_end(self, text: str) -> int:
        """How many characters at the end of ``text`` are the beginning of a registered secret
        (the longest such): what a cut there may have kept of one."""
        with self._lock:
            values = tuple(self._values)
        longest = 0
        for value in values:
            for size in range(min(len(value) - 1, len(text)), longest, -1):
                if text.endswith(value[:size]):
                    longest = size
                    break
        return longest

    def suffix_at_start(self, text: str) -> int:
        """How many characters at the start of ``text`` are the end of a registered secret (the
        longest such): what a cut there may have kept of one."""
        with self._lock:
            values = tuple(self._values)
        longest = 0
        for value in values:
            for size in range(min(len(value) - 1, len(text)), longest, -1):
                if text.startswith(value[-size:]):
                    longest = size
                    break
        return longest

    def __call__(self, text: str) -> str:
        pattern = self._pattern
        if pattern is None:
            return text
        return pattern.sub("[REDACTED:secret]", text)


class Redactor:
    """The redaction pipeline shared by the audit log, the JSON logs and the spans.

    ``Redactor()`` runs registered secrets then ``redact_tokens`` (then ``redact_personal_data``
    with ``personal_data=True``); pass ``processors`` to choose the pipeline (``redactor.secrets``
    is always available to put in it). Processors must be pure: results for short strings (keys,
    names, ids) are cached, and the cache is dropped whenever a secret is registered.
    """

    def __init__(
        self, processors: Sequence[StringProcessor] | None = None, *, personal_data: bool = False
    ) -> None:
        self.secrets = SecretValues()
        default: tuple[StringProcessor, ...] = (self.secrets, redact_tokens)
        if personal_data:
            default += (redact_personal_data,)
        self.processors: tuple[StringProcessor, ...] = default if processors is None else tuple(processors)
        self._cache: dict[str, str] = {}
        self._cached_secrets = 0
        self._long: dict[str, str] | None = None  # see ``remembering``
        self._long_chars = 0
        self._long_budget = 0

    @property
    def redacts_personal_data(self) -> bool:
        return redact_personal_data in self.processors

    def add_secret(self, value: str) -> None:
        """Never write ``value``, wherever it appears (e.g. a token passed to a sandbox's env)."""
        self.secrets.add(value)

    def add_secrets(self, values: Iterable[str]) -> None:
        for value in values:
            self.secrets.add(value)

    def remembering(self, *, max_chars: int = 4 * 1024 * 1024) -> Redactor:
        """The same pipeline and secrets, also remembering the results for long strings, up to
        ``max_chars`` characters of them (then it starts afresh).

        For a writer that sees the same long text again and again: a run store writes each
        observation in the tool-call message, the step record and the ledger, and an agent
        reads the same file many times. Registering a secret on either redactor forgets
        everything remembered.
        """
        twin = Redactor(self.processors)
        twin.secrets = self.secrets
        twin._long = {}
        twin._long_budget = max_chars
        return twin

    def text(self, text: str) -> str:
        if isinstance(text, ShellText):
            return self.shell(text)
        if isinstance(text, CodeText):
            return self.code(text)
        if "characters cut" in text and CUT_MARK.search(text):
            return self._across_cuts(text)
        return self._text(text)

    def shell(self, text: str, *, was_cut: bool = False) -> ShellText:
        """``text``, a shell's script, redacted word by word (``shell_pieces``): a value ends
        where the shell ends its word, whatever quote a regex would have read it to.
        ``was_cut``: ``text`` ends where someone cut it (``head``)."""
        return ShellText(self._by_pieces(text, shell_pieces, was_cut=was_cut))

    def code(self, text: str, *, was_cut: bool = False) -> CodeText:
        """``text``, a program's source (``CodeText``), redacted statement by statement
        (``code_pieces``): a value ends at the end of its line, at a ``;`` and at the quote
        that closes its string, whatever quote a regex would have read it to. A string given
        to a credential's name is hidden whole (Python's triple quotes, ``= ("x")``, ``'a\\'b'``);
        an expression given to one (``password = os.system``) is code, and is kept."""
        return CodeText(self._by_pieces(text, code_pieces, was_cut=was_cut))

    def _by_pieces(self, text: str, pieces: Callable[[str], Sequence[_Piece]], *, was_cut: bool) -> str:
        """``text`` with each of its ``pieces`` redacted alone; a registered secret is replaced
        wherever it is first: it is the caller's own value, and hides nothing but itself."""
        if self.secrets in self.processors:
            text = self.secrets(text)
        out: list[str] = []
        done = 0
        for start, end, *literal in pieces(text):
            piece = text[start:end]
            if literal and literal[0] and redact_tokens in self.processors:
                redacted = _literal_redacted(piece)
            elif was_cut and end == len(text):
                redacted = self.head(piece)
            else:
                redacted = self._word(piece)
            out += [text[done:start], redacted]
            done = end
        out.append(text[done:])
        return "".join(out)

    def _word(self, piece: str) -> str:
        """``piece``, a shell's word (or a flag and its value), redacted; and as the shell reads
        it too, its quotes removed (``PASSWORD=""x``, ``PASSWORD="a"'b'``, ``$'x'``: the parts
        of one value), what that hides put in place of the characters it came from."""
        out = self._text(piece)
        if not QUOTING.search(piece):
            return out
        joined, sources = unquoted(piece)
        hidden = self._text(joined)
        if hidden == joined:
            return out
        start, end = changed(joined, hidden)
        if start + end >= len(joined):  # nothing of the word replaced: something added
            return self._text(hidden)
        first, last = sources[start], sources[len(joined) - end - 1]
        if first[2] != last[2]:  # not inside one quote: the quotes it spans go too
            first, last = (*first[2], first[2]), (*last[2], last[2])
        # then the patterns once more: what they found in the word as written stays hidden too
        return self._text(piece[: first[0]] + hidden[start : len(hidden) - end] + piece[last[1] :])

    def _across_cuts(self, text: str) -> str:
        """``text`` whose middle was cut (``cut_marker``), redacted piece by piece: what ends at
        a mark as ``head`` does, what starts after one without what may end a secret there."""
        out: list[str] = []
        start = 0
        for mark in CUT_MARK.finditer(text):
            out.append(self._piece(text[start : mark.start()], after_cut=start > 0, before_cut=True))
            out.append(self._text(mark.group()))  # code's output may spell a mark of its own
            start = mark.end()
        out.append(self._piece(text[start:], after_cut=True, before_cut=False))
        return "".join(out)

    def _piece(self, text: str, *, after_cut: bool, before_cut: bool) -> str:
        lead = self._lead(text) if after_cut else 0
        rest = text[lead:]
        return (CUT_REDACTED if lead else "") + (self.head(rest) if before_cut else self._text(rest))

    def _lead(self, text: str) -> int:
        """How many characters at the start of ``text`` (which a cut began) may be the end of a
        registered secret or of a credential."""
        end = self.secrets.suffix_at_start(text) if self.secrets in self.processors else 0
        for processor, lead in ((redact_tokens, LEAD), (redact_personal_data, PERSONAL_LEAD)):
            match = lead.match(text) if processor in self.processors else None
            end = max(end, match.end() if match is not None else 0)
        return end

    def _text(self, text: str) -> str:
        if self._cached_secrets != len(self.secrets):
            self._cache.clear()
            if self._long is not None:
                self._long.clear()
                self._long_chars = 0
            self._cached_secrets = len(self.secrets)
        short = len(text) <= CACHED_LENGTH
        if short:
            cached = self._cache.get(text)
            if cached is not None:
                return cached
        elif self._long is not None:
            cached = self._long.get(text)
            if cached is not None:
                return cached
        out = text
        for processor in self.processors:
            out = processor(out)
        if short:
            if len(self._cache) >= CACHE_SIZE:
                self._cache.clear()
            self._cache[text] = out
        elif self._long is not None and len(text) <= self._long_budget:
            if self._long_chars + len(text) > self._long_budget:
                self._long.clear()
                self._long_chars = 0
            self._long[text] = out
            self._long_chars += len(text)
        return out

    def cut(self, text: str, cap: int, *, was_cut: bool = False) -> str:
        """``text`` redacted, then cut to ``cap`` characters (saying how many more there were).
        In that order: a cut first can keep a credential's prefix that no pattern knows.
        ``was_cut``: someone already cut ``text`` at its end before it came here (``head``)."""
        if isinstance(text, ShellText):
            out: str = self.shell(text, was_cut=was_cut)
        elif isinstance(text, CodeText):
            out = self.code(text, was_cut=was_cut)
        else:
            out = self.head(text) if was_cut else self.text(text)
        if len(out) <= cap:
            return out
        kept = out[:cap] + f"…[{len(out) - cap} more chars]"
        return type(text)(kept) if isinstance(text, ShellText | CodeText) else kept

    def head(self, text: str) -> str:
        """``text`` redacted, where ``text`` is the head of a longer one that was cut before
        it came here (a sandbox's capped word, a proxy's shortened path): what at its end may
        be the beginning of a registered secret or of a credential-shaped match that the cut
        ended is replaced by ``[REDACTED:cut]`` too, since no pattern matches half a token."""
        held = ""
        for _ in range(HEAD_ROUNDS):
            start = self._tail(text)
            if start == len(text):
                return self._text(text) + held
            # held back from there; and what is left ends at a cut too (a secret holding a
            # credential's shape may have begun before it): looked at again
            text, held = text[:start], CUT_REDACTED
        return CUT_REDACTED  # still more: nothing is kept rather than too much

    def _tail(self, text: str) -> int:
        """Where what may be the beginning of a secret or a match at the end of ``text`` starts."""
        start = len(text)
        if self.secrets in self.processors:
            start -= self.secrets.prefix_at_end(text)
        if redact_tokens in self.processors:
            start = min(start, tail_start(text, TAILS))
        if redact_personal_data in self.processors:
            start = min(start, tail_start(text, PERSONAL_TAILS))
        return start

    def value(self, value: object) -> JSONValue:
        """``value`` as JSON, with every string redacted. Unknown objects become their ``str``."""
        if isinstance(value, str):
            return self.text(value)
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int):
            # JSON writes no integer past 4,300 digits (CPython's limit), and readers of the
            # trail take 64 bits: a larger one is said, not written (it failed every later flush)
            return value if -(2**63) <= value < 2**63 else f"<an integer of {value.bit_length()} bits>"
        if isinstance(value, float):
            return value if math.isfinite(value) else str(value)
        if isinstance(value, Mapping):
            return self.attributes(value)
        if isinstance(value, list | tuple | set | frozenset):
            items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
            return [self.value(item) for item in items]
        if isinstance(value, bytes):
            return f"<{len(value)} bytes>"
        return self.text(str(value))

    def attributes(self, attributes: Mapping[Any, object]) -> dict[str, JSONValue]:
        out: dict[str, JSONValue] = {}
        for key, item in attributes.items():
            name = self.text(str(key))
            if _held(item) and _sensitive_key(name):
                out[name] = REDACTED  # whatever it is: a string, a number, a list, an object
            elif name in _PATH_MAPS and isinstance(item, Mapping):
                out[name] = {self.text(str(path)): self.value(content) for path, content in item.items()}
            else:
                out[name] = self.value(item)
        return out

    def structlog_processor(self, logger: object, method: str, event_dict: Any) -> Any:
        """The same redaction as a structlog processor (put it before the renderer)."""
        return self.attributes(event_dict)
