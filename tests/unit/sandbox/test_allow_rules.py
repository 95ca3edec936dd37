"""An allow rule lets run only what does what it names (execrules.allows), read as the
program reads its command line: python's module or script (nothing given as code with -c),
git's command at git's command place, any other program's leading operands. A rule's words
anywhere in the argv (an option's value, a word past the real command) are not enough: under
``allow = ["python3 -m pytest", "git status"]`` all of ATTACKS ran. Deny and approve rules
still match loosely (that errs toward asking), and now also as the program reads its argv."""

from __future__ import annotations

import importlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stockade.sandbox.supervisor import execgit, execnpm, execrules
from tests.conftest import require

ALLOW = [["python3", "-m", "pytest"], ["git", "status"]]
ATTACKS = [
    ["python3", "-c", "import os; os.makedirs('/tmp/victim/a')", "-m", "pytest"],  # -c runs first
    ["git", "init", "-q", "status"],  # a word past the real command
    ["git", "-C", "status", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "x"],  # a value
    ["git", "-C", "status", "config", "core.hooksPath", "/x"],
    ["git", "--frobnicate", "status", "commit"],  # an option it does not know may take a value
    ["git", "-c", "alias.st=!sh", "st"],  # an alias may run anything
]
ALLOWED = [
    ["python3", "-m", "pytest", "-k", "x"],
    ["python3", "-I", "-mpytest"],
    ["git", "status", "-s"],
    ["git", "-C", "repo", "status"],
    ["git", "--no-pager", "-c", "color.ui=never", "status"],
]


def _allowed(argv: list[str]) -> bool:
    return any(execrules.allows(words, argv) for words in ALLOW)


@pytest.mark.parametrize("argv", ATTACKS)
def test_an_allow_rule_does_not_let_run_a_command_that_merely_carries_its_words(argv: list[str]) -> None:
    assert not _allowed(argv)


@pytest.mark.parametrize("argv", ALLOWED)
def test_an_allow_rule_lets_run_what_does_what_it_names(argv: list[str]) -> None:
    assert _allowed(argv)


@pytest.mark.parametrize(
    ("rule", "argv", "allowed"),
    [
        (["rm", "-r", "build"], ["rm", "-r", "build"], True),  # the rule's own words
        (["rm", "-r", "build"], ["rm", "build", "-r"], True),
        (["rm", "-r", "build"], ["rm", "-f", "build", "-r"], False),  # -f may take build
        (["rm", "-r", "build"], ["rm", "--", "build"], False),  # no -r
        (["git", "push", "--dry-run"], ["git", "-C", "--dry-run", "push"], False),  # -C's value
        (["git", "push", "--dry-run"], ["git", "push", "-o", "--dry-run", "origin"], False),
        (["git", "push", "--dry-run"], ["git", "push", "--dry-run", "origin"], True),
        (["make", "test"], ["make", "--", "test"], True),
        (["make", "test"], ["make", "-j", "test", "install"], False),
        (["python3", "tool.py"], ["python3", "-X", "dev", "tool.py", "a"], True),
        (["python3", "tool.py"], ["python3", "-m", "tool.py"], False),
        (["python3", "-I", "-m", "pytest"], ["python3", "-m", "pytest"], False),  # no -I
        # a package's __main__ is what -m runs of the package; another submodule is not
        (["python3", "-m", "pytest"], ["python3", "-m", "pytest.__main__", "-q"], True),
        (["python3", "-m", "pytest"], ["python3", "-Impytest.__main__"], True),
        (["python3", "-m", "pytest"], ["python3", "-m", "pytest.foo"], False),
        (["python3", "-m", "pytest"], ["python3", "-m", "pytest_evil.__main__"], False),
        # npm's command past the options npm reads as taking no value (NPM_FLAGS)
        (["npm", "test"], ["npm", "--silent", "test"], True),
        (["npm", "test"], ["npm", "-s", "t"], True),
        (["npm", "test"], ["npm", "-sd", "tst", "--", "-x"], True),
        (["npm", "test"], ["npm", "--no-audit", "--", "test"], True),
        (["npm", "run", "build"], ["npm", "run", "--silent", "build"], True),
        (["npm", "test"], ["npm", "--prefix", "test", "exec", "x"], False),  # a value
        (["npm", "test"], ["npm", "-w", "test", "run", "x"], False),
        (["npm", "test"], ["npm", "--silent", "run", "test"], False),
        (["npm", "run", "build"], ["npm", "run", "--script-shell", "build", "evil"], False),
    ],
)
def test_an_allow_rules_words_are_read_where_the_program_reads_them(
    rule: list[str], argv: list[str], allowed: bool
) -> None:
    assert execrules.allows(rule, argv) is allowed


def test_a_deny_rule_also_matches_the_command_as_its_program_reads_it() -> None:
    """``python3 -Impip`` runs pip as ``python3 -m pip`` does: the loose reading missed it (its
    module is in an option's cluster); a word anywhere still matches, toward asking."""
    assert execrules.matches(["python3", "-m", "pip"], ["python3", "-Impip", "install", "x"])
    assert execrules.matches(["git", "push"], ["git", "-C", "push", "status"])


GIT_OPTIONS = st.sampled_from(
    [
        ["-C", "status"], ["-c", "status"], ["--git-dir", "status"], ["-C", "-q"], ["--no-pager"],
        ["-p"], ["--bare"], ["--git-dir=status"], ["--frob"], ["--frob", "status"], ["-x"],
    ]
)  # fmt: skip
GIT_WORDS = st.sampled_from(["status", "commit", "config", "init", "st", "-q", "-s", "x"])


@given(
    st.lists(GIT_OPTIONS, max_size=4),
    st.sampled_from(["status", "commit", "config", "init", "st"]),
    st.lists(GIT_WORDS, max_size=3),
)
@settings(max_examples=400, deadline=None)
def test_options_before_gits_command_never_make_an_allow_rule_hold_over_another_command(
    options: list[list[str]], command: str, rest: list[str]
) -> None:
    """Whatever global options come first (the values of those git knows, those it does not,
    which in some git may take the next word), ``git status`` allows only git's status."""
    argv = ["git", *itertools.chain.from_iterable(options), command, *rest]
    allowed = execrules.allows(["git", "status"], argv)
    if allowed:
        assert command == "status", argv
    known = all(o[0] in execgit.GIT_VALUED | execgit.GIT_FLAGS or "=" in o[0] for o in options)
    if command == "status" and known:
        assert allowed, argv


NPM_OPTIONS = st.sampled_from(
    [
        ["-s"], ["--silent"], ["-sd"], ["--no-audit"], ["--prefix=x"], ["--prefix", "test"],
        ["-w", "t"], ["--frob"], ["--frob", "test"], ["--"],
    ]
)  # fmt: skip


@given(
    st.lists(NPM_OPTIONS, max_size=4),
    st.sampled_from(["test", "t", "tst", "run", "install", "i", "exec", "x", "te"]),
    st.lists(st.sampled_from(["test", "-s", "--prefix", "x"]), max_size=3),
)
@settings(max_examples=400, deadline=None)
def test_options_before_npms_command_never_make_an_allow_rule_hold_over_another_command(
    options: list[list[str]], command: str, rest: list[str]
) -> None:
    """Whatever options come first (those npm reads as taking no value, and others, that may
    take the next word), ``npm test`` allows only npm's test, by any name npm takes for it."""
    words = list(itertools.chain.from_iterable(options))
    argv = ["npm", *words, command, *rest]
    allowed = execrules.allows(["npm", "test"], argv)
    at = words.index("--") if "--" in words else len(words)
    runs = words[at + 1] if at + 1 < len(words) else command  # the word after a --, if any
    flags, short = execnpm.NPM_FLAGS, execnpm.NPM_SHORT_FLAGS
    surely = all(
        "=" in w or w.startswith("--no-") or w[2:] in flags or set(w[1:]) <= short for w in words[:at]
    )
    assert allowed == (surely and execnpm.npm_command(runs) == "test"), argv


PYTHON_OPTIONS = st.sampled_from([["-I"], ["-B"], ["-W", "ignore"], ["-Wignore"], ["-X", "dev"], ["-c", "x"]])


@given(
    st.lists(PYTHON_OPTIONS, max_size=4),
    st.sampled_from([["-m", "pytest"], ["-mpytest"], ["-m", "pip"], ["pytest"], ["-c", "x", "-m", "pytest"]]),
    st.lists(st.sampled_from(["-m", "pytest", "-c", "x", "-k"]), max_size=3),
)
@settings(max_examples=400, deadline=None)
def test_an_allowed_python_module_is_what_python_runs(
    options: list[list[str]], run: list[str], rest: list[str]
) -> None:
    """CPython runs the first of -c CODE and -m MODULE it reads (or a script): ``python3 -m
    pytest`` allows only a command line whose first is ``-m pytest``."""
    units = [*options, run]
    first = next((u for u in units if u[0].startswith("-c") or u[0].startswith("-m")), None)
    runs_pytest = first is not None and (first == ["-m", "pytest"] or first == ["-mpytest"])
    argv = ["python3", *itertools.chain.from_iterable(units), *rest]
    assert execrules.allows(["python3", "-m", "pytest"], argv) is runs_pytest, argv


GENERIC_WORDS = st.sampled_from(["-r", "-f", "-o", "--recursive", "--k=v", "--", "build", "x"])


def _readings(args: list[str]) -> Iterator[tuple[list[str], bool]]:
    """Each way a getopt may read ``args`` (each option taking the next word as its value, or
    not): its operands, and whether it carries ``-r`` as an option."""
    options = [i for i, a in enumerate(args) if a.startswith("-") and a != "--" and "=" not in a]
    for count in range(len(options) + 1):
        for valued in itertools.combinations(options, count):
            operands: list[str] = []
            carries, at, ended = False, 0, False
            while at < len(args):
                word = args[at]
                if ended or not word.startswith("-") or word == "-":
                    operands.append(word)
                elif word == "--":
                    ended = True
                else:
                    carries = carries or word in ("-r", "--recursive")
                    at += 1 if at in valued else 0
                at += 1
            yield operands, carries


@given(st.lists(GENERIC_WORDS, max_size=6))
@settings(max_examples=400, deadline=None)
def test_an_allow_rule_holds_over_another_program_only_as_every_reading_of_its_options_does(
    args: list[str],
) -> None:
    """A program whose options this does not know: ``rm -r build`` allows an argv only if,
    whichever of its options take a value, build is its first operand and -r an option."""
    if execrules.allows(["rm", "-r", "build"], ["rm", *args]) and args[:2] != ["-r", "build"]:
        for operands, carries in _readings(args):
            assert operands[:1] == ["build"] and carries, (args, operands)


@pytest.mark.parametrize("argv", ATTACKS[:4] + ALLOWED[:4])
def test_the_sandboxs_exec_judge_reads_an_allow_rule_so(execjudge: Any, argv: list[str]) -> None:
    """The supervisor's judge, on the image's own git and python3 (the files an exec names)."""
    commands = {"deny": [], "approve": [], "allow": ALLOW}
    rulespy = importlib.import_module("rulespy")
    listed, _ = rulespy.allowlist(ALLOW)
    judge = execjudge.ExecJudge(None, commands, rulespy.program_sizes(commands), listed=listed)
    path = "/usr/bin/python3" if argv[0] == "python3" else "/usr/bin/git"
    require(path, os.path.exists(path), "the judge is read on the image's files elsewhere")
    expected = ("allow", None) if argv in ALLOWED else ("deny", "commands.allow")
    assert judge.judge(os.getpid(), path, argv) == expected


def test_a_link_swapped_while_an_exec_is_judged_leaves_no_name_on_the_file(
    execjudge: Any, tmp_path: Path
) -> None:
    """The judge looks at an exec's file twice (its stat, then the name it leads to): a link
    swapped between the two looks named one file after the other, and that name was kept
    by the first file for the sandbox's life (a listed ``ls`` judged as the ELF loader ever
    after). Now such an exec is refused, and the next exec of the file is judged afresh."""
    commands = {"deny": [], "approve": [], "allow": [["ls"], ["true"]]}
    ls, loader = tmp_path / "ls", tmp_path / "ld-linux-x86-64.so.2"
    ls.write_bytes(b"\x7fELF listed")
    loader.write_bytes(b"\x7fELF loader")
    # the folder stands for the program folders: its ls is the listed one
    listed, _ = importlib.import_module("execrules").allowlisted(
        {"ls", "true"}, "", os.path.realpath, (str(tmp_path),)
    )
    judge = execjudge.ExecJudge(None, commands, {}, listed=listed)
    link = tmp_path / "l"
    link.symlink_to(loader)
    raced = os.stat(ls)  # what the first look saw, before the link moved on
    assert judge.judge(os.getpid(), str(link), ["ls", "/"], raced)[0] == "deny"
    assert judge.judge(os.getpid(), str(ls), ["ls", "/"]) == ("allow", None)


@pytest.mark.parametrize(
    ("names", "argv0", "runs_as"),
    [
        (["git", "git-init", "git-status"], "/usr/lib/git-core/git", ["git"]),  # git init x
        (["git", "git-init", "git-status"], "/usr/lib/git-core/git-init", ["git-init"]),
        (["git", "git-init", "git-status"], "git-status", ["git-status"]),
        (["git", "git-init", "git-status"], "anything", ["git"]),  # no name of its: git's own
        (["git"], "git-init", ["git-init"]),  # /usr/bin/git given argv[0] git-init runs git init
        (["git-remote-http", "git-remote-https"], "x", ["git-remote-http", "git-remote-https"]),
        (["python3"], "python3.11", ["python3"]),
        (["ls", "cat"], "cat", ["cat"]),  # busybox's applets
    ],
)
def test_a_listed_file_runs_as_the_name_its_argv0_gives_it(
    names: list[str], argv0: str, runs_as: list[str]
) -> None:
    """A file listed by several names (git's in its exec-path: git-init, git-status) runs the
    command its argv[0] names, never the one another name of its file would."""
    assert execrules.run_as(names, argv0) == runs_as


GIT_CORE = "/usr/lib/git-core"
# An exec of git's files in every spelling the code can give it, under ALLOW (`git status`):
# the file, argv[0], and whether it runs as git status.
GIT_SPELLINGS = [
    (f"{GIT_CORE}/git", [f"{GIT_CORE}/git", "init", "r1"], False),
    (f"{GIT_CORE}/git-init", [f"{GIT_CORE}/git-init", "r2"], False),
    (f"{GIT_CORE}/git-status", ["git", "init", "r3"], False),  # git reads argv[0], not the path
    ("/usr/bin/git", ["git-init", "status"], False),  # git-init's argv[0]: git init status
    ("/usr/bin/git", ["git", "--version"], False),
    (f"{GIT_CORE}/git", ["git", "status", "--short"], True),
    (f"{GIT_CORE}/git-status", ["git-status", "--short"], True),
    ("/usr/bin/git", ["git-status", "--short"], True),
]


@pytest.mark.parametrize(("path", "argv", "runs"), GIT_SPELLINGS)
def test_the_sandboxs_exec_judge_judges_gits_files_as_the_command_git_runs(
    execjudge: Any, path: str, argv: list[str], runs: bool
) -> None:
    """/usr/lib/git-core/git is listed by every git-X name there, and was allowed as any
    of them: `git init r1` read as `git-status init r1` is `git status init r1`."""
    require(GIT_CORE, os.path.exists(f"{GIT_CORE}/git-status"), "the judge is read on git's files elsewhere")
    commands = {"deny": [], "approve": [], "allow": ALLOW}
    rulespy = importlib.import_module("rulespy")
    listed, _ = rulespy.allowlist(ALLOW)
    judge = execjudge.ExecJudge(None, commands, rulespy.program_sizes(commands), listed=listed)
    expected = ("allow", None) if runs else ("deny", "commands.allow")
    assert judge.judge(os.getpid(), path, argv) == expected
