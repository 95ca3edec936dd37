"""What a sandbox event keeps of each text and list it copies from the caller (a command's
argv and env names, code, a path, a sandbox's hosts and names, an exec's argv): redacted, whole
up to ``TEXT_CAP`` characters, past it cut with the size and digest of the whole. How a text
is read for redaction goes with it: a shell's script word by word, other code statement by
statement (``program_text``, ``script_at``), and a word the sandbox itself cut keeps its mark
(``exec_word``). Apart from the wrappers that record the events (``sandbox.py``): the agent's
events and the acceptance check's read programs and execs the same way.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from functools import partial

from stockade._cuts import plain
from stockade.audit.redact import CodeText, Redactor, ShellText, flag_value

__all__ = [
    "KEPT_WORDS",
    "TEXT_CAP",
    "capping",
    "cut_word",
    "digest",
    "exec_word",
    "kept_text",
    "program_text",
    "script_at",
    "text_attributes",
    "words_attributes",
    "words_json",
]

# What one event keeps of each text or list it copies from the caller (a command's argv, its
# env names, run_code's code, a program on stdin, a sandbox's hosts and names): at most this
# many characters, all its words together. Past it the event keeps the first and last
# KEPT_WORDS words, cut to a share of it, with the count, size and SHA-256 of the whole
# (``argv_count``, ``argv_bytes``, ``argv_digest``, ``argv_cut``), which prove what ran. Each
# word was once cut to it but all kept: 60,000 arguments of 14 characters made an event of 1 MB,
# for ever in the service's database and not counted in the tenant's storage_mb.
TEXT_CAP = 16 * 1024
KEPT_WORDS = 16


def kept_text(redactor: Redactor, text: str) -> str:
    """``text`` redacted and cut to ``TEXT_CAP`` characters; a long one cut first, then
    redacted as the head of a longer text (``Redactor.head``): redacting a path of a million
    characters whole costs half a second. Every text a sandbox event copies says what was done,
    and nobody cut it: a cut mark in it is made plain (``plain``)."""
    text = plain(text)
    if len(text) <= TEXT_CAP:
        return redactor.cut(text, TEXT_CAP)
    return redactor.cut(text[:TEXT_CAP], TEXT_CAP, was_cut=True) + f"…[{len(text) - TEXT_CAP} more chars]"


def text_attributes(name: str, text: str, redactor: Redactor) -> dict[str, object]:
    """The attributes recording one text copied from the caller under ``name`` (a path, a
    host folder): whole up to ``TEXT_CAP`` characters, past it cut, with the size and digest
    of the whole (``<name>_bytes``, ``<name>_digest``, ``<name>_cut``). A path was once kept
    whole: a files.remove of a 1,000,000-character path made an event of 3 MB."""
    if len(text) <= TEXT_CAP and len(whole := redactor.text(plain(text))) <= TEXT_CAP:
        return {name: whole}
    kept = kept_text(redactor, text)
    raw = text.encode("utf-8", "surrogatepass")
    return {name: kept, f"{name}_bytes": len(raw), f"{name}_digest": digest(raw), f"{name}_cut": True}


def capping(redactor: Redactor) -> Callable[[str], str]:
    """Redact, then cut: a cut first can keep a credential's prefix that no pattern knows."""
    return lambda text: redactor.cut(type(text)(plain(text)), TEXT_CAP)


def program_text(runner: str, program: str) -> str:
    """A program ``runner`` runs (``bash``, ``python3``, a language of ``run_code``), as the
    redactor reads it: a shell's script word by word (``ShellText``), other code statement by
    statement (``CodeText``); as plain text, a value ran across quotes and ``;`` and hid the
    commands after it."""
    return ShellText(program) if runner.rsplit("/", 1)[-1] in _SHELLS else CodeText(program)


# How the sandbox ends a word of an exec it cut (``supervisor.execrecords.kept_argv``): its head, then this.
_WORD_CUT = re.compile(r"\[\.\.\. [0-9]+ more characters; the word is sha256 [0-9a-f]{64}\]\Z")


def exec_word(redactor: Redactor, word: str, script: bool = False) -> str:
    """A word of an exec the sandbox reported, redacted: a word it cut (to ``MAX_EXEC_WORD``
    characters, before any redactor saw it) may end with the head of a credential, which
    ``Redactor.head`` holds back; the sandbox's mark stays. ``script``: the word is a shell's
    script (``script_at``), redacted word by word (``Redactor.shell``)."""
    word = plain(word)
    mark = _WORD_CUT.search(word)
    if mark is None:
        return redactor.cut(ShellText(word) if script else word, TEXT_CAP)
    head = word[: mark.start()]
    kept = redactor.cut(ShellText(head) if script else head, TEXT_CAP, was_cut=True) + mark.group()
    return ShellText(kept) if script else kept


def _word(redactor: Redactor, word: str, script: bool = False) -> str:
    """A word of a list the caller gave, redacted (see ``exec_word``)."""
    word = plain(word)
    return redactor.text(ShellText(word) if script else word)


# The shells whose ``-c`` takes a script (``sh -c``, ``bash -lc``): what commands.run and the
# command tools run a command text with.
_SHELLS = frozenset({"sh", "bash", "dash", "ash", "ksh", "mksh", "zsh"})


def script_at(argv: Sequence[str]) -> int | None:
    """Where in ``argv`` the script of a shell's ``-c`` is (``["/bin/sh", "-c", SCRIPT]``, ``-lc``,
    ``-e -c``); ``None`` when it runs none."""
    if not argv or argv[0].rsplit("/", 1)[-1] not in _SHELLS:
        return None
    for at, word in enumerate(argv[1:], 1):
        if not word.startswith("-") or word == "--":
            return None
        if "c" in word[1:] and not word.startswith("--"):
            return at + 1 if at + 1 < len(argv) else None
    return None


def cut_word(word: str, share: int) -> str:
    if len(word) <= share:
        return word
    kept = word[:share] + f"…[{len(word) - share} more chars]"
    return ShellText(kept) if isinstance(word, ShellText) else kept


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def words_json(words: Sequence[str]) -> bytes:
    """A list of words as the size and digest of a cut one are of: compact JSON, UTF-8."""
    return json.dumps(list(words), separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")


def words_attributes(
    name: str,
    words: Sequence[str],
    redactor: Redactor,
    redact: Callable[[str, bool], str] | None = None,
    *,
    argv: bool = False,
) -> dict[str, object]:
    """The attributes recording a list of words under ``name``: whole up to ``TEXT_CAP``
    characters (once redacted), past it its head and tail words, the longest cut first and
    alike, and the count, size and digest of the whole. Only the words kept are redacted (a
    word redacted whole, then cut: a cut first can keep a credential's prefix); ``redact``
    instead of ``redactor.text`` for words someone cut before (an exec's, ``exec_word``).
    ``argv``: the words are a command's, where a credential's flag may be one word and its
    value the next (``flag_value``), or a shell's script (``script_at``)."""
    redact = redact or partial(_word, redactor)
    script = script_at(words) if argv else None

    def one(at: int) -> str:
        hidden = flag_value(words, at) if argv and at else None
        return redact(words[at] if hidden is None else hidden, at == script)

    if sum(map(len, words)) <= TEXT_CAP:
        whole = [one(at) for at in range(len(words))]
        if sum(map(len, whole)) <= TEXT_CAP:
            return {name: whole}
    head = min(len(words), KEPT_WORDS)
    tail = min(len(words) - head, KEPT_WORDS)
    chosen = [one(at) for at in (*range(head), *range(len(words) - tail, len(words)))]
    share, room = TEXT_CAP, TEXT_CAP
    for at, n in enumerate(sorted(map(len, chosen))):  # the shortest whole, the rest cut alike
        if n > room // (len(chosen) - at):
            share = room // (len(chosen) - at)
            break
        room -= n
    kept = [cut_word(word, share) for word in chosen]
    if omitted := len(words) - head - tail:
        kept.insert(head, f"…[{omitted} more words]")
    raw = words_json(words)
    return {
        name: kept,
        f"{name}_count": len(words),
        f"{name}_bytes": len(raw),
        f"{name}_digest": digest(raw),
        f"{name}_cut": True,
    }
