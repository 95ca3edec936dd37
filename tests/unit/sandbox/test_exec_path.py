"""What an exec is judged as is what the kernel runs: the path (a ".." is the parent of where
the links before it lead, not of the name written before it: execjudge.exec_path), and for a
script its interpreter too, with the argv the kernel gives it (execrules.interpreted)."""

from __future__ import annotations

import errno
import importlib
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stockade.sandbox import _judge

SUPERVISOR = Path(_judge.SOURCE).parent


@pytest.fixture(scope="module")
def execjudge() -> Iterator[Any]:
    sys.path.insert(0, str(SUPERVISOR))  # the supervisor's modules import each other by name
    try:
        yield importlib.import_module("execjudge")
    finally:
        sys.path.remove(str(SUPERVISOR))


@pytest.fixture(scope="module")
def execrules(execjudge: Any) -> Any:
    return importlib.import_module("execrules")


def test_a_dot_dot_after_a_link_is_the_parent_of_its_target(execjudge: Any, tmp_path: Path) -> None:
    (tmp_path / "a/b/c").mkdir(parents=True)
    (tmp_path / "a/usr/bin").mkdir(parents=True)
    (tmp_path / "a/usr/bin/true").write_text("a copy the code wrote")
    (tmp_path / "l").symlink_to(tmp_path / "a/b/c")
    asked = f"{tmp_path}/l/../../usr/bin/true"
    assert os.path.normpath(asked) == f"{tmp_path.parent}/usr/bin/true"  # what the judge saw before
    judged = execjudge.exec_path(os.getpid(), asked)
    assert judged == f"{tmp_path}/a/usr/bin/true"
    assert os.path.samefile(judged, asked)  # the file the kernel opens


def test_the_last_name_stays_a_links_own(execjudge: Any, tmp_path: Path) -> None:
    # The rules judge a link by its name (a link named as a listed program is judged as what
    # it leads to by the file, and as itself by the name): only the folders are resolved.
    (tmp_path / "d").mkdir()
    (tmp_path / "d/cat").symlink_to("/bin/true")
    assert execjudge.exec_path(os.getpid(), f"{tmp_path}/d/../d/cat") == f"{tmp_path}/d/cat"


def test_a_path_without_dot_dot_is_judged_as_written(execjudge: Any) -> None:
    assert execjudge.exec_path(os.getpid(), "/usr/bin/true") == "/usr/bin/true"


def test_a_folder_only_the_caller_can_walk_is_refused(execjudge: Any, tmp_path: Path) -> None:
    (tmp_path / "cwd").symlink_to("/proc/self/cwd")
    with pytest.raises(OSError):
        execjudge.exec_path(os.getpid(), f"{tmp_path}/cwd/x/../true")


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
def test_a_script_is_judged_as_the_kernel_runs_its_interpreter(execrules: Any, head: bytes) -> None:
    interpreter, argv = execrules.interpreted(head, "/w/s", ["s", "a"])
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
def test_what_is_no_script_runs_no_interpreter(execrules: Any, head: bytes) -> None:
    assert execrules.interpreted(head[: execrules.SCRIPT_HEAD], "/w/s", ["s"]) is None


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
    execrules: Any, argv: str, runs: list[str] | None
) -> None:
    assert execrules.script_run(shlex.split(argv)) == runs


def test_each_program_judge_c_hands_over_as_an_interpreter_runs_scripts_in_script_run(execrules: Any) -> None:
    """judge.c sends an exec to Python as an interpreter's by the globs of INTERPRETERS (its T
    entries): each of them must be one that script_run reads a script file from."""
    for pattern in execrules.INTERPRETERS:
        name = pattern.replace("*", "3.11")
        assert execrules.script_run([name, "/w/s", "a"]) == ["/w/s", "a"], name


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
