"""What an exec runs besides the program it names: the script or module an interpreter's
command line runs (read as python's and a shell's getopt read it; any word may be another
interpreter's script), the program a loader or a multi-call binary runs, the interpreter
a script's ``#!`` line names, and the folders of the image; and the name a program goes
by (``program``: the last word of its path) and a glob over it (``glob``), as every reader
of a command line here takes them.

Apart from the rules (``execrules``), which judge what these find: the host's policy reads
an interpreter's command line with it too (``command_line``, ``runs``), and the supervisor's
set-up takes its program lists (``INTERPRETERS``, ``LOADERS``, ``MULTICALL``). Standard
library only (it runs inside the sandbox), and imports none of the supervisor's modules.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import List, Optional, Sequence, Tuple

GLOB_CHARS = frozenset("*?[")


def program(word: str) -> str:
    return word.rsplit("/", 1)[-1]


def glob(name: str, pattern: str) -> bool:
    """fnmatch, imported only for a pattern that is one (fnmatch imports re: milliseconds)."""
    if not GLOB_CHARS & set(pattern):
        return name == pattern
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern)


SHELLS = ("sh", "bash", "dash", "ash", "ksh", "zsh")
# Interpreters whose command lines are not read here word by word: any word may be the script
# they run (``scripts``). ``node /usr/bin/npm install`` ran npm past an `npm install` rule.
OTHER_INTERPRETERS = (
    "node",
    "nodejs",
    "perl*",
    "ruby*",
    "php*",
    "tclsh*",
    "wish*",
    "lua*",
    "luajit*",
    "Rscript",
)
# The programs that run a script file they are given (globs, as judge.c reads them): an exec
# of one with arguments is Python's to judge.
INTERPRETERS = ("python*", *SHELLS, *OTHER_INTERPRETERS)
# Their files, by the names the image gives them: a copy of one under another name (./py -m
# pip) is known by its content, as a copy of a rule's program is, and read as the interpreter.
INTERPRETER_FILES = (
    "python3", "python", *SHELLS, "node", "nodejs", "perl", "ruby", "php", "tclsh", "wish", "lua", "luajit",
    "Rscript",
)  # fmt: skip

# Folders of the image: code can write none of them (a file there is what the image shipped).
IMAGE_FOLDERS = ("/usr/", "/bin/", "/sbin/", "/lib/", "/lib32/", "/lib64/", "/libx32/", "/opt/")


def in_image(path: str) -> bool:
    return path.startswith(IMAGE_FOLDERS)


# How each interpreter reads its command line, as its getopt does: the options that end the
# options with code in no file (python -c CODE; sh -c, -s), the one that names a module
# (python -m MODULE), those that take a value, attached (-Wignore, -mpip) or as the next word,
# the long ones that take the next word, and what an option starts with. CPython's list is
# Python/getopt.c's SHORT_OPTS ("bBc:dEhiIm:OPqRsStuvVW:xX:?"): an option it does not know
# ends the run with an error, so reading one as a flag lets nothing run unread.
PYTHON_OPTIONS = ("c", "m", "WX", ("--check-hash-based-pycs",), "-")
SHELL_OPTIONS = ("cs", "", "oO", ("--rcfile", "--init-file"), "-+")  # bash -O extglob, +O


def command_line(argv: "Sequence[str]") -> "Optional[Tuple[str, List[str]]]":
    """What an interpreter's command line runs, read as the interpreter reads it: ``("-m",
    [module, *args])`` for ``python3 -Impip x`` (short options combine; -c, -m, -W, -X take
    a value, attached or the next word; ``--`` ends the options), ``("script", [path, *args])``
    for the first word that is no option (``python3 -X dev /usr/bin/pip x``). None: not an
    interpreter, or code that is no file nor module (``-c``, standard input)."""
    name = program(argv[0]) if argv else ""
    if name.startswith("python"):  # INTERPRETERS: each one known here
        stops, module_letter, valued, long_valued, signs = PYTHON_OPTIONS
    elif name in SHELLS:
        stops, module_letter, valued, long_valued, signs = SHELL_OPTIONS
    else:
        return None
    at = 1
    while at < len(argv):
        word = argv[at]
        if word == "--":
            at += 1
            break
        if word.startswith("--"):
            at += 2 if word in long_valued else 1
            continue
        if len(word) < 2 or word[0] not in signs:
            break
        step = 1
        for i in range(1, len(word)):
            letter = word[i]
            if letter in stops:
                return None  # code given as text, or read from standard input
            if letter == module_letter:
                attached = word[i + 1 :]
                module = attached if attached else (argv[at + 1] if at + 1 < len(argv) else None)
                if module is None:
                    return None  # python3 -m with no module: an error, nothing runs
                return "-m", [module, *argv[at + (1 if attached else 2) :]]
            if letter in valued:  # -W arg, -X dev; -Wignore holds its own (the rest is its value)
                step = 1 if word[i + 1 :] else 2
                break
        at += step
    if at >= len(argv) or argv[at] == "-":
        return None
    return "script", list(argv[at:])


def subject(argv: "Sequence[str]") -> "List[str]":
    """What a command runs: ``python3 -m pip install x`` (or ``-Impip``, ``-m pip.__main__``)
    runs ``pip install x``: the module's top-level package, which rules name as a program."""
    run = command_line(argv)
    if run is not None and run[0] == "-m":
        return [run[1][0].split(".", 1)[0], *run[1][1:]]
    return list(argv)


def script_run(argv: "Sequence[str]") -> "Optional[List[str]]":
    """The script an interpreter is given to run, as the command it is: ``python3 /usr/bin/pip
    install x`` runs ``pip install x``, as ``/usr/bin/pip install x`` would (the kernel runs
    it so for its ``#!`` line). None: no script file (``-c``, ``-m``, standard input)."""
    run = command_line(argv)
    return run[1] if run is not None and run[0] == "script" else None


# The words that may be an interpreter's script (``scripts``), and the folders of a Python
# script's path read as programs (``runs``), judged at most: each is a copy of the argv's
# rest, so a command of N options made N copies of N words (50 KB of `node -r x -r x ...`
# took 65 s and 2.3 GB of the host's policy check, and ran the sandbox's judge out of memory:
# found from outside). Past the cap a command is not read, and is refused.
MAX_SCRIPTS = 32


class TooMany(ValueError):
    """More words may be what an interpreter runs than are judged (``MAX_SCRIPTS``)."""


def scripts(argv: "Sequence[str]") -> "List[List[str]]":
    """The script files an interpreter's ``argv`` may run, each with its arguments: Python's
    and a shell's as they read their command line; another interpreter's (node, perl, ruby:
    ``OTHER_INTERPRETERS``), whose options are not known here, every word that may be its
    script: each word no option that follows an option (it may be the option's value, or the
    script after an option that takes none) and the first that does not (the script, if no
    word before was). Options come before the script in each of them, so the script is one
    of these whichever options take a value; the others are judged too, which errs on the
    side of asking (``perl -e CODE rm -r x`` is judged as ``rm -r x``: it may well run it).
    ``TooMany`` past ``MAX_SCRIPTS`` of them."""
    name = program(argv[0]) if argv else ""
    if not any(glob(name, other) for other in OTHER_INTERPRETERS):
        run = script_run(argv)
        return [run] if run is not None else []
    found: "List[List[str]]" = []
    after_option = False
    for at in range(1, len(argv)):
        word = argv[at]
        if word == "--":
            return found + ([list(argv[at + 1 :])] if at + 1 < len(argv) else [])
        if len(word) > 1 and word[0] == "-":
            after_option = True
            continue
        if len(found) == MAX_SCRIPTS:
            raise TooMany(f"more than {MAX_SCRIPTS} words of {name}'s command line may be the script it runs")
        found.append(list(argv[at:]))
        if not after_option:
            break
        after_option = False
    return found


def runs(argv: "Sequence[str]") -> "List[List[str]]":
    """Each command an interpreter's ``argv`` runs, as a program the rules name: a module as
    its top-level package (``python3 -m pip.__main__ x``: ``pip x``); a script by its name
    and, for Python, by its name without its suffix and by every folder on its path (a
    package's ``__main__.py``, the package's folder itself, a file in it: ``python3
    .../pip/__main__.py x`` and ``python3 .../pip x`` are ``pip x``; ``python3 pip.pyz x`` is
    too; the last ``MAX_SCRIPTS`` folders of its path). Empty: the interpreter runs no file
    nor module (``-c``), or is none. ``TooMany``: see ``scripts``."""
    run = command_line(argv)
    if run is None:
        return [[program(script[0]), *script[1:]] for script in scripts(argv)]
    target, args = run[1][0], run[1][1:]
    if run[0] == "-m":
        return [[target.split(".", 1)[0], *args]]
    found = [[target, *args]]
    if program(argv[0]).startswith("python"):
        *folders, name = target.split("/")
        stem = name.split(".", 1)[0]
        words = dict.fromkeys(
            w for w in (stem, *folders[-MAX_SCRIPTS:]) if w not in ("", ".", "..", name, target)
        )
        found += [[word, *args] for word in words]
    return found


# Programs that run another program their arguments name: the dynamic loader, run as a program
# (``ld.so [--argv0 NAME] [OPTIONS] PROGRAM ARGS``), and multi-call binaries, run by their own
# name (``busybox APPLET ARGS``; by an applet's name, the applet is their argv[0]).
LOADERS = ("ld-linux*", "ld.so*", "ld64.so*", "ld-musl-*")
MULTICALL = ("busybox", "toybox")
# The loader's options that take a value (glibc's ld.so --help); any other is a flag.
LOADER_VALUED = frozenset(
    ("--argv0", "--library-path", "--preload", "--audit", "--inhibit-rpath",
     "--glibc-hwcaps-prepend", "--glibc-hwcaps-mask")
)  # fmt: skip


def carried(names: "Sequence[str]", argv: "Sequence[str]") -> "Optional[Tuple[Optional[str], List[str]]]":
    """What an exec of the program ``names`` (what its file goes by) with ``argv`` runs besides
    itself: the loader's program (its path, and the argv it gets), or a multi-call binary's
    applet (no path: it is the same file). None: nothing."""
    if len(argv) < 2:
        return None
    if program(argv[0]).startswith(MULTICALL):  # busybox reads its applet from argv[0] first
        return None if argv[1].startswith("-") else (None, list(argv[1:]))
    if not any(glob(name, loader) for name in names for loader in LOADERS):
        return None
    words, at, argv0 = list(argv[1:]), 0, None
    while at < len(words) and words[at].startswith("--"):
        if words[at] == "--":
            at += 1
            break
        if words[at] in LOADER_VALUED:
            if words[at] == "--argv0" and at + 1 < len(words):
                argv0 = words[at + 1]
            at += 2
        else:
            at += 1  # a flag (--list, --verify), or --option=value
    if at >= len(words):
        return None
    path = words[at]
    return path, [path if argv0 is None else argv0, *words[at + 1 :]]


# The kernel reads this much of a file to tell what runs it (BINPRM_BUF_SIZE).
SCRIPT_HEAD = 256


def interpreted(head: bytes, path: str, argv: "Sequence[str]") -> "Optional[Tuple[str, List[str]]]":
    """What the kernel runs for an exec of ``path`` with ``argv`` when the file begins with
    ``head`` (its first ``SCRIPT_HEAD`` bytes) and is a script: its interpreter's path and
    argv, read from the first line as fs/binfmt_script.c reads it (the name up to a space,
    tab or NUL; the rest, trimmed, one argument). No exec is made for the interpreter, so it
    must be judged with the script. None: not a script, or one the kernel refuses."""
    if not head.startswith(b"#!"):
        return None
    end = head.find(b"\n")
    if end < 0:
        rest = head[2 : SCRIPT_HEAD - 1].lstrip(b" \t")
        # No end of line: the kernel takes the whole head only if the name ends in it.
        if not rest or not any(c in rest for c in b" \t\0"):
            return None
        end = SCRIPT_HEAD - 1
    line = head[2:end].rstrip(b" \t").lstrip(b" \t")
    if not line:
        return None
    cut = min((i for i in (line.find(b" "), line.find(b"\t"), line.find(b"\0")) if i >= 0), default=len(line))
    name, rest = line[:cut], line[cut:]
    arg = rest.split(b"\0", 1)[0].lstrip(b" \t") if rest[:1] != b"\0" else b""
    words = [name.decode("utf-8", "surrogateescape")]
    if arg:
        words.append(arg.decode("utf-8", "surrogateescape"))
    return words[0], [*words, path, *argv[1:]]


def env_runs(head: bytes) -> "Optional[List[str]]":
    """What a script whose first line is ``#!/usr/bin/env X`` (or ``env -S "X OPTIONS"``)
    has env run: X and the options it is given before the script's path (env execs
    ``[X, *OPTIONS, script, *args]``). None: no such line, or one env reads otherwise
    (its own options, quotes, escapes: not told here)."""
    script = interpreted(head, "", [])
    if script is None or program(script[0]) != "env" or len(script[1]) != 3:
        return None
    arg = script[1][1]
    if arg.startswith("-S"):
        arg = arg[2:]
    elif any(c in arg for c in " \t"):
        return None  # one name with a space in it: env finds no such program
    words = arg.split()
    while words and "=" in words[0]:  # NAME=VALUE: set, not run
        words.pop(0)
    if not words or words[0].startswith("-") or any(c in arg for c in "\\'\"$"):
        return None
    return words
