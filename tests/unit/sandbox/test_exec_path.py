"""What an exec is judged as is what the kernel runs: the path (a ".." is the parent of where
the links before it lead, not of the name written before it: execpaths.exec_path), and for a
script its interpreter too, with the argv the kernel gives it (execruns.interpreted)."""

from __future__ import annotations

import errno
import importlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def execrules(execjudge: Any) -> Any:
    return importlib.import_module("execrules")


@pytest.fixture(scope="module")
def execruns(execjudge: Any) -> Any:
    return importlib.import_module("execruns")


@pytest.fixture(scope="module")
def execpaths(execjudge: Any) -> Any:
    return importlib.import_module("execpaths")


def test_a_dot_dot_after_a_link_is_the_parent_of_its_target(execpaths: Any, tmp_path: Path) -> None:
    (tmp_path / "a/b/c").mkdir(parents=True)
    (tmp_path / "a/usr/bin").mkdir(parents=True)
    (tmp_path / "a/usr/bin/true").write_text("a copy the code wrote")
    (tmp_path / "l").symlink_to(tmp_path / "a/b/c")
    asked = f"{tmp_path}/l/../../usr/bin/true"
    assert os.path.normpath(asked) == f"{tmp_path.parent}/usr/bin/true"  # what the judge saw before
    judged = execpaths.exec_path(os.getpid(), asked)
    assert judged == f"{tmp_path}/a/usr/bin/true"
    assert os.path.samefile(judged, asked)  # the file the kernel opens


def test_the_last_name_stays_a_links_own(execpaths: Any, tmp_path: Path) -> None:
    # The rules judge a link by its name (a link named as a listed program is judged as what
    # it leads to by the file, and as itself by the name): only the folders are resolved.
    (tmp_path / "d").mkdir()
    (tmp_path / "d/cat").symlink_to("/bin/true")
    assert execpaths.exec_path(os.getpid(), f"{tmp_path}/d/../d/cat") == f"{tmp_path}/d/cat"


def test_a_path_without_dot_dot_is_judged_as_written(execpaths: Any) -> None:
    assert execpaths.exec_path(os.getpid(), "/usr/bin/true") == "/usr/bin/true"


def test_a_folder_only_the_caller_can_walk_is_refused(execpaths: Any, tmp_path: Path) -> None:
    (tmp_path / "cwd").symlink_to("/proc/self/cwd")
    with pytest.raises(OSError):
        execpaths.exec_path(os.getpid(), f"{tmp_path}/cwd/x/../true")


# What fs/binfmt_script.c makes of a first line: the name up to a space, tab or NUL; the rest,
# trimmed of spaces and tabs at both ends, one argument (spaces and all); then the script's
# path as the exec named it, then the exec's argv without its argv[0].
SCRIPTS = {
    b"#!/bin/sh\necho hi\n": ["/bin/sh", "/w/s", "a"],
    b"#! /bin/rm  -r  \n": ["/bin/rm", "-r", "/w/s", "a"],
    b"#!\t/bin/rm\t-r -f\n": ["/bin/rm", "-r -f", "/w/s", "a"],
    b"#!/usr/bin/env -S rm -r\n": ["/usr/bin/env", "-S rm -r", "/w/s", "a"],
    b"#!/bin/rm\0 -r\n": ["/bin/rm", "/w/s", "a"],  # a NUL ends the name, and the line
    b"#!/bin/rm -r\0 -f\n": ["/bin/rm", "-r", "/w/s", "a"],
    b"#!rm -r\n": ["rm", "-r", "/w/s", "a"],  # relative: from the caller's working folder
    b"#!/bin/rm -r": ["/bin/rm", "-r", "/w/s", "a"],  # no end of line, the name ended
}


@pytest.mark.parametrize("head", list(SCRIPTS))
def test_a_script_is_judged_as_the_kernel_runs_its_interpreter(execruns: Any, head: bytes) -> None:
    interpreter, argv = execruns.interpreted(head, "/w/s", ["s", "a"])
    assert (interpreter, argv) == (SCRIPTS[head][0], SCRIPTS[head])


@pytest.mark.parametrize(
    "head",
    [
        b"\x7fELF\x02\x01\x01",  # a program
        b"#!\n",  # no interpreter: the kernel refuses it (ENOEXEC)
        b"#!   \t \n",
        b"#!/" + b"x" * 300,  # a name past the kernel's 256 bytes, cut: refused
        b"",
    ],
)
def test_what_is_no_script_runs_no_interpreter(execruns: Any, head: bytes) -> None:
    assert execruns.interpreted(head[: execruns.SCRIPT_HEAD], "/w/s", ["s"]) is None


@pytest.mark.parametrize(
    ("argv", "runs"),
    [
        ("python3 /usr/bin/pip install x", ["/usr/bin/pip", "install", "x"]),
        ("python3.11 -u -W ignore /usr/bin/pip install", ["/usr/bin/pip", "install"]),
        ("python3 -Wdefault::DeprecationWarning pip.py -c", ["pip.py", "-c"]),  # the value holds a c
        ("python3 -X dev -- s.py", ["s.py"]),
        ("bash /usr/bin/ldd --version", ["/usr/bin/ldd", "--version"]),
        ("sh -e -o posix s a", ["s", "a"]),
        ("bash --rcfile f +x s", ["s"]),
        ("bash -O extglob s a", ["s", "a"]),  # -O takes a value, as -o does
        ("bash +O extglob s", ["s"]),
        # no script file: code on the command line, a module, standard input
        ("python3 -c pass /usr/bin/pip", None),
        ("python3 -Bc pass", None),
        ("python3 -m pip install x", None),
        ("python3 - install", None),
        ("sh -c 'rm -r x' s", None),
        ("bash -s a", None),
        ("rm -r x", None),
    ],
)
def test_an_interpreter_given_a_script_runs_the_script(
    execruns: Any, argv: str, runs: list[str] | None
) -> None:
    assert execruns.script_run(shlex.split(argv)) == runs


def test_each_program_judge_c_hands_over_as_an_interpreter_runs_scripts_in_scripts(execruns: Any) -> None:
    """judge.c sends an exec to Python as an interpreter's by the globs of INTERPRETERS (its T
    entries): each of them must be one that scripts reads a script file from."""
    for pattern in execruns.INTERPRETERS:
        name = pattern.replace("*", "3.11")
        assert execruns.scripts([name, "/w/s", "a"]) == [["/w/s", "a"]], name


@given(
    interpreter=st.sampled_from(
        ["node", "perl", "perl5.36", "ruby3.1", "php8.2", "tclsh8.6", "lua5.4", "Rscript"]
    ),
    options=st.lists(
        st.tuples(
            st.from_regex(r"-{1,2}[a-zA-Z][a-zA-Z-]{0,8}(=[a-z]{1,4})?", fullmatch=True), st.booleans()
        ),
        max_size=6,
    ),
    args=st.lists(st.sampled_from(["install", "-r", "--force", "x", "-", "--"]), max_size=4),
)
def test_any_word_an_unread_interpreter_may_run_as_its_script_is_judged_as_one(
    execruns: Any, interpreter: str, options: list[tuple[str, bool]], args: list[str]
) -> None:
    """node, perl, ruby: their options are not read here, and some take the next word as a
    value (node -r MODULE, perl -I DIR). Whichever do, the script is among the words judged
    as a script: ``node /usr/bin/npm install`` ran npm past a rule on `npm install`."""
    argv = [interpreter]
    for option, valued in options:
        argv += [option, "value"] if valued else [option]
    for script in ([*argv, "/usr/bin/npm", *args], [*argv, "--", "/usr/bin/npm", *args]):
        assert ["/usr/bin/npm", *args] in execruns.scripts(script), script
    assert ["npm", *args] in execruns.runs([*argv, "/usr/bin/npm", *args])


def test_what_an_interpreter_may_run_is_read_to_a_bound_never_in_copies_of_the_whole_argv(
    execruns: Any,
) -> None:
    """Each word that may be the script was a copy of the argv's rest: 50 KB of `node -r x -r
    x ...` made N copies of N words (65 s and 2.3 GB of the host's policy check; the sandbox's
    judge ran out of memory: found from outside). Past MAX_SCRIPTS words the command is not
    read (refused), and a Python script's path gives at most MAX_SCRIPTS folders."""
    bound = execruns.MAX_SCRIPTS
    assert len(execruns.scripts(["node", *["-r", "x"] * (bound - 1), "/usr/bin/npm", "i"])) == bound
    with pytest.raises(execruns.TooMany):
        execruns.scripts(["node", *["-r", "x"] * bound, "/usr/bin/npm", "i"])
    with pytest.raises(execruns.TooMany):
        execruns.runs(["perl", *["-I", "x"] * 10_000])
    deep = "/".join(f"d{i}" for i in range(5_000)) + "/pip/__main__.py"
    found = execruns.runs(["python3", deep, *["a"] * 5_000])
    assert len(found) <= bound + 2 and ["pip", *["a"] * 5_000] in found


# Every spelling of `python -m pip` and of running pip's files, read as CPython reads its
# command line: pip, with the rest of the argv.
PIP_SPELLINGS = [
    "python3 -m pip install x",
    "python3 -mpip install x",
    "python3 -Im pip install x",
    "python3 -Impip install x",
    "python3 -Wignore -mpip install x",
    "python3 -W ignore -m pip install x",
    "python3 -X dev -m pip install x",
    "python3 -Xdev -Bu -mpip install x",
    "python3 --check-hash-based-pycs never -m pip install x",
    "python3.11 -mpip install x",
    "/usr/bin/python3 -m pip.__main__ install x",
    "python3 -m pip._internal install x",
    "python3 /usr/lib/python3/dist-packages/pip/__main__.py install x",
    "python3 -I /usr/lib/python3/dist-packages/pip install x",
    "python3 /usr/lib/python3/dist-packages/pip/ install x",
    "python3 -- /usr/lib/python3/dist-packages/pip/__pip-runner__.py install x",
    "python3 pip/__main__.py install x",
    "python3 /tmp/pip.pyz install x",
]


@pytest.mark.parametrize("line", PIP_SPELLINGS)
def test_every_spelling_of_running_pip_through_python_runs_pip(execruns: Any, line: str) -> None:
    assert ["pip", "install", "x"] in [
        [execruns.program(command[0]), *command[1:]] for command in execruns.runs(shlex.split(line))
    ]


@pytest.mark.parametrize(
    ("line", "reads"),
    [
        ("python3 -Impip install x", ("-m", ["pip", "install", "x"])),
        ("python3 -Wm -m pip", ("-m", ["pip"])),  # -W's value is "m": the next word is the option
        ("python3 -Xm pip", ("script", ["pip"])),
        ("python3 -c import -m pip", None),  # -c's value, then its argv
        ("python3 -Bcm pip", None),  # -c with the value "m"
        ("python3 -- -m pip", ("script", ["-m", "pip"])),  # after --, a script named -m
        ("python3 --check-hash-based-pycs -m pip", ("script", ["pip"])),  # the long option's value
        ("python3 - -m pip", None),  # standard input, its argv after
        ("python3 -m", None),  # no module: an error
        ("pip -m pip", None),  # not an interpreter
    ],
)
def test_an_interpreters_command_line_is_read_as_the_interpreter_reads_it(
    execruns: Any, line: str, reads: tuple[str, list[str]] | None
) -> None:
    assert execruns.command_line(shlex.split(line)) == reads


def test_a_module_is_its_top_level_package_and_a_script_each_folder_on_its_path(execruns: Any) -> None:
    assert execruns.subject(["python3", "-m", "pip.__main__", "x"]) == ["pip", "x"]
    assert execruns.runs(["python3", "/opt/tool/pip/run.py", "x"]) == [
        ["/opt/tool/pip/run.py", "x"], ["run", "x"], ["opt", "x"], ["tool", "x"], ["pip", "x"],
    ]  # fmt: skip
    assert execruns.runs(["bash", "/opt/pip/s", "x"]) == [["/opt/pip/s", "x"]]  # a shell's script is itself
    assert execruns.runs(["python3", "-c", "pass"]) == []


# What CPython itself does with a command line drawn from its options: each word one of these.
CPYTHON_WORDS = [
    "-B", "-u", "-O", "-S", "-s", "-b", "-E", "-q", "-d", "-R", "-x",
    "-Bu", "-OO", "-W", "-Wignore", "-Werror", "-X", "-Xdev", "-Xutf8", "ignore", "dev",
    "-m", "-mzzpkg", "-Bmzzpkg", "-Wm", "-Xm", "zzpkg", "zzpkg.zzmod", "-c", "-Bc", "pass",
    "--check-hash-based-pycs", "always", "--", "-", "zz.py", "zzpkg/__main__.py", "a", "-a",
]  # fmt: skip
PRINTS_WHAT_RAN = (  # the module (no .__main__) or the script (a folder: __main__), and its argv
    "import json, sys\n"
    "module = __spec__.name.removesuffix('.__main__') if __spec__ else '__main__'\n"
    "ran = ['-m', module] if module != '__main__' else ['script', sys.argv[0]]\n"
    "print('RAN', json.dumps([*ran, sys.argv[1:]]))\n"
)


@pytest.fixture(scope="module")
def cpython_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cpython")
    (folder / "zzpkg").mkdir()
    for file in ("zz.py", "zzpkg/__init__.py", "zzpkg/__main__.py", "zzpkg/zzmod.py"):
        (folder / file).write_text(PRINTS_WHAT_RAN if file != "zzpkg/__init__.py" else "")
    return folder


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(words=st.lists(st.sampled_from(CPYTHON_WORDS), max_size=6))
def test_the_reading_of_pythons_command_line_is_cpythons(
    execruns: Any, cpython_folder: Path, words: list[str]
) -> None:
    """The parser and CPython agree on every command line drawn: the module or script that
    runs, and the argv it gets (or that none runs: -c, standard input, an error)."""
    argv = [sys.executable, *words]
    done = subprocess.run(
        argv, check=False, cwd=cpython_folder, stdin=subprocess.DEVNULL, capture_output=True, text=True
    )
    ran = next((line for line in done.stdout.splitlines() if line.startswith("RAN ")), None)
    reads = execruns.command_line(argv)
    if ran is None:  # nothing ran: code given as text, standard input, or no such file or module
        assume("usage:" not in done.stderr)  # a usage error (-W with no value, -a): python ran nothing
        if reads is not None:
            missing = "No module named" if reads[0] == "-m" else "can't open file"
            assert missing in done.stderr and reads[1][0] in done.stderr, (words, done.stderr)
        return
    kind, target, rest = json.loads(ran[4:])
    assert reads == (kind, [target, *rest]), (words, ran)


class CallerMemory:
    """A file laid out as a caller's memory: an argv's pointer array at 8, its words after."""

    def __init__(self, folder: Path, words: list[bytes], *, same_word: bool = False) -> None:
        table = 8 + 8 * (len(words) + 1)
        pointers: list[int] = []
        text, at = b"", table
        for word in words:
            if same_word and pointers:  # every pointer to the first word: little memory, long argv
                pointers.append(pointers[0])
                continue
            pointers.append(at)
            text += word + b"\0"
            at += len(word) + 1
        path = folder / "memory"
        path.write_bytes(bytes(8) + b"".join(p.to_bytes(8, "little") for p in [*pointers, 0]) + text)
        self.fd = os.open(path, os.O_RDONLY)

    def argv(self, confine: Any) -> list[str]:
        try:
            return list(confine.read_argv(self.fd, confine.NR_EXECVE, (0, 8, 0, 0, 0, 0)))
        finally:
            os.close(self.fd)


@pytest.fixture(scope="module")
def confine(execjudge: Any) -> Any:
    return importlib.import_module("confine")


def test_every_word_of_a_long_argv_is_read(confine: Any, tmp_path: Path) -> None:
    # `rm -f <5,000 words> -r x`: the judge read 4,096 words, and the -r went unjudged
    words = [b"rm", b"-f", *(b"nx%d" % i for i in range(5000)), b"-r", b"x"]
    assert CallerMemory(tmp_path, words).argv(confine)[-2:] == ["-r", "x"]


def test_an_argv_past_what_the_kernel_takes_is_refused_unread(confine: Any, tmp_path: Path) -> None:
    # more words than an exec can take, or words past its bytes (one 128 KiB word, pointed
    # to again and again: the judge would hold gigabytes): E2BIG, as the kernel says it
    too_many = CallerMemory(tmp_path, [b"x"] * (confine.MAX_ARGS + 1), same_word=True)
    with pytest.raises(OSError) as caught:
        too_many.argv(confine)
    assert caught.value.errno == errno.E2BIG
    (tmp_path / "memory").unlink()
    big = b"a" * (128 * 1024 - 1)
    too_long = CallerMemory(tmp_path, [big] * (confine.MAX_ARGV_BYTES // len(big) + 2), same_word=True)
    with pytest.raises(OSError) as caught:
        too_long.argv(confine)
    assert caught.value.errno == errno.E2BIG


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    before=st.lists(st.text("ab/.", min_size=1, max_size=5000), max_size=300),
    after=st.lists(st.text("cd", min_size=1, max_size=5000), min_size=1, max_size=20),
)
def test_a_cut_argv_shows_the_flag_its_rule_matched_and_its_tail(
    execjudge: Any, execrules: Any, before: list[str], after: list[str]
) -> None:
    """`rm -f <62 files> -r /workspace/src` was shown as its first 63 words, and 60 words of
    4,000 characters before a `-r` left it no room (cut to nothing): what a record and an
    approval show of any argv holds the words the rule matched it by, and its last word, whole."""
    argv = ["rm", *before, "-r", *after, "/workspace/src"]
    shown = execjudge.shown_argv(argv, execrules.judged_words(["rm", "-r"], argv))
    assert len(shown) <= 64 and shown[0] == "rm" and "-r" in shown and shown[-1] == "/workspace/src"
    assert sum(len(word.split("[... ")[0]) for word in shown) <= 32 << 10
    if len(argv) > 64:  # what is left out is counted, and the whole argv named by its digest
        marks = [word for word in shown if word.startswith("[... ") and "words not shown" in word]
        assert marks and all(
            execjudge.shown_argv([*argv[:-1], "x"], ["-r"]).count(mark) == 0 for mark in marks
        )
