"""The exec judge's compiled fast path (supervisor/judge.c) never lets run what the Python
judge (supervisor/execjudge.py) would not: held against it on random rules and execs.

judge.c's decision is ``stockade_fast_allows`` over the names an exec goes by (its path's
name, the name of the file it leads to, argv[0]) and the file's size; the exec is then the
Python judge's own, on a real file reached by a real path (a symlink when the two names
differ), with the same rules.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stockade.sandbox import _judge
from tests.conftest import require

SUPERVISOR = Path(_judge.SOURCE).parent

LOADER = "/lib64/ld-linux-x86-64.so.2"
NAMES = ["rm", "ls", "git", "python3", "sh", "true", "cp", "pip", "cat", "x", "ré"]
NAMES += ["busybox", "ld-linux-x86-64.so.2"]  # what carries another program (execruns.carried)
NAMES += ["pip3", "git-push", "rm2"]  # a rule's program by another name (execrules.rule_names)
GLOBS = ["r*", "*", "?s", "g?t", "[rl]s", "py*", "*t", "c?"]
WORDS = ["-r", "-f", "-R", "--force", "push", "install", "-m", "pip", "x", "--"]
CONTENTS = ["small", "/usr/bin/rm", "/usr/bin/ls", "/usr/bin/true", "/usr/bin/git"]


@pytest.fixture(scope="module")
def judges() -> Iterator[tuple[Any, Any]]:
    built = _judge.build()
    require(
        "the compiled exec judge (a C compiler, x86_64)", built is not None, "every exec is judged in Python"
    )
    assert built is not None
    lib = ctypes.CDLL(str(built))
    fast = lib.stockade_fast_allows
    fast.argtypes = [
        ctypes.c_char_p,
        ctypes.c_int,
        *[ctypes.c_char_p] * 4,
        ctypes.c_int,
        *[ctypes.c_uint64] * 3,
    ]
    fast.restype = ctypes.c_int
    sys.path.insert(0, str(SUPERVISOR))  # the supervisor's modules import each other by name
    try:
        yield fast, (importlib.import_module("fastjudge"), importlib.import_module("execjudge"))
    finally:
        sys.path.remove(str(SUPERVISOR))


def _decide(judges: tuple[Any, Any], workdir: Path, case: dict[str, Any]) -> tuple[int, tuple[str, Any]]:
    fast, (fastjudge, execjudge) = judges
    commands = case["rules"]
    sizes = importlib.import_module("rulespy").program_sizes(commands)
    folder = workdir / "bin"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    real = folder / case["file"]
    content = case["content"]
    if content == "small":
        real.write_bytes(b"\x7fELF, small\n")  # a script never reaches the fast path (judge.c's script)
    else:
        shutil.copyfile(content, real)
    path = folder / case["path"] if case["path"] != case["file"] else real
    if path != real:
        path.symlink_to(real.name)
    argv: list[str] = case["argv"]
    enc = [w.encode("utf-8", "surrogateescape") for w in argv]
    # the folder stands for the program folders: its files are the allowlist's programs
    execrules = importlib.import_module("execrules")
    programs = {execrules.pattern(words)[0] for words in commands["allow"] if words}
    listed, _ = execrules.allowlisted(programs, "", os.path.realpath, (str(folder),))
    judge = execjudge.ExecJudge(None, commands, sizes, listed=listed)
    config = fastjudge.judge_config(commands, (), listed)
    st = real.stat()
    said = fast(
        config, len(config), path.name.encode(), real.name.encode(),
        enc[0] if enc else b"", enc[1] if len(enc) > 1 else b"", len(argv), st.st_size, st.st_dev, st.st_ino,
    )  # fmt: skip
    verdict = judge.judge(os.getpid(), str(path), argv)
    return int(said), verdict


patterns = st.builds(
    lambda program, words: " ".join([program, *words]).split(),
    st.sampled_from(NAMES + GLOBS),
    st.lists(st.sampled_from([w for w in WORDS if w != "--"]), max_size=2),
)
cases = st.fixed_dictionaries(
    {
        "rules": st.fixed_dictionaries(
            {
                "deny": st.lists(patterns, max_size=4),
                "approve": st.lists(patterns, max_size=3),
                "allow": st.one_of(st.just([]), st.lists(patterns, min_size=1, max_size=4)),
            }
        ),
        "path": st.sampled_from(NAMES),
        "file": st.sampled_from(NAMES),
        "content": st.sampled_from(CONTENTS),
        "argv": st.one_of(
            st.just([]),
            st.builds(
                lambda first, rest: [first, *rest],
                st.sampled_from([*NAMES, "/usr/bin/rm", "./x", "python3.11", "", LOADER]),
                st.lists(st.sampled_from(WORDS), max_size=4),
            ),
        ),
    }
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases)
def test_the_fast_path_allows_only_what_the_python_judge_allows(
    judges: tuple[Any, Any], tmp_path: Path, case: dict[str, Any]
) -> None:
    said, verdict = _decide(judges, tmp_path, case)
    if said:
        assert verdict == ("allow", None), case


@pytest.mark.parametrize(
    ("rules", "path", "argv", "fast"),
    [
        # the common case: a program no rule names, whatever its arguments
        ({"deny": [["rm", "-r"]], "approve": [["git", "push"]]}, "ls", ["ls", "-r"], True),
        ({"deny": [["curl"]]}, "cat", ["cat", "x"], True),
        # a program a rule names goes to Python, whatever its arguments
        ({"deny": [["rm", "-r"]]}, "rm", ["rm", "x"], False),
        # argv[0] is a name too (busybox), and python -m runs the module
        ({"deny": [["rm", "-r"]]}, "ls", ["rm", "x"], False),
        ({"approve": [["pip", "install"]]}, "python3", ["python3", "-m", "pip", "install"], False),
        # globs, and the brackets left to Python
        ({"deny": [["r*"]]}, "ls", ["ls"], True),
        ({"deny": [["?s"]]}, "ls", ["ls"], False),
        ({"deny": [["[rl]s"]]}, "cat", ["cat"], False),
        # an allowlist: only what it names alone, by what the file is
        ({"allow": [["ls"]]}, "ls", ["anything"], True),
        ({"allow": [["git", "status"]]}, "git", ["git", "status"], False),
        ({"allow": [["ls"]]}, "cat", ["ls"], False),
        # a rule's program under a version or as a dashed git command goes to Python
        ({"approve": [["pip", "install"]]}, "pip3", ["pip3", "install", "x"], False),
        ({"approve": [["pip", "install"]]}, "ls", ["pip3.11", "install", "x"], False),
        ({"approve": [["git", "push"]]}, "git-push", ["git-push", "origin"], False),
        # ... and so under a glob that names the program (g?t is git, p?p pip)
        ({"approve": [["g?t", "push"]]}, "ls", ["git-push", "origin"], False),
        ({"approve": [["p*p", "install"]]}, "pip3.11", ["pip3.11", "install", "x"], False),
        # a rule written as a dashed git command is git's: git-push is git push
        ({"deny": [["git-push"]]}, "git", ["git", "push"], False),
        ({"allow": [["git-push"]]}, "git-push", ["git-push"], False),
        ({"approve": [["rm", "-r"]]}, "rmdir", ["rmdir", "x"], True),
    ],
)
def test_what_the_fast_path_answers_itself(
    judges: tuple[Any, Any], tmp_path: Path, rules: dict[str, Any], path: str, argv: list[str], fast: bool
) -> None:
    full = {"deny": [], "approve": [], "allow": [], **rules}
    case = {"rules": full, "path": path, "file": path, "content": "small", "argv": argv}
    said, verdict = _decide(judges, tmp_path, case)
    assert bool(said) is fast
    if fast:
        assert verdict == ("allow", None)


def test_under_an_allowlist_a_link_to_the_loader_by_an_allowed_name_is_left_to_python(
    judges: tuple[Any, Any], tmp_path: Path
) -> None:
    # the loader is executable under an allowlist (to run what is on it) and runs whatever it
    # loads: a link named as an allowed program that leads to it is judged as what it loads
    rules = {"deny": [], "approve": [], "allow": [["rm"]]}
    case = {
        "rules": rules,
        "path": "rm",
        "file": "ld-linux-x86-64.so.2",
        "content": "small",
        "argv": ["rm", "x"],
    }
    said, verdict = _decide(judges, tmp_path, case)
    assert not said
    assert verdict == ("deny", "commands.allow")


def test_under_an_allowlist_a_file_is_allowed_by_what_it_is_not_by_its_name(
    judges: tuple[Any, Any], tmp_path: Path
) -> None:
    """A link the code made, named as a listed program (pip3), to an unlisted file (python3,
    which Landlock lets run for pip3's script) is refused by both judges; a listed file runs
    by any name (a venv's python), answered by judge.c."""
    fast, (fastjudge, execjudge) = judges
    programs, elsewhere = tmp_path / "bin", tmp_path / "tmp"
    programs.mkdir()
    elsewhere.mkdir()
    (programs / "python3").write_bytes(b"\x7fELF, python3\n")
    (programs / "pip3").write_bytes(b"\x7fELF, pip3\n")
    commands = {"deny": [], "approve": [], "allow": [["pip3"]]}
    execrules = importlib.import_module("execrules")
    listed, _ = execrules.allowlisted({"pip3"}, "", os.path.realpath, (str(programs),))
    judge = execjudge.ExecJudge(None, commands, {}, listed=listed)
    config = fastjudge.judge_config(commands, (), listed)
    for target, verdict in (
        (programs / "python3", ("deny", "commands.allow")),
        (programs / "pip3", ("allow", None)),
    ):
        link = elsewhere / ("pip3" if target.name == "python3" else "python")
        link.symlink_to(target)
        st = target.stat()
        names = (link.name.encode(), target.name.encode(), link.name.encode())
        said = fast(config, len(config), *names, b"-c", 2, st.st_size, st.st_dev, st.st_ino)
        assert (bool(said), judge.judge(os.getpid(), str(link), [link.name, "-c"])) == (
            verdict[0] == "allow",
            verdict,
        )


def test_a_copy_of_a_rule_program_is_left_to_python_by_its_size(
    judges: tuple[Any, Any], tmp_path: Path
) -> None:
    """judge.c finds the rule programs' sizes itself (find_sizes, in its thread): a copy of
    rm under another name has rm's size, so it is not answered there; the Python judge
    knows it for rm by its content."""
    require("/usr/bin/rm", Path("/usr/bin/rm").is_file())
    rules = {"deny": [], "approve": [["rm", "-r"]], "allow": []}
    case = {"rules": rules, "path": "x", "file": "x", "content": "/usr/bin/rm", "argv": ["x", "-r", "d"]}
    said, verdict = _decide(judges, tmp_path, case)
    assert not said
    assert verdict == ("approve", "commands.approve: rm -r")
    other = {**case, "content": "small"}  # the same name, another file: answered at once
    assert _decide(judges, tmp_path, other) == (1, ("allow", None))


CARRIERS = {
    # what the loader runs: judged as itself, by its path (here on the host's file)
    "the loader": ("ld-linux-x86-64.so.2", "small", ["ld-linux-x86-64.so.2", "/usr/bin/rm", "-r", "d"]),
    "the loader, its options": (
        "ld-linux-x86-64.so.2",
        "small",
        ["ld", "--argv0", "ls", "--inhibit-cache", "/usr/bin/rm", "-r", "d"],
    ),
    # a copy of it under another name, known by its size, then its content
    "a copy of the loader": ("x", LOADER, ["x", "/usr/bin/rm", "-r", "d"]),
    # a multi-call binary, by the name it was given
    "busybox": ("busybox", "small", ["busybox", "rm", "-r", "d"]),
}


@pytest.mark.parametrize("route", list(CARRIERS))
def test_what_carries_another_program_is_judged_as_that_program(
    judges: tuple[Any, Any], tmp_path: Path, route: str
) -> None:
    """Under any command rules, an exec of the loader or of a multi-call binary is left to Python,
    which judges what it runs too: `ld.so /bin/rm -r d` needs rm -r's approval."""
    require("/usr/bin/rm and the loader", Path("/usr/bin/rm").is_file() and Path(LOADER).is_file())
    name, content, argv = CARRIERS[route]
    rules = {"deny": [], "approve": [["rm", "-r"]], "allow": []}
    case = {"rules": rules, "path": name, "file": name, "content": content, "argv": argv}
    said, verdict = _decide(judges, tmp_path, case)
    assert not said
    assert verdict == ("approve", "commands.approve: rm -r")
    harmless = {**case, "argv": [*argv[:-3], "/usr/bin/ls", "-r", "d"]}
    assert _decide(judges, tmp_path, harmless) == (0, ("allow", None))
    # with no rule over argv (programs denied whatever their arguments are masked: nothing
    # denied to load), the loader and busybox by name still go to Python, which allows them
    masked_only = {**case, "rules": {"deny": [["curl"]], "approve": [], "allow": []}}
    assert _decide(judges, tmp_path, masked_only) == (int(route == "a copy of the loader"), ("allow", None))


@pytest.mark.parametrize("change", ["padded", "patched"])
def test_a_copy_changed_by_a_byte_is_the_program_it_was_built_as(
    judges: tuple[Any, Any], tmp_path: Path, change: str
) -> None:
    """Out of the image's folders, a file with a rule program's ELF build ID is that program,
    whatever bytes were added or changed elsewhere: the size and sha256 of a copy are not."""
    require("/usr/bin/rm", Path("/usr/bin/rm").is_file())
    _, (_, execjudge) = judges
    commands = {"deny": [], "approve": [["rm", "-r"]], "allow": []}
    sizes = importlib.import_module("rulespy").program_sizes(commands)
    body = bytearray(Path("/usr/bin/rm").read_bytes())
    if change == "padded":
        body += b"\n"
    else:
        body[-1] ^= 1
    copy = tmp_path / "x"
    copy.write_bytes(bytes(body))
    judge = execjudge.ExecJudge(None, commands, sizes)
    assert judge.judge(os.getpid(), str(copy), ["x", "-r", "d"]) == ("approve", "commands.approve: rm -r")
    execrules = importlib.import_module("execrules")
    assert execrules.build_id(str(copy)) == execrules.build_id("/usr/bin/rm") is not None
    assert execrules.build_id("/etc/hostname") is None


CONFINE_PROBE = r"""
import json, os, shutil, sys, tempfile
sys.path.insert(0, sys.argv[1])
import rules

ws = sys.argv[2]


class Sup:
    class workspace:
        root = ws


r = rules.Rules(Sup(), {"write": [ws + "/src/"], "judge": sys.argv[3]})


def shim():
    # a shim's life: confined, then what the code can write
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        got = {}
        try:
            r.confine()
            # /tmp is always writable to code: "outside" is a temp folder that is not
            outside = "/var/tmp/stockade-probe-%d" % os.getpid()
            for name, path in (("src/new", os.path.join(ws, "src/new")), ("outside", outside)):
                try:
                    with open(path, "w"):
                        got[name] = True
                    if name == "outside":
                        os.unlink(path)
                except OSError:
                    got[name] = False
        except OSError as exc:
            got["error"] = str(exc)
        os.write(wr, json.dumps(got).encode())
        os._exit(0)
    os.close(wr)
    data = os.read(rd, 4096)
    os.waitpid(pid, 0)
    return json.loads(data)


first = shim()
os.rename(ws + "/src", ws + "/old")  # the written folder replaced: the ruleset holds the old one
os.mkdir(ws + "/src")
second = shim()
# Replaced by a link to a folder outside /tmp (all of which code may write): src/new is there.
os.rename(ws + "/src", ws + "/older")
elsewhere = tempfile.mkdtemp(dir="/var/tmp")
try:
    os.symlink(elsewhere, ws + "/src")
    third = shim()
    # The link there before the rules are set up (judge.c builds that ruleset): no rule either.
    r = rules.Rules(Sup(), {"write": [ws + "/src/"], "judge": sys.argv[3]})
    shims = [first, second, third, shim()]
finally:
    shutil.rmtree(elsewhere)
print(json.dumps({"compiled": r._confine_c is not None, "landlock": r.landlock, "shims": shims}))
"""


def _supervisor_with_compiled_judge(tmp_path: Path) -> Path:
    """A copy of the supervisor's folder with the compiled exec judge built into it."""
    built = _judge.build()
    require("the compiled exec judge", built is not None, "no C compiler, or not x86_64")
    assert built is not None
    folder = tmp_path / "supervisor"
    folder.mkdir()
    for module in SUPERVISOR.glob("*.py"):
        shutil.copy(module, folder / module.name)
    shutil.copy(built, folder / _judge.LIBRARY)
    return folder


@pytest.mark.parametrize("judge", ["compiled", "python"])
def test_a_shim_is_confined_alike_by_the_compiled_and_the_python_path(tmp_path: Path, judge: str) -> None:
    """stockade_confine (judge.c) makes the shim dumpable and puts it under the Landlock
    ruleset, and leaves it to Python when a written folder was replaced since the ruleset was
    built (a rule holds the folder's inode): the code can write the new folder, never
    outside it; nor through a link put in its place (the rebuilt ruleset followed it: a seeded
    `src -> .` made the whole workspace writable)."""
    import json
    import subprocess

    folder = _supervisor_with_compiled_judge(tmp_path)
    workspace = tmp_path / "ws"
    (workspace / "src").mkdir(parents=True)
    done = subprocess.run(
        [sys.executable, "-c", CONFINE_PROBE, str(folder), str(workspace), judge],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    got = json.loads(done.stdout)
    require("Landlock", got["landlock"], "this kernel has none")
    assert got["compiled"] is (judge == "compiled")
    assert (
        got["shims"] == [{"src/new": True, "outside": False}] * 2 + [{"src/new": False, "outside": False}] * 2
    )


def test_a_cache_that_cannot_be_written_means_the_python_judge_not_an_error(tmp_path: Path) -> None:
    # A service account without a home (the unprivileged test's user): no library, no crash.
    (tmp_path / "file").write_text("")
    assert _judge.build(tmp_path / "file" / "judge") is None


SUBREAPER_PROBE = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import rules
from libc import libc

class Sup:
    class workspace:
        root = sys.argv[2]

r = rules.Rules(Sup(), {"write": [sys.argv[2] + "/src/"], "commands": {"deny": [["ls", "-R"]]}})


def shim(subreaper):
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        done = r.confine(subreaper)
        got = bytearray(4)
        import _ctypes
        class c_int(_ctypes._SimpleCData):
            _type_ = "i"
        box = c_int.from_buffer(got)
        libc("prctl", 37, _ctypes.addressof(box), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
        os.write(wr, json.dumps([done, box.value, libc("prctl", 3, 0, 0, 0, 0)]).encode())
        os._exit(0)
    os.close(wr)
    data = os.read(rd, 4096)
    os.waitpid(pid, 0)
    return json.loads(data)


print(json.dumps({"compiled": r._confine_c is not None, "shims": [shim(True), shim(False)]}))
"""


def test_the_compiled_confinement_makes_a_shim_a_subreaper_in_the_same_call(tmp_path: Path) -> None:
    """A shim asks stockade_confine to make it a child subreaper too (one call into C in the
    fork instead of two); an interpreter (no shim) does not ask, and is confined all the
    same: dumpable, so that the judge can read its children's execs."""
    import json
    import subprocess

    folder = _supervisor_with_compiled_judge(tmp_path)
    (tmp_path / "ws" / "src").mkdir(parents=True)
    done = subprocess.run(
        [sys.executable, "-c", SUBREAPER_PROBE, str(folder), str(tmp_path / "ws")],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    got = json.loads(done.stdout)
    assert got["compiled"]
    # [done here, a child subreaper, dumpable]
    assert got["shims"] == [[True, 1, 1], [False, 0, 1]]


@pytest.mark.parametrize(("allow", "runs"), [(["*-status"], False), (["g?t"], True)])
def test_a_file_listed_by_another_programs_command_is_answered_by_judge_c_only_as_python_does(
    judges: tuple[Any, Any], tmp_path: Path, allow: list[str], runs: bool
) -> None:
    """git's file listed as git-status alone (a rule of one word whose glob names that) runs
    as the command its argv[0] gives it: `git-status x` is `git status x`, which a rule over
    git-status's name is not. judge.c let it run by the name it was listed by."""
    fast, (fastjudge, execjudge) = judges
    programs = tmp_path / "bin"
    programs.mkdir()
    (programs / "git").write_bytes(b"\x7fELF, git\n")
    (programs / "git-status").symlink_to("git")
    commands = {"deny": [], "approve": [], "allow": [allow]}
    execrules = importlib.import_module("execrules")
    listed, _ = execrules.allowlisted(set(allow), "", os.path.realpath, (str(programs),))
    judge = execjudge.ExecJudge(None, commands, {}, listed=listed)
    config = fastjudge.judge_config(commands, (), listed)
    st = (programs / "git").stat()
    for argv in (["git-status", "x"], ["git", "init"]):
        names = (b"git-status", b"git", argv[0].encode())
        said = fast(config, len(config), *names, b"x", 2, st.st_size, st.st_dev, st.st_ino)
        verdict = judge.judge(os.getpid(), str(programs / "git-status"), argv)
        assert (bool(said), verdict) == (runs, ("allow", None) if runs else ("deny", "commands.allow"))


THREAD_PROBE = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import rules
import proctree

class Sup:
    class workspace:
        root = sys.argv[2]

r = rules.Rules(Sup(), {"commands": {"deny": [["curl"]]}})
r.start()
pid = os.fork()  # a shim's start: its exec judged by the thread (our filter is on us now)
if pid == 0:
    os.setsid()
    r.confine(True)
    os.execv("/bin/true", ["true"])
children = proctree.own_children()
os.waitpid(pid, 0)
tid = r.fast.tid if r.fast is not None else 0
with open("/proc/self/task/%d/children" % tid) as fh:
    its = fh.read().split()
tasks = sorted(map(int, os.listdir("/proc/self/task")))
print(json.dumps({"notify": r.notify, "tid": tid, "me": os.getpid(), "tasks": tasks,
                  "children": sorted(children or ()), "pid": pid, "its": its}))
"""


def test_the_compiled_judges_thread_is_known_by_its_id_and_never_has_a_child(tmp_path: Path) -> None:
    """stockade_judge returns its thread's id: the look for strays after each command
    (``jobs.sweep_strays``) skips that thread's children file, a /proc file opened and read
    a command (9-15 us on this project's machine), since the thread forks nothing."""
    import json
    import subprocess

    folder = _supervisor_with_compiled_judge(tmp_path)
    (tmp_path / "ws").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", THREAD_PROBE, str(folder), str(tmp_path / "ws")],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    got = json.loads(done.stdout)
    require("seccomp user notification", got["notify"], "this kernel has none")
    assert got["tid"] != got["me"]
    assert got["tasks"] == sorted([got["me"], got["tid"]])
    assert got["children"] == [got["pid"]]  # the main thread's: the one child of the probe
    assert got["its"] == []


MOUNT_PROBE = r"""
import json, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
import rules

ws = sys.argv[2]
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", ws + "/mnt"], check=True)


class Sup:
    class workspace:
        root = ws


r = rules.Rules(Sup(), {"write": [ws + "/mnt/", ws + "/src/"], "judge": "compiled"})
# What no process of a sandbox can do: the mount taken away, the folder beneath in its place.
subprocess.run(["umount", ws + "/mnt"], check=True)


def shim():
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        got = {}
        done = r.confine()
        for name in ("mnt", "src"):
            try:
                with open(os.path.join(ws, name, "new"), "w"):
                    got[name] = True
            except OSError:
                got[name] = False
        os.write(wr, json.dumps(got).encode())
        os._exit(0)
    os.close(wr)
    data = os.read(rd, 4096)
    os.waitpid(pid, 0)
    return json.loads(data)


print(json.dumps({"compiled": r._confine_c is not None, "landlock": r.landlock, "shim": shim()}))
"""


def test_a_written_mounts_root_is_not_looked_at_again_before_each_command(tmp_path: Path) -> None:
    """judge.c checks before each command that no written folder was replaced since the
    ruleset was built (an lstat each), but not a mount's root (/tmp, /dev, /proc): it cannot
    be removed or renamed over while mounted, and nothing in a sandbox mounts. Three lstats
    fewer a command under write rules. Shown here by what a sandbox cannot do: the mount
    taken away under the rules leaves its rule on the mount's root, so the folder beneath is
    not writable (a failure that is closed), while a written plain folder is still checked."""
    import json
    import subprocess
    import tempfile

    require("unshare", shutil.which("unshare") is not None, "util-linux is not installed")
    folder = _supervisor_with_compiled_judge(tmp_path)
    # Not beneath /tmp, which code may always write.
    workspace = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        for name in ("mnt", "src"):
            (workspace / name).mkdir()
        done = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", MOUNT_PROBE,
             str(folder), str(workspace)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        shutil.rmtree(workspace)
    require("a user and mount namespace", done.returncode == 0, done.stderr[-300:])
    got = json.loads(done.stdout)
    require("Landlock", got["landlock"], "this kernel has none")
    assert got["compiled"]
    assert got["shim"] == {"mnt": False, "src": True}
