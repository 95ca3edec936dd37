"""Command rules over one program's argv: whether ``rm -fR build`` is ``rm -r``.

One implementation for both sides: the host's policy judges the commands a tool call names
with it, and the supervisor judges every exec inside the sandbox with it, when it happens,
with the argv the kernel was given. Standard library only (it runs inside the sandbox).

A pattern is shell words: the program (a glob over its name), then flags the command must
carry and words that must be among its other arguments: ``"rm -r"``, ``"git push"``,
``"pip install"``. A flag matches its spellings for that program: ``rm -fR``, ``rm -r -f``,
``rm --recursive`` all carry ``-r``.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

# The same action under other spellings, per program ("*": any program): a pattern's flag
# matches any of them, alone, in a cluster of short flags (``-fR``), or as ``--long=value``.
FLAG_SPELLINGS = {
    "*": {"-r": ("-r", "-R", "--recursive"), "-f": ("-f", "--force")},
    "cp": {"-r": ("-r", "-R", "--recursive", "-a", "--archive")},
    "chmod": {"-R": ("-R", "--recursive")},
    "chown": {"-R": ("-R", "--recursive")},
    "chgrp": {"-R": ("-R", "--recursive")},
    "git": {"-f": ("-f", "--force", "--force-with-lease")},
    "pip": {"-e": ("-e", "--editable"), "-r": ("-r", "--requirement"), "-U": ("-U", "--upgrade")},
}  # type: Dict[str, Dict[str, Tuple[str, ...]]]
VERDICTS = ("allow", "approve", "deny")


GLOB_CHARS = frozenset("*?[")


def program(word: str) -> str:
    return word.rsplit("/", 1)[-1]


def _glob(name: str, pattern: str) -> bool:
    """fnmatch, imported only for a pattern that is one (fnmatch imports re: milliseconds)."""
    if not GLOB_CHARS & set(pattern):
        return name == pattern
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern)


def subject(argv: "Sequence[str]") -> "List[str]":
    """What a command runs: ``python3 -m pip install x`` runs ``pip install x``."""
    words = list(argv)
    if len(words) > 2 and program(words[0]).startswith("python") and words[1] == "-m":
        return words[2:]
    return words


def _spellings(name: str, flag: str) -> "Tuple[str, ...]":
    table = FLAG_SPELLINGS.get(name, {})
    return table.get(flag) or FLAG_SPELLINGS["*"].get(flag) or (flag,)


def _carries(name: str, flag: str, args: "Sequence[str]") -> bool:
    spellings = _spellings(name, flag)
    letters = [s[1] for s in spellings if len(s) == 2 and s[0] == "-" and s[1] != "-"]
    longs = [s for s in spellings if s.startswith("--")]
    for arg in args:
        if arg == "--":
            return False  # what follows are operands, even when they look like flags
        if arg in spellings or any(arg.startswith(long + "=") for long in longs):
            return True
        if arg.startswith("-") and not arg.startswith("--") and len(arg) > 2:
            cluster = arg[1:]
            # -fR: every letter a flag; stop at the first that takes a value (-ofile)
            if cluster.isalpha() and any(letter in cluster for letter in letters):
                return True
    return False


def matches(words: "Sequence[str]", command: "Sequence[str]") -> bool:
    """Whether the simple command ``command`` is what the pattern ``words`` names."""
    if not command or not words or not _glob(program(command[0]), words[0]):
        return False
    name = program(command[0])
    args = list(command[1:])
    try:
        operands = args[args.index("--") + 1 :]
        options = args[: args.index("--")]
    except ValueError:
        operands, options = [], args
    positional = [a for a in options if not a.startswith("-")] + operands
    for word in words[1:]:
        if word.startswith("-"):
            if not _carries(name, word, args):
                return False
        elif not any(_glob(a, word) for a in positional):
            return False
    return True


def judge(rules: "Dict[str, List[List[str]]]", argv: "Sequence[str]") -> "Tuple[str, Optional[str]]":
    """The verdict on one exec: ``("deny", rule)``, ``("approve", rule)`` or ``("allow", None)``.

    ``rules`` maps ``deny``/``approve``/``allow`` to patterns as word lists; a non-empty
    ``allow`` lets only what it names run. Deny beats the allowlist beats approve.
    """
    command = subject(argv)
    for words in rules.get("deny", ()):
        if matches(words, command):
            return "deny", "commands.deny: " + " ".join(words)
    allow = rules.get("allow", ())
    if allow and not any(matches(words, command) for words in allow):
        return "deny", "commands.allow"
    for words in rules.get("approve", ()):
        if matches(words, command):
            return "approve", "commands.approve: " + " ".join(words)
    return "allow", None


def programs(patterns: "Sequence[Sequence[str]]") -> "FrozenSet[str]":
    """The program globs of single-word patterns: what is denied whatever its arguments."""
    return frozenset(words[0] for words in patterns if len(words) == 1)
