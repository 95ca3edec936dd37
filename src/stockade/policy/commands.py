"""Command rules over argv, never regular expressions over strings.

A command is split into the simple commands it would run: ``sh -c "a && b | c"`` is three;
wrappers (``env``, ``sudo``, ``timeout 5``, ``nice``, ``xargs``, ...) and ``python -m`` are
looked through (the interpreter's command line read as CPython reads it, ``python3 -Impip``
too: ``execruns.command_line``, the supervisor's own reading), and a script given to python,
a shell or another interpreter is judged by the deny and approve rules as the program it is
part of too (``python3 .../pip/__main__.py``: ``pip``; ``node /usr/bin/npm``: ``npm``). What
cannot be analysed (command substitution, a variable as the program, ``eval``) is denied: the
rules fail closed. The sandbox still confines whatever slips past.
"""

from __future__ import annotations

import functools
import posixpath
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from stockade._display import visible
from stockade.policy.schema import CommandRules, Verdict
from stockade.sandbox.supervisor import execrules, execruns

__all__ = ["CommandDecision", "allows", "analyse", "decide_command", "matches", "simple_commands"]

SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash"})
# Programs that run their arguments as another command; value: how many operands they take first.
WRAPPERS = {
    "env": 0, "sudo": 0, "doas": 0, "nohup": 0, "nice": 0, "ionice": 0, "time": 0,
    "command": 0, "exec": 0, "builtin": 0, "xargs": 0, "stdbuf": 0, "setsid": 0,
    "timeout": 1, "chroot": 1, "unbuffer": 0,
}  # fmt: skip
# Wrapper options that take a value (the next word), so that it is not taken for the program.
WRAPPER_VALUED: dict[str, frozenset[str]] = {
    "nice": frozenset({"-n", "--adjustment"}),
    "ionice": frozenset({"-c", "-n", "-p", "-P", "-u", "--class", "--classdata"}),
    "timeout": frozenset({"-s", "-k", "--signal", "--kill-after"}),
    "stdbuf": frozenset({"-i", "-o", "-e", "--input", "--output", "--error"}),
    "env": frozenset({"-u", "-C", "--unset", "--chdir"}),
    "sudo": frozenset({"-u", "-g", "-C", "-D", "-h", "-p", "-U", "-r", "-t", "--user", "--group"}),
    "doas": frozenset({"-u", "-C"}),
    "xargs": frozenset({"-n", "-L", "-P", "-I", "-d", "-E", "-s", "-a", "--max-args", "--max-procs"}),
    "chroot": frozenset({"--userspec", "--groups"}),
    "exec": frozenset({"-a"}),  # exec -a NAME rm -r x runs rm, named NAME
}
UNANALYSABLE = frozenset({"eval", "source", "."})
OPERATORS = frozenset({";", "&&", "||", "|", "&", "(", ")", "\n", ";;", "|&"})
REDIRECTS = frozenset({">", ">>", "<", "<<", "<<<", ">&", "<&", "&>", ">|", "&>>"})


class UnanalysableError(ValueError):
    """The rules cannot tell what a command would run."""


def _program(word: str) -> str:
    return posixpath.basename(word)


def _unwrap(argv: list[str], layers: list[tuple[str, ...]]) -> list[str]:
    """Drop ``VAR=value`` prefixes and wrapper programs (recorded in ``layers``), recursively."""
    while argv:
        head = argv[0]
        if "=" in head and not head.startswith("=") and head.split("=", 1)[0].isidentifier():
            argv = argv[1:]
            continue
        if head.startswith("$"):
            raise UnanalysableError(f"the program is a variable ({head})")
        name = _program(head)
        if name in UNANALYSABLE:
            raise UnanalysableError(f"{name} runs text as code")
        if name in WRAPPERS:
            layers.append(tuple(argv))
            at = 1  # an index, not a slice a word: a slice each made 20,000 options quadratic
            while at < len(argv) and argv[at].startswith("-") and argv[at] != "--":
                option = argv[at]
                if name == "env" and option.startswith(("-S", "--split-string")):
                    raise UnanalysableError("env -S splits a string into a command")
                # an option's value is not the program (``nice -n 5 curl``: the program is curl)
                takes_value = option in WRAPPER_VALUED.get(name, ()) and "=" not in option
                at += 2 if takes_value else 1
            if at < len(argv) and argv[at] == "--":
                at += 1
            while at < len(argv) and "=" in argv[at] and name == "env":
                at += 1
            argv = argv[at + WRAPPERS[name] :]
            continue
        run = execruns.command_line(argv) if name.startswith("python") else None
        if run is not None and run[0] == "-m":  # python3 -Impip x runs pip x
            layers.append(tuple(argv))
            argv = execruns.subject(argv)
            continue
        # a script: python3 .../pip/__main__.py x is pip x to deny and approve, node
        # /usr/bin/npm x is npm x (any word an unread interpreter may run: execruns.scripts)
        scripts = _runs(argv)
        if scripts:
            layers.extend(tuple(command) for command in scripts)
            return argv
        carried = execruns.carried([name], argv)  # ld.so PROGRAM ..., busybox APPLET ...
        if carried is not None:
            layers.append(tuple(argv))
            argv = carried[1] if carried[0] is None else [carried[0], *carried[1][1:]]
            continue
        return argv
    return argv


def _runs(argv: list[str]) -> list[list[str]]:
    """``execruns.runs``: what an interpreter's argv runs; unanalysable past what is read."""
    try:
        return execruns.runs(argv)
    except execruns.TooMany as error:
        raise UnanalysableError(str(error)) from None


Redirect = tuple[str, str]  # (operator, target word)


# The longest shell line read (the kernel's MAX_ARG_STRLEN: no `sh -c` takes a longer one, so
# none longer can run). shlex builds a word a character at a time, in time that grows with the
# square of its length: 2 MB sent to the service took minutes of its CPU, 128 KiB takes ~0.2 s.
MAX_SCRIPT_CHARS = 128 * 1024


def _split_script(script: str) -> list[tuple[list[str], list[Redirect]]]:
    """The simple commands of a shell line, each with its redirections."""
    if len(script) > MAX_SCRIPT_CHARS:
        raise UnanalysableError(
            f"a shell line of {len(script):,} characters (no shell takes one over 128 KiB)"
        )
    if "`" in script or "$(" in script or "<(" in script or ">(" in script:
        raise UnanalysableError("command substitution")
    lexer = shlex.shlex(script.replace("\n", " ; "), posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError as err:
        raise UnanalysableError(f"unbalanced quotes ({err})") from None
    commands: list[tuple[list[str], list[Redirect]]] = [([], [])]
    pending: str | None = None
    for token in tokens:
        if pending is not None:
            commands[-1][1].append((pending, token))  # the redirection's target, not an argument
            pending = None
        elif token in OPERATORS:
            commands.append(([], []))
        elif token in REDIRECTS or (token.rstrip("<>&|") != token and set(token) <= set("<>&|")):
            pending = token
        else:
            commands[-1][0].append(token)
    if pending is not None:
        raise UnanalysableError(f"a redirection ({pending}) without a target")
    return [c for c in commands if c[0] or c[1]]


def _walk(
    argv: Sequence[str], layers: list[tuple[str, ...]], depth: int = 0
) -> list[tuple[tuple[str, ...], tuple[Redirect, ...], bool]]:
    """(simple command, its redirections, whether ``xargs`` feeds it) for everything ``argv`` runs."""
    if depth > 8:
        raise UnanalysableError("shells nested too deep")
    before = len(layers)
    inner = _unwrap(list(argv), layers)
    fed = any(_program(layer[0]) == "xargs" for layer in layers[before:] if layer)
    if not inner:
        return []
    if _program(inner[0]) in SHELLS:
        layers.append(tuple(inner))
        args = inner[1:]
        for index, arg in enumerate(args):
            if arg == "-c" or (arg.startswith("-") and not arg.startswith("--") and arg.endswith("c")):
                if index + 1 >= len(args):
                    raise UnanalysableError("shell -c without a script")
                found: list[tuple[tuple[str, ...], tuple[Redirect, ...], bool]] = []
                for words, redirects in _split_script(args[index + 1]):
                    if redirects:
                        found.append(((), tuple(redirects), False))
                    if words:
                        found.extend(_walk(words, layers, depth + 1))
                return found
            if not arg.startswith("-"):
                raise UnanalysableError("a shell running a script file")
        raise UnanalysableError("an interactive shell")
    return [(tuple(inner), (), fed)]


def simple_commands(
    argv: Sequence[str], layers: list[tuple[str, ...]] | None = None, _depth: int = 0
) -> list[tuple[str, ...]]:
    """Every simple command ``argv`` would run; wrappers met on the way (``sudo ...``,
    ``sh -c ...``) are appended to ``layers``. Raises ``UnanalysableError`` (a ValueError)."""
    if layers is None:
        layers = []
    return [command for command, _, _ in _walk(argv, layers, _depth) if command]


@functools.lru_cache(maxsize=1024)
def _words(pattern: str) -> tuple[str, ...]:
    return tuple(shlex.split(pattern))


@functools.lru_cache(maxsize=4096)
def _analyse(argv: tuple[str, ...]) -> tuple[tuple[tuple[str, ...], ...], tuple[tuple[str, ...], ...]]:
    """(wrapper layers, simple commands), cached: agents repeat the same commands."""
    layers: list[tuple[str, ...]] = []
    commands = simple_commands(argv, layers)
    return tuple(layers), tuple(commands)


def analyse(argv: Sequence[str]) -> tuple[tuple[tuple[str, ...], ...], tuple[tuple[str, ...], ...]]:
    return _analyse(tuple(argv))


def matches(pattern: str, command: Sequence[str]) -> bool:
    """Whether a simple command matches a pattern such as ``"rm -r"`` or ``"git push"``
    (the same judge the supervisor applies to every exec inside the sandbox)."""
    return execrules.matches(_words(pattern), command)


def allows(pattern: str, command: Sequence[str]) -> bool:
    """Whether the allow rule ``pattern`` lets a simple command run: only where the command
    surely does what it names (``execrules.allows``, the supervisor's reading too)."""
    return execrules.allows(_words(pattern), command)


@dataclass(frozen=True, kw_only=True)
class CommandDecision:
    verdict: Verdict
    rule: str
    reason: str
    command: tuple[str, ...] = ()


def decide_command(rules: CommandRules, argv: Sequence[str]) -> CommandDecision:
    """The strictest verdict over every simple command ``argv`` would run."""
    try:
        layers, commands = analyse(argv)
    except UnanalysableError as err:
        return CommandDecision(
            verdict=Verdict.DENY, rule="commands.unanalysable",
            reason=f"cannot tell what this command runs ({err}); use plain commands",
        )  # fmt: skip
    approval: CommandDecision | None = None
    # ``python3 -m pytest`` is analysed as ``pytest``: an allow rule may name either
    modules = {tuple(execruns.subject(layer)): layer for layer in layers if _runs_module(layer)}
    # Deny and approve rules see wrappers too (``sudo``, ``sh -c``); the allowlist sees what runs.
    for command in (*layers, *commands):
        shown = visible(shlex.join(command))
        for pattern in rules.deny:
            if matches(pattern, command):
                return CommandDecision(
                    verdict=Verdict.DENY, rule=f"commands.deny: {pattern}",
                    reason=f"`{shown}` is denied by the policy ({pattern!r})", command=command,
                )  # fmt: skip
        if command in commands and rules.allow and not _listed(rules.allow, command, modules.get(command)):
            return CommandDecision(
                verdict=Verdict.DENY, rule="commands.allow",
                reason=f"`{visible(_program(command[0]))}` is not in the policy's list of allowed commands",
                command=command,
            )  # fmt: skip
        if approval is None:
            for pattern in rules.approve:
                if matches(pattern, command):
                    approval = CommandDecision(
                        verdict=Verdict.APPROVE, rule=f"commands.approve: {pattern}",
                        reason=f"`{shown}` needs a human's approval ({pattern!r})", command=command,
                    )  # fmt: skip
                    break
    return approval or CommandDecision(verdict=Verdict.ALLOW, rule="commands", reason="allowed")


def _runs_module(argv: Sequence[str]) -> bool:
    run = execruns.command_line(argv) if argv and _program(argv[0]).startswith("python") else None
    return run is not None and run[0] == "-m"


def _listed(allow: Sequence[str], command: tuple[str, ...], interpreter: tuple[str, ...] | None) -> bool:
    """Whether the allowlist lets ``command`` run, or the interpreter's command line that runs
    it as a module (``python3 -m pytest -k x`` under ``python3 -m pytest``)."""
    return any(allows(p, command) or (interpreter is not None and allows(p, interpreter)) for p in allow)
