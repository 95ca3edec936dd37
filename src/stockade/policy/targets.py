"""The files a command line would write (and, where cheap, read), for the path rules.

Read from the parsed argv, never from the text: shell redirections (``> f``, ``>> f``,
``&> f``, ``< f``), and the operands of the programs that write files by name (``tee``,
``cp``/``mv``/``ln`` destinations, ``rm``, ``touch``, ``mkdir``, ``truncate``, ``sed -i``,
``dd of=``) or read them (``cat``, ``head``, ``tail``, ``cp`` sources, ``dd if=``).

Relative paths are resolved against every directory the line may be in: a ``cd`` adds its
target and keeps the old one (it may have run in a subshell or a pipeline, or failed), so a
target is judged under each. What cannot be told is returned as ``unknown``: a variable or
``~`` in a target, a ``cd`` to one, ``xargs`` feeding a writer, ``find -delete``/``-exec``.
The engine allows those only when the policy lets the run write the whole workspace.
Everything else a program does to files stays the sandbox's to confine.
"""

from __future__ import annotations

import functools
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass

from stockade.policy.commands import UnanalysableError, _program, _walk

__all__ = ["FileAccess", "file_access"]

WORKSPACE = "/workspace"
WRITE_REDIRECTS = frozenset({">", ">>", ">|", "&>", "&>>", "<>", ">&"})
READ_REDIRECTS = frozenset({"<", "<&", "<>"})
NOT_FILES = frozenset({"<<", "<<<", "<<-"})  # here-documents and here-strings
# Writes anywhere else outside the workspace are refused (the sandbox's root is read-only anyway).
SCRATCH = ("/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty", "/dev/fd/", "/tmp/")

# Options that take a value, per program: their value is not a file operand.
_VALUED = {
    "cp": {"-t", "-S", "--target-directory", "--suffix"},
    "mv": {"-t", "-S", "--target-directory", "--suffix"},
    "ln": {"-t", "-S", "--target-directory", "--suffix"},
    "install": {"-t", "-m", "-o", "-g", "-S", "--target-directory", "--mode", "--owner", "--group"},
    "truncate": {"-s", "-r", "--size", "--reference"},
    "touch": {"-d", "-t", "-r", "--date", "--reference"},
    "mkdir": {"-m", "--mode"},
    "head": {"-n", "-c", "--lines", "--bytes"},
    "tail": {"-n", "-c", "--lines", "--bytes"},
    "sed": {"-e", "-f", "-l", "--expression", "--file"},
    "tee": set(),
}
_WRITES_ALL = frozenset({"tee", "rm", "rmdir", "unlink", "touch", "mkdir", "truncate", "shred", "ln"})
_COPIES = frozenset({"cp", "mv", "install"})
_READS_ALL = frozenset({"cat", "head", "tail", "tac", "nl", "wc", "less", "more"})
_WRITERS = _WRITES_ALL | _COPIES | {"sed", "dd"}


@dataclass(frozen=True, kw_only=True)
class FileAccess:
    """Paths as the command names them, resolved to workspace form where they are relative
    (``/workspace/...`` stays absolute; the path rules normalise both)."""

    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()  # why some writes cannot be told

    @property
    def empty(self) -> bool:
        return not (self.reads or self.writes or self.unknown)


def _operands(program: str, args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Positional operands, and the options with their values (``-t DIR``, ``--suffix=x``)."""
    valued = _VALUED.get(program, set())
    operands: list[str] = []
    options: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            operands += args[i + 1 :]
            break
        if arg.startswith("--") and "=" in arg:
            name, value = arg.split("=", 1)
            options[name] = value
        elif arg in valued:
            options[arg] = args[i + 1] if i + 1 < len(args) else ""
            i += 1
        elif arg.startswith("-") and arg != "-":
            options[arg] = ""
        else:
            operands.append(arg)
        i += 1
    return operands, options


def _program_files(command: tuple[str, ...]) -> tuple[list[str], list[str], list[str]]:
    """(reads, writes, unknown) of one simple command, by what its program is known to do."""
    program, args = _program(command[0]), command[1:]
    operands, options = _operands(program, args)
    reads: list[str] = []
    writes: list[str] = []
    unknown: list[str] = []
    if program in _WRITES_ALL:
        writes += operands  # ln: the link and what it points at (a link is a way to write there)
    elif program in _COPIES:
        target = options.get("-t") or options.get("--target-directory")
        sources = operands if target else operands[:-1]
        dest = target or (operands[-1] if operands else None)
        (writes if program == "mv" else reads).extend(sources)  # mv removes its sources
        if dest is not None:
            writes.append(dest)
    elif program == "sed" and any(o == "-i" or o.startswith(("-i", "--in-place")) for o in options):
        scripted = "-e" in options or "--expression" in options or "-f" in options or "--file" in options
        writes += operands if scripted else operands[1:]
    elif program == "dd":
        for arg in args:
            if arg.startswith("of="):
                writes.append(arg[3:])
            elif arg.startswith("if="):
                reads.append(arg[3:])
    elif program in _READS_ALL:
        reads += [o for o in operands if o != "-"]
    elif program == "find" and any(a in ("-delete", "-exec", "-execdir", "-ok", "-okdir") for a in args):
        unknown.append("find -delete/-exec acts on files it finds")
    elif program == "find" and any(a.startswith("-fprint") or a == "-fls" for a in args):
        unknown.append("find writes to a file named by an option")
    return reads, writes, unknown


def _resolve(word: str, cwds: frozenset[str], unknown_cwd: bool) -> tuple[list[str], str | None]:
    """The workspace-form paths ``word`` may name, or why it cannot be told."""
    if "$" in word or word.startswith("~"):
        return [], f"`{word}` depends on a variable or a home directory"
    if word.startswith("/"):
        return [word], None
    if unknown_cwd:
        return [], f"`{word}` is relative to a directory the rules cannot tell"
    return [posixpath.join(cwd, word) if cwd else word for cwd in sorted(cwds)], None


def _fd(word: str) -> bool:
    return word.isdigit() or word == "-"


def _scratch(path: str) -> bool:
    return any(path == s or (s.endswith("/") and path.startswith(s)) for s in SCRATCH)


@functools.lru_cache(maxsize=4096)
def _file_access(argv: tuple[str, ...], cwd: str) -> FileAccess:  # noqa: C901 - one walk of a shell line: redirects, cd, each program
    layers: list[tuple[str, ...]] = []
    entries = _walk(argv, layers)
    cwds = frozenset({cwd})
    unknown_cwd = False
    reads: list[str] = []
    writes: list[str] = []
    unknown: list[str] = []

    def add(words: Sequence[str], into: list[str]) -> None:
        for word in words:
            paths, why = _resolve(word, cwds, unknown_cwd)
            if why is not None:
                if into is writes:
                    unknown.append(why)
                continue
            into.extend(p for p in paths if not (into is writes and _scratch(p)))

    for command, redirects, fed in entries:
        for op, target in redirects:
            if op in NOT_FILES or (op in (">&", "<&") and _fd(target)):
                continue
            if op in READ_REDIRECTS:
                add([target], reads)
            if op in WRITE_REDIRECTS or op not in READ_REDIRECTS:  # an odd operator: a write
                add([target], writes)
        if not command:
            continue
        program = _program(command[0])
        if program in ("cd", "pushd", "popd"):
            operands = [a for a in command[1:] if not a.startswith("-")]
            where = operands[0] if operands else ""
            if not where or program == "popd" or "$" in where or where.startswith("~"):
                unknown_cwd = True  # home, the previous directory, a variable: cannot tell
            elif where.startswith("/"):
                if where == WORKSPACE or where.startswith(WORKSPACE + "/"):
                    cwds = cwds | {where[len(WORKSPACE) :].lstrip("/")}
                else:
                    unknown_cwd = True
            else:
                cwds = cwds | {posixpath.normpath(posixpath.join(c, where)) for c in cwds}
            continue
        if fed and program in _WRITERS:
            unknown.append(f"`{program}` gets its operands from xargs")
        r, w, u = _program_files(command)
        add(r, reads)
        add(w, writes)
        unknown += u
    return FileAccess(
        reads=tuple(dict.fromkeys(reads)), writes=tuple(dict.fromkeys(writes)), unknown=tuple(unknown)
    )


def file_access(argv: Sequence[str], cwd: str | None = None) -> FileAccess:
    """What ``argv`` (run in ``cwd``, the workspace by default) would read and write.
    Raises ``UnanalysableError`` when the line itself cannot be analysed."""
    base = ""
    if cwd:
        if cwd.startswith("/"):
            if cwd != WORKSPACE and not cwd.startswith(WORKSPACE + "/"):
                raise UnanalysableError(f"the command runs outside the workspace ({cwd})")
            base = cwd[len(WORKSPACE) :].lstrip("/")
        else:
            base = posixpath.normpath(cwd).lstrip("/")
            base = "" if base == "." else base
    return _file_access(tuple(argv), base)
