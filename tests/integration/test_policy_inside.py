"""The policy, enforced by the sandbox itself: what the rules deny cannot happen from any code,
in any language, by any route. Every tier; gVisor's kernel holds only the masks, and refuses
the rest unless the caller accepts less.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stockade import LimitNotEnforceable, Limits, PathEscapeError, Sandbox
from stockade.models import ToolCall
from stockade.policy.engine import PolicyEngine
from stockade.policy.schema import Policy
from stockade.sandbox.supervisor import execnpm
from stockade.tools.workspace_diff import record_baseline, workspace_diff
from stockade.types import EntryType, ExecRecord, Mechanism, SandboxRules
from tests.conftest import require, require_tier
from tests.integration.approvals import YesTo, remove_each
from tests.integration.conftest import TIERS

LIMITS = Limits(memory_mb=256, timeout_s=30, pids=64)
CONFINES = ("process", "docker", "microvm")  # a kernel with Landlock and seccomp user notification

# `uname` is in every image and says "Linux": a route that ran it shows it.
DENIED_ROUTES = {
    "sh": "uname",
    "absolute path": "/usr/bin/uname",
    "/bin": "/bin/uname",
    "env": "env uname",
    "xargs": "echo -a | xargs uname",
    "find -exec": "find /workspace -maxdepth 0 -exec uname \\;",
    "python subprocess": "python3 -c 'import subprocess; subprocess.run([\"uname\"])'",
    "python os.system": "python3 -c 'import os; os.system(\"uname\")'",
    "python execv": 'python3 -c \'import os; os.execv("/usr/bin/uname", ["x"])\'',
    "awk system": "awk 'BEGIN { system(\"uname\") }'",
    "perl exec": "perl -e 'exec \"/usr/bin/uname\"'",
    "symlink": "ln -sf /usr/bin/uname /tmp/u; /tmp/u",
    "copy": "cp /usr/bin/uname /tmp/c; chmod +x /tmp/c; /tmp/c",
    "cat copy": "cat /usr/bin/uname > /tmp/k; chmod +x /tmp/k; /tmp/k",
    "ld.so": "/lib64/ld-linux-x86-64.so.2 /usr/bin/uname",
    # another file of the image named so, outside the program folders (klibc's, where the
    # image has it; else any): masked too, so its copy is nothing that runs
    "a copy of another uname of the image": (
        "for u in $(find /usr /lib* -name uname -type f 2>/dev/null);"
        " do cat $u > /tmp/o; chmod +x /tmp/o; /tmp/o; done"
    ),
}


# One sandbox per tier and rule set serves all of its routes (a microVM boot is seconds): the
# tests are grouped by tier, and each route sets up the files it needs.
@pytest.fixture(scope="module", params=TIERS)
def tier(request: pytest.FixtureRequest) -> str:
    name = str(request.param)
    require_tier(name)
    return name


@pytest.fixture(scope="module")
def denying(tier: str) -> Iterator[Sandbox]:
    with Sandbox.create(tier, limits=LIMITS, rules=SandboxRules(deny=("uname",))) as sbx:
        yield sbx


@pytest.mark.parametrize("route", list(DENIED_ROUTES))
def test_a_denied_program_runs_by_no_route(denying: Sandbox, route: str) -> None:
    r = denying.commands.run(DENIED_ROUTES[route] + "; echo done")
    assert "Linux" not in r.stdout, (r.stdout, r.stderr)
    assert r.stdout.strip().endswith("done")
    assert denying.enforcement.programs is Mechanism.MASK


def test_a_denied_program_cannot_be_read_from_run_code(denying: Sandbox) -> None:
    e = denying.run_code("open('/usr/bin/uname', 'rb').read()[:4]")
    assert e.error is not None or e.text in ("b''", None)


def test_a_copy_of_a_denied_program_brought_in_runs_under_no_name(tier: str, tmp_path: Path) -> None:
    """A denied program is masked, so the judge inside could read nothing to compare a copy
    with: `curl` seeded as `fetch` ran `fetch -V`, with two bytes appended too, through ld.so
    and from a memfd. The host reads what the masked programs are before it masks them, and
    a copy (by content, or by ELF build ID) is the program."""
    if tier not in CONFINES:  # gVisor's kernel holds the masks only: it judges no exec
        return
    with Sandbox.create(tier, limits=LIMITS) as plain:  # the image's own curl, as the host masks it
        found = plain.commands.run("cp /usr/bin/curl /workspace/curl.bin")
        assert found.exit_code == 0, found.stderr
        curl = plain.files.read("curl.bin", format="bytes")
    (tmp_path / "fetch").write_bytes(curl)
    (tmp_path / "fetch2").write_bytes(curl + b"\0\0")
    rules = SandboxRules(deny=("curl",))
    with Sandbox.create(tier, limits=LIMITS, rules=rules, workspace=tmp_path) as sbx:
        sbx.files.write("fetch3", curl, mode=0o755)  # an upload
        loader = "/lib64/ld-linux-x86-64.so.2"
        routes = {
            "seed": "./fetch -V",
            "bytes appended": "./fetch2 -V",
            "upload": "./fetch3 -V",
            "a copy in /tmp": "cp fetch /tmp/g && /tmp/g -V",
            "ld.so": f"{loader} ./fetch -V; {loader} ./fetch2 -V",
            "memfd": (
                'python3 -c \'import os; f = os.memfd_create("m"); os.write(f, open("fetch2", "rb").read());'
                ' os.execve(f, ["m", "-V"], {})\''
            ),
        }
        sbx.commands.run("chmod +x fetch fetch2")
        for route, line in routes.items():
            r = sbx.commands.run(line + "; echo done")
            assert "libcurl" not in r.stdout and r.stdout.endswith("done\n"), (route, r.stdout, r.stderr)
            assert "denied by policy: commands.deny: curl" in r.stderr, (route, r.stderr)


# A word of 10,000 characters (the compiled judge hands its record to Python, which cuts it),
# then 300 execs of a 4,000-byte word each (as a build's compiler lines).
LONG_EXECS = (
    "/bin/true $(head -c 10000 /dev/zero | tr '\\0' b);"
    " w=$(head -c 4000 /dev/zero | tr '\\0' a); for i in $(seq 300); do /bin/true $w; done"
)


def test_a_report_of_many_long_execs_fits_its_frame_and_counts_the_rest(tier: str, denying: Sandbox) -> None:
    """600 execs of one 2,000-byte word each made 1.2 MB of records, over a header's 1 MiB (here
    300 of 4,000 bytes: half the execs, which the microVM runs slowly under TCG): the host took
    the report for a broken supervisor and ended the sandbox (an agent's run ended in error
    with no exec event at all). A record keeps 4 KiB of a word, marked where
    cut, and a report's records a bounded size: the rest are counted."""
    if tier not in CONFINES:  # gVisor's kernel holds the masks only: it judges no exec
        return
    r = denying.commands.run(LONG_EXECS, timeout_s=120)
    assert r.exit_code == 0, r.stderr
    assert len(r.execs) + r.execs_omitted >= 300 and r.execs_omitted > 0
    cut = [e for e in r.execs if e.argv[0] == "/bin/true" and e.argv[1].startswith("b")]
    assert len(cut) == 1
    assert cut[0].argv[1].startswith("b" * 4096 + "[... 5904 more characters; the word is sha256")
    assert ("/bin/true", "a" * 4000) in [e.argv for e in r.execs]
    assert denying.commands.run("echo alive").stdout == "alive\n"


def _rules_or_refusal(tier: str, rules: SandboxRules, **kw: object) -> Sandbox | None:
    """The sandbox, or None where the tier's kernel cannot hold the rules (and says so)."""
    if tier not in CONFINES:
        with pytest.raises(LimitNotEnforceable):
            Sandbox.create(tier, limits=LIMITS, rules=rules)
        return None
    return Sandbox.create(tier, limits=LIMITS, rules=rules, **kw)  # type: ignore[arg-type]


# Under an allowlist only the listed programs run: `uname` is not listed, and each route
# tries it under a listed program's name, from a file the code wrote, or through what is
# executable so that listed programs can run (the ELF loader, the shell).
ALLOWED = ("sh", "cat", "cp", "ln", "chmod", "printf", "python3")
ALLOWLIST_ROUTES = {
    "by name": "uname",
    "absolute path": "/usr/bin/uname",
    "sh -c": "sh -c uname",
    "a link named as a listed program": "ln -sf /usr/bin/uname /tmp/cat && /tmp/cat",
    "a copy named as a listed program": "cp /usr/bin/uname /tmp/cat && /tmp/cat",
    "a copy the code wrote": "cat /usr/bin/uname > /tmp/k && chmod +x /tmp/k && /tmp/k",
    "a listed program copied": "cp /bin/cat /tmp/c2 && /tmp/c2 /dev/null && echo RAN-A-WRITTEN-FILE",
    "a script the code wrote": (
        "printf '#!/bin/sh\\necho RAN-A-WRITTEN-FILE\\n' > /tmp/s && chmod +x /tmp/s && /tmp/s"
    ),
    "the loader": "/lib64/ld-linux-x86-64.so.2 /usr/bin/uname",
    "a copy named as a listed program, behind a link's ..": (  # lexically /usr/bin/cat
        'python3 -c \'import os, shutil; os.makedirs("/tmp/a/b/c"); os.makedirs("/tmp/a/usr/bin");'
        ' os.symlink("/tmp/a/b/c", "/tmp/l"); shutil.copy("/usr/bin/uname", "/tmp/a/usr/bin/cat")\''
        " && /tmp/l/../../usr/bin/cat"
    ),
    "a link to the loader named as a listed program": (
        "ln -sf /lib64/ld-linux-x86-64.so.2 /tmp/cat && /tmp/cat /usr/bin/uname"
    ),
    "python os.execv, a listed argv[0]": 'python3 -c \'import os; os.execv("/usr/bin/uname", ["cat"])\'',
    "python, a memfd": (
        'python3 -c \'import os; f = os.memfd_create("cat");'
        ' os.write(f, open("/usr/bin/uname", "rb").read()); os.execv(f"/proc/self/fd/{f}", ["cat"])\''
    ),
    "a link to the loader named as a listed program, its program past 4,096 words": (
        "ln -sf /lib64/ld-linux-x86-64.so.2 /tmp/cat && python3 -c 'import os;"
        ' os.execv("/tmp/cat", ["cat"] + ["--inhibit-cache"] * 5000 + ["/usr/bin/uname"])\''
    ),
}


@pytest.fixture(scope="module")
def allowing(tier: str) -> Iterator[Sandbox | None]:
    sbx = _rules_or_refusal(tier, SandboxRules(allow=ALLOWED))
    if sbx is None:
        yield None
        return
    with sbx:
        yield sbx


@pytest.mark.parametrize("route", list(ALLOWLIST_ROUTES))
def test_under_an_allowlist_nothing_else_runs_by_any_route(allowing: Sandbox | None, route: str) -> None:
    if allowing is None:  # the tier said it cannot hold the rule
        return
    r = allowing.commands.run(ALLOWLIST_ROUTES[route] + "; echo done")
    assert "Linux" not in r.stdout and "RAN-A-WRITTEN-FILE" not in r.stdout, (r.stdout, r.stderr)
    assert r.stdout.strip().endswith("done"), (r.stdout, r.stderr)  # the listed shell ran
    assert allowing.commands.run("printf listed | cat").stdout == "listed"


# The exec judge reads a path the caller can change after the answer: a link in /tmp swapped
# (renameat2's RENAME_EXCHANGE) between a listed `ls` and the ELF loader, which Landlock lets
# run, ran the loader on an unlisted bash (11 wins in 200 on process, 113 on docker). Every
# try's output goes to /tmp/out; how many tries reached the loader says the race was run.
RACED_LOADER = """
import ctypes, os, time
libc = ctypes.CDLL(None)
os.chdir("/tmp")
os.symlink("/usr/bin/ls", "l"); os.symlink("/lib64/ld-linux-x86-64.so.2", "m")
swapper = os.fork()
if swapper == 0:
    while True:
        libc.renameat2(-100, b"l", -100, b"m", 2)
out = os.open("/tmp/out", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
deadline, tries = time.monotonic() + 20, 0
while tries < 300 and time.monotonic() < deadline:
    tries += 1
    pid = os.fork()
    if pid == 0:
        os.dup2(out, 1); os.dup2(out, 2)
        try:
            os.execv("/tmp/l", ["/tmp/l", "/usr/bin/bash", "-c", "echo WIN$((6*7))"])
        finally:
            os._exit(127)
    os.waitpid(pid, 0)
os.kill(swapper, 9); os.waitpid(swapper, 0)
text = open("/tmp/out").read()
for name in ("l", "m", "out"):
    os.unlink(name)
print(tries, text.count("WIN42"), text.count("/usr/bin/bash:"))
"""


def test_under_an_allowlist_no_unlisted_program_runs_through_a_raced_exec_of_the_loader(tier: str) -> None:
    """The judge cannot close a race on a path; the view can: under an allowlist the image's
    unlisted programs are masked, so the loader a raced exec reaches has nothing to run."""
    sbx = _rules_or_refusal(tier, SandboxRules(allow=("ls", "cat", "python3", "true")))
    if sbx is None:  # the tier said it cannot hold the rule
        return
    with sbx:
        r = sbx.run_code(RACED_LOADER, timeout_s=60)
        assert r.error is None, r.error
        tries, won, loaded = map(int, r.logs.stdout.split())
        assert won == 0, (tries, won, loaded)
        assert tries > 0
        by_hand = sbx.run_code(
            "import subprocess; print(subprocess.run(['/lib64/ld-linux-x86-64.so.2', '/usr/bin/bash', '-c',"
            " 'echo WIN$((6*7))'], capture_output=True, text=True))"
        )
        assert "WIN42" not in by_hand.logs.stdout, by_hand.logs
        read = sbx.run_code("print(len(open('/usr/bin/bash', 'rb').read()))")
        assert read.error is not None or read.logs.stdout.strip() == "0"  # nothing to map
        assert (
            sbx.run_code(
                "import subprocess; print(subprocess.run(['ls', '/'], capture_output=True).stdout)"
            ).error
            is None
        )


def test_a_script_of_the_image_is_judged_as_its_interpreter_runs_it(tier: str) -> None:
    # ldd is a bash script of the image: for `ldd --version` the kernel runs `bash
    # /usr/bin/ldd --version`, with no exec of its own. The compiled judge, which allows ldd
    # by its name, leaves every script to Python, which judges the interpreter's argv too.
    sbx = _rules_or_refusal(tier, SandboxRules(deny=("bash /usr/bin/ldd",)))
    if sbx is None:
        return
    with sbx:
        r = sbx.commands.run("ldd --version")
        assert r.exit_code == 126, (r.stdout, r.stderr)
        assert "ldd: denied by policy: commands.deny: bash /usr/bin/ldd" in r.stderr
        assert sbx.commands.run("ls /").exit_code == 0  # a program, not a script: the fast path


def test_a_script_given_to_its_interpreter_is_judged_as_the_script(tier: str) -> None:
    # `bash /usr/bin/ldd --version` runs ldd's code as `ldd --version` does: judged as it.
    sbx = _rules_or_refusal(tier, SandboxRules(deny=("ldd --version",)))
    if sbx is None:
        return
    with sbx:
        for line in (
            "ldd --version",
            "bash /usr/bin/ldd --version",
            "bash -e -o posix /usr/bin/ldd --version",
            "bash -O extglob /usr/bin/ldd --version",  # -O takes a value, as -o does
            "bash +O extglob /usr/bin/ldd --version",
            # the script file judged as what it is, not by the words of its path
            "ln -sf /usr/bin/ldd /tmp/l; bash /tmp/l --version",
            "cp /usr/bin/ldd /tmp/c; sh /tmp/c --version",
            "ln -sf /usr/bin/ldd /tmp/p; python3 /tmp/p --version",
            "python3 /proc/self/fd/0 --version < /usr/bin/ldd",
            # an interpreter whose options are not read here: any word may be its script
            "perl /usr/bin/ldd --version",
            "perl -w -I /tmp /usr/bin/ldd --version",
            "perl -- /tmp/l --version",
        ):
            r = sbx.commands.run(line)
            assert r.exit_code == 126, (line, r.stdout, r.stderr)
            assert "denied by policy: commands.deny: ldd --version" in r.stderr, line
        assert sbx.commands.run("bash -c 'echo ran'").stdout == "ran\n"  # no script: bash's own
        assert (
            sbx.commands.run("printf 'print(6 * 7)' > /tmp/s.py; python3 /tmp/s.py --version").stdout
            == "42\n"
        )
        assert sbx.commands.run("perl -e 'print 42' /usr/bin/ldd").stdout == "42"  # no --version


def test_an_interpreters_long_command_line_is_refused_unread_not_judged_for_minutes(tier: str) -> None:
    # 15,000 `-r x` pairs given to node: the judge read each word as a possible script, a copy
    # of the whole rest each, and the sandbox ended "out of memory" with the code using none
    # (found from outside). Past execruns.MAX_SCRIPTS such words the exec is refused.
    sbx = _rules_or_refusal(tier, SandboxRules(approve=("ldd --version",)))
    if sbx is None:
        return
    with sbx:
        code = "import subprocess; subprocess.run(['perl'] + ['-I', 'x'] * 15000 + ['-e', 'print 42'])"
        r = sbx.run_code(code)
        assert r.error is not None and "PermissionError" in r.error.name, (r.logs, r.error)
        assert any(e.verdict == "deny" and "past what is judged" in e.rule for e in r.execs), r.execs
        assert sbx.commands.run("perl -I x -e 'print 42'").stdout == "42"  # a short one runs, the judge alive


def test_a_copy_of_an_interpreter_is_judged_as_the_interpreter(tier: str) -> None:
    # ./py -m pip ran pip past a rule on `pip install`: the copy was judged by its name alone
    # (found from outside). It is known by its content, as a copy of a rule's program is.
    sbx = _rules_or_refusal(tier, SandboxRules(approve=("pydoc",), deny=("ldd --version",)))
    if sbx is None:
        return
    with sbx:
        for line, says in (
            (
                'cp "$(readlink -f "$(command -v python3)")" ./py; ./py -m pydoc -k zz',
                "commands.approve: pydoc",
            ),
            ('cp "$(readlink -f /bin/bash)" ./b; ./b /usr/bin/ldd --version', "commands.deny: ldd --version"),
            ('cp "$(readlink -f /bin/sh)" ./s; ./s /usr/bin/ldd --version', "commands.deny: ldd --version"),
        ):
            r = sbx.commands.run(line)
            assert r.exit_code == 126 and says in r.stderr, (line, r.stdout, r.stderr)
        assert sbx.commands.run("./py -c 'print(6 * 7)'").stdout == "42\n"  # the copy runs as python


# Python runs pip by each of these (PIP is pip's package folder): its command line read as
# CPython reads it, the module's top-level package, pip's files given as the script.
PIP_THROUGH_PYTHON = (
    "python3 -m pip", "python3 -mpip", "python3 -Im pip", "python3 -Impip", "python3 -Wignore -mpip",
    "python3 -X dev -m pip", "python3 -m pip.__main__", "python3 $PIP/__main__.py", "python3 $PIP",
    "python3.11 -mpip || python3 -Esmpip",
)  # fmt: skip


@pytest.mark.parametrize(
    ("rules", "args", "says"),
    [
        (SandboxRules(deny=("pip",)), "--version", "denied by policy: commands.deny: pip"),
        (
            SandboxRules(approve=("pip install",)),
            "install --no-index --user nothing-here",
            "needs approval and was refused: commands.approve: pip install",
        ),
    ],
    ids=["deny", "approve"],
)
def test_pip_run_through_python_is_judged_as_pip(
    tier: str, rules: SandboxRules, args: str, says: str
) -> None:
    # A program denied whatever its arguments is masked on every tier (gVisor's kernel holds
    # the masks only: pip's package is hidden there, so no spelling finds it); a rule over
    # its arguments is judged where the tier confines execs.
    masked = not rules.approve
    sbx = Sandbox.create(tier, limits=LIMITS, rules=rules) if masked else _rules_or_refusal(tier, rules)
    if sbx is None:
        return
    with sbx:
        where = sbx.commands.run("python3 -c 'import os, pip; print(os.path.dirname(pip.__file__))'")
        folder = where.stdout.strip() if where.exit_code == 0 else "/usr/lib/python3/dist-packages/pip"
        for python in PIP_THROUGH_PYTHON:
            line = f"PIP={folder}; " + python.replace("pip ||", f"pip {args} ||") + f" {args}"
            r = sbx.commands.run(line)
            assert "pip " not in r.stdout and r.exit_code != 0, (line, r.stdout, r.stderr)
            if tier in CONFINES:
                assert r.exit_code == 126 and says in r.stderr, (line, r.stdout, r.stderr)
        assert sbx.commands.run("python3 -Wignore -c 'print(6 * 7)'").stdout == "42\n"  # python runs


def test_under_an_allowlist_a_listed_script_runs_with_its_interpreter_unlisted(
    allowing: Sandbox | None,
) -> None:
    # ldd is a bash script; bash is not listed: the kernel runs it for ldd, with no exec of
    # its own, and only deny and approve rules judge it there (Landlock lets it run).
    if allowing is None:
        return
    with Sandbox.create(allowing.tier, limits=LIMITS, rules=SandboxRules(allow=(*ALLOWED, "ldd"))) as sbx:
        r = sbx.commands.run("ldd --version")
        assert r.exit_code == 0, r.stderr
        assert "ldd" in r.stdout
        assert [(e.path, e.verdict) for e in r.execs if e.path.endswith("ldd")] == [("/usr/bin/ldd", "allow")]
        assert sbx.commands.run("bash -c 'echo RAN'").stdout == ""  # bash itself is not listed


def test_under_an_allowlist_a_link_to_a_listed_scripts_interpreter_runs_nothing(
    allowing: Sandbox | None,
) -> None:
    # Landlock lets bash run for ldd (a bash script); the judge once allowed a file by any
    # name it goes by, the path's among them: a link /tmp/ldd to bash ran bash with any argv,
    # recorded as an allowed /tmp/ldd. An exec is allowed by what its file is, and the record
    # names that file.
    if allowing is None:
        return
    with Sandbox.create(allowing.tier, limits=LIMITS, rules=SandboxRules(allow=(*ALLOWED, "ldd"))) as sbx:
        r = sbx.commands.run("ln -sf /bin/bash /tmp/ldd && /tmp/ldd -c 'echo RAN-$((6*7))'; echo done")
        assert "RAN-42" not in r.stdout and r.stdout.strip().endswith("done"), (r.stdout, r.stderr)
        refused = [(e.verdict, e.rule, os.path.basename(e.file)) for e in r.execs if e.path == "/tmp/ldd"]
        assert refused == [("deny", "commands.allow", "bash")], r.execs
        assert sbx.commands.run("ldd --version").exit_code == 0  # ldd runs, and bash for it


def test_under_an_allowlist_a_listed_program_runs_by_any_name_of_its_file(allowing: Sandbox | None) -> None:
    # A venv's python is a link to python3, itself a link to python3.X: one file, python3's.
    if allowing is None:
        return
    real = "$(python3 -c 'import os; print(os.path.realpath(\"/usr/bin/python3\"))')"
    r = allowing.commands.run(
        "python3 -m venv --without-pip /tmp/v && /tmp/v/bin/python -c 'print(6 * 7)'"
        f" && {real} -c 'print(7 * 8)'; python3 -c 'import shutil; shutil.rmtree(\"/tmp/v\")'"
    )
    assert r.stdout == "42\n56\n", (r.stdout, r.stderr)
    venv = [(e.verdict, e.file) for e in r.execs if e.path == "/tmp/v/bin/python"]
    assert venv == [("allow", os.path.join("/usr/bin", venv[0][1].rsplit("/", 1)[-1]))], r.execs


def _image_has(sbx: Sandbox, path: str) -> bool:
    """Whether the sandbox's image has the program at ``path`` (the process tier sees the
    host's /usr; the docker image has no git nor node). ``test`` is the shell's own."""
    return sbx.commands.run(f"test -x {path} && echo yes").stdout == "yes\n"


def test_under_an_allowlist_git_runs_its_helpers(allowing: Sandbox | None) -> None:
    # git execs its helpers from its exec-path (/usr/lib/git-core), not a program folder:
    # listed with git, they are what git needs (`git: 'remote-https' is not a git command`).
    if allowing is None:
        return
    with Sandbox.create(allowing.tier, limits=LIMITS, rules=SandboxRules(allow=(*ALLOWED, "git"))) as sbx:
        if not _image_has(sbx, "/usr/bin/git"):
            return
        r = sbx.commands.run("git ls-remote https://example.invalid/x")
        assert "not a git command" not in r.stderr, r.stderr
        helper = [e.verdict for e in r.execs if e.path.endswith("/git-remote-https")]
        assert helper == ["allow"], r.execs
        r = sbx.commands.run(
            "cd /workspace && git init -q a && git -C a -c user.email=a@b -c user.name=a commit -q"
            " --allow-empty -m made && git ls-remote /workspace/a"
        )
        assert "\tHEAD\n" in r.stdout and "\trefs/heads/" in r.stdout, (
            r.stdout,
            r.stderr,
        )  # git-upload-pack ran
        sbx.commands.run("python3 -c 'import shutil; shutil.rmtree(\"/workspace/a\")'")


# git's exec-path holds git itself under every git-X name (git-init, git-status: links to
# one file), and git runs the command its argv[0] names or, named otherwise, its args name:
# each spelling here is `git init` whatever the path it was run by.
GIT_INITS = (
    '["/usr/lib/git-core/git", "init", "r1"]',
    '["/usr/lib/git-core/git-init", "r2"]',
    '["git", "init", "r3"], executable="/usr/lib/git-core/git-status"',
    '["git-init", "r4"], executable="/usr/bin/git"',
    '["git", "--version"]',
)
GIT_STATUSES = (
    '["git", "status"]',
    '["git-status", "--short"], executable="/usr/lib/git-core/git"',
    '["git-status", "--short"], executable="/usr/bin/git"',
)


def _ran(spellings: tuple[str, ...]) -> str:
    """Python that runs each of ``spellings`` (subprocess.run's arguments) in /workspace and
    prints ``refused`` for each exec refused, or its exit code."""
    lines = ["import os, subprocess", "os.chdir('/workspace')"]
    for spelling in spellings:
        lines += [
            "try:",
            f"    print(subprocess.run({spelling}, capture_output=True).returncode)",
            "except PermissionError:",
            "    print('refused')",
        ]
    return "\n".join(lines)


def test_under_an_allowlist_git_runs_only_the_command_its_argv_names(allowing: Sandbox | None) -> None:
    # /usr/lib/git-core/git was allowed as any of its names: `git init r1` read as
    # `git-status init r1`, which `git status` allows.
    if allowing is None:
        return
    rules = SandboxRules(allow=(*ALLOWED, "git status"))
    with Sandbox.create(allowing.tier, limits=LIMITS, rules=rules) as sbx:
        if not _image_has(sbx, "/usr/lib/git-core/git-status"):
            return
        r = sbx.run_code(_ran(GIT_INITS))
        assert r.logs.stdout.split() == ["refused"] * len(GIT_INITS), (r.logs.stdout, r.logs.stderr)
        made = sbx.commands.run("ls -d /workspace/r* 2>/dev/null; echo done").stdout
        assert made == "done\n", made
        r = sbx.run_code(_ran(GIT_STATUSES))  # no repository: git status says so (128)
        assert r.logs.stdout.split() == ["128"] * len(GIT_STATUSES), (r.logs.stdout, r.logs.stderr)
        assert [e.verdict for e in r.execs] == ["allow"] * len(GIT_STATUSES), r.execs


def test_under_an_allowlist_a_listed_env_script_runs_its_interpreter(allowing: Sandbox | None) -> None:
    # npm is `#!/usr/bin/env node`: env execs node with npm's path, judged as npm; node alone
    # is still not listed.
    if allowing is None:
        return
    with Sandbox.create(allowing.tier, limits=LIMITS, rules=SandboxRules(allow=(*ALLOWED, "npm"))) as sbx:
        if not _image_has(sbx, "/usr/bin/npm"):
            return
        r = sbx.commands.run("npm --version")
        assert r.exit_code == 0 and r.stdout.strip(), (r.stdout, r.stderr)
        assert [e.verdict for e in r.execs if e.argv[:2] == ("node", "/usr/bin/npm")] == ["allow"], r.execs
        r = sbx.commands.run("node -e 'console.log(6 * 7)'")
        assert r.stdout == "" and "commands.allow" in r.stderr, (r.stdout, r.stderr)


def test_under_an_allowlist_a_library_the_code_wrote_is_not_loaded(
    allowing: Sandbox | None, tier: str, written_library: bytes
) -> None:
    """Landlock's execute right is checked at exec, not when a listed program maps a file
    executable: under an allowlist the written places are mounted noexec."""
    if allowing is None:  # the tier said it cannot hold the rule
        return
    allowing.files.write("x.so", written_library)
    allowing.commands.run("cp /workspace/x.so /tmp/x.so")
    for place in ("/workspace", "/tmp"):
        r = allowing.commands.run(f"LD_PRELOAD={place}/x.so cat /dev/null; echo done")
        assert "RAN-A-WRITTEN-LIBRARY" not in r.stdout, (place, r.stdout, r.stderr)
        assert r.stdout.strip() == "done"


@pytest.fixture(scope="module")
def approving(tier: str) -> Iterator[Sandbox | None]:
    sbx = _rules_or_refusal(tier, SandboxRules(approve=("rm -r",)))
    if sbx is None:
        yield None
        return
    with sbx:
        yield sbx


@pytest.fixture(scope="module")
def writing(tier: str) -> Iterator[Sandbox | None]:
    sbx = _rules_or_refusal(tier, SandboxRules(write=("src/**",)))
    if sbx is None:
        yield None
        return
    with sbx:
        yield sbx


RECURSIVE_ROUTES = {
    "rm -r": "rm -r gone",
    "rm -fR": "rm -fR gone",
    "rm --recursive": "rm --recursive gone",
    "env": "env rm -r gone",
    "sh -c": "sh -c 'rm -rf gone'",
    "find -exec": "find . -maxdepth 1 -name gone -exec rm -r {} +",
    "python subprocess": 'python3 -c \'import subprocess; subprocess.run(["rm", "-r", "gone"])\'',
    "copy": "cp /bin/rm /tmp/del; /tmp/del -r gone",
    # The compiled judge follows links named in their own folder by name (n2 -> n1 -> d2),
    # and any other link the slow way (a2 -> a1 -> /bin/rm): both end at rm.
    "links by name to a copy": "cp /bin/rm /tmp/d2; ln -sf d2 /tmp/n1; ln -sf n1 /tmp/n2; /tmp/n2 -r gone",
    "a link by name to a link": "ln -sf /bin/rm /tmp/a1; ln -sf a1 /tmp/a2; /tmp/a2 -r gone",
    "python -c os.execv": 'python3 -c \'import os; os.execv("/bin/rm", ["rm", "-r", "gone"])\'',
    "an abbreviated long option": "rm --recu gone",
    # the dynamic loader runs the program it is given: judged as that program
    "the loader": "/lib64/ld-linux-x86-64.so.2 /bin/rm -r gone",
    "the loader, another argv[0]": "/lib64/ld-linux-x86-64.so.2 --argv0 ls /bin/rm -r gone",
    "a copy of the loader": "cp /lib64/ld-linux-x86-64.so.2 /tmp/ld; /tmp/ld /bin/rm -r gone",
    "the loader, from its folder": "cd /bin && /lib64/ld-linux-x86-64.so.2 ./rm -r /workspace/gone",
    # a copy changed by a byte is still the program it was built as (its ELF build ID)
    "a copy padded by a byte": "cp /bin/rm /tmp/p; echo >> /tmp/p; /tmp/p -r gone",
    "a copy patched in place": (
        'python3 -c \'b = bytearray(open("/bin/rm", "rb").read()); b[-1] ^= 1;'
        ' open("/tmp/q", "wb").write(b)\'; chmod +x /tmp/q; /tmp/q -r gone'
    ),
    # links into /proc/self lead to the caller's own files, never the judge's
    "/dev/fd": "exec 9</bin/rm; /dev/fd/9 -r gone",
    "/dev/stdin": "/dev/stdin -r gone < /bin/rm",
    "a link of its own to /proc/self/fd": "exec 8</bin/rm; ln -sfn /proc/self/fd /tmp/fd; /tmp/fd/8 -r gone",
    # ".." is the parent of where a link leads: lexically /tmp/l/../../usr/bin/true is the
    # image's true, while the kernel runs the copy beside the folders /tmp/l leads to
    "a copy named as an image program, behind a link's ..": (
        "mkdir -p /tmp/a/b/c /tmp/a/usr/bin && ln -sfn /tmp/a/b/c /tmp/l && cp /bin/rm /tmp/a/usr/bin/true"
        " && /tmp/l/../../usr/bin/true -r gone"
    ),
    # a script's interpreter runs with no exec of its own: judged with the argv the kernel
    # gives it (rm -r /tmp/s gone)
    # fexecve: the file the descriptor holds, whatever its name is by then
    "python fexecve, a memfd": (
        'python3 -c \'import os; f = os.memfd_create("x"); os.write(f, open("/bin/rm", "rb").read());'
        ' os.execve(f, ["x", "-r", "gone"], {})\''
    ),
    "a script whose interpreter is rm": "printf '#!/bin/rm -r\\n' > /tmp/s && chmod +x /tmp/s && /tmp/s gone",
    "a script whose interpreter is a copy of rm": (
        "cp /bin/rm /tmp/i && printf '#! /tmp/i  -r \\n' > /tmp/s2 && chmod +x /tmp/s2 && /tmp/s2 gone"
    ),
    "a script whose interpreter is a script": (
        "printf '#!/bin/rm -r\\n' > /tmp/s3 && printf '#!/tmp/s3\\n' > /tmp/s4 && chmod +x /tmp/s3 /tmp/s4"
        " && /tmp/s4 gone"
    ),
    # the kernel follows five scripts deep; the judge followed four, and the fifth's
    # interpreter ran unread
    "a chain of five scripts": (
        "printf '#!/bin/rm -r\\n' > /tmp/c4"
        ' && for i in 3 2 1 0; do printf "#!/tmp/c$((i + 1))\\n" > /tmp/c$i; done'
        " && chmod +x /tmp/c0 /tmp/c1 /tmp/c2 /tmp/c3 /tmp/c4 && /tmp/c0 gone"
    ),
    # the same script again once its interpreter (outside the image, by "..") became rm: a
    # verdict kept for the script would let it through
    "a script whose interpreter becomes rm": (
        "cp /bin/true /tmp/x && printf '#!/usr/bin/../../tmp/x -r\\n' > /tmp/s5 && chmod +x /tmp/s5"
        " && /tmp/s5 gone; cp /bin/rm /tmp/x && /tmp/s5 gone"
    ),
    "a decoy behind a link to /proc/self/cwd": (
        "W=$PWD; cp /bin/rm /tmp/zz && echo harmless > zz && chmod +x zz && ln -sfn /proc/self/cwd /tmp/c"
        " && cd /tmp && /tmp/c/zz -r $W/gone"
    ),
    # every word is judged: the judge read 4,096 of them, and a -r past them went unseen
    "the flag past 4,096 words": "rm -f $(seq 5000 | sed 's/^/nx/') -r gone",
    "the loader's program past 4,096 words": (
        "/lib64/ld-linux-x86-64.so.2 $(yes -- --inhibit-cache | head -5000) /bin/rm -r gone"
    ),
}


@pytest.mark.parametrize("route", list(RECURSIVE_ROUTES))
def test_an_exec_that_needs_approval_is_refused_when_nobody_approves(
    approving: Sandbox | None, route: str
) -> None:
    if approving is None:  # the tier said it cannot hold the rule
        return
    sbx = approving
    sbx.commands.run("mkdir -p gone/inner && touch gone/inner/f")
    r = sbx.commands.run(RECURSIVE_ROUTES[route])
    assert sbx.files.exists("gone/inner/f"), route
    assert "needs approval and was refused: commands.approve: rm -r" in r.stderr
    assert any(e.verdict == "refuse" for e in r.execs)
    assert sbx.enforcement.commands is Mechanism.SECCOMP_NOTIFY


# The kernel needs only the execute right to run a file, and a script's interpreter too; the
# judge, the code's own user without privileges, cannot open a file of mode 0111: it refuses
# any it cannot read rather than judge it by its name alone.
UNREADABLE_ROUTES = {
    "a script whose interpreter is rm": "printf '#!/bin/rm -r\\n' > /tmp/u1; chmod 111 /tmp/u1; /tmp/u1 gone",
    "a copy of rm": "cp /bin/rm /tmp/u2; chmod 111 /tmp/u2; /tmp/u2 -r gone",
    "a copy of rm, padded": "cp /bin/rm /tmp/u3; echo >> /tmp/u3; chmod 111 /tmp/u3; /tmp/u3 -r gone",
    "a script whose interpreter is such a copy": (
        "cp /bin/rm /tmp/u4 && chmod 0111 /tmp/u4 && printf '#!/tmp/u4 -r\\n' > /tmp/u5 && chmod +x /tmp/u5"
        " && /tmp/u5 gone"
    ),
}


@pytest.mark.parametrize("route", list(UNREADABLE_ROUTES))
def test_a_file_the_judge_cannot_read_is_refused(approving: Sandbox | None, route: str) -> None:
    if approving is None:  # the tier said it cannot hold the rule
        return
    sbx = approving
    sbx.commands.run("mkdir -p gone/inner && touch gone/inner/f")
    r = sbx.commands.run(UNREADABLE_ROUTES[route])
    assert sbx.files.exists("gone/inner/f"), (route, r.stderr)
    assert r.exit_code == 126, r.stderr
    assert (
        "denied by policy: unreadable: the exec judge cannot read this file (Permission denied)" in r.stderr
    )
    assert [e.verdict for e in r.execs if e.path.startswith("/tmp/u")] == ["deny"]


def test_a_file_the_judge_cannot_read_runs_once_it_can(approving: Sandbox | None) -> None:
    """Any file the code wrote and made unreadable is refused, a harmless one too; made
    readable (chmod moves its ctime: no verdict kept for it holds), it runs."""
    if approving is None:
        return
    r = approving.commands.run("cp /bin/true /tmp/ok && chmod 0111 /tmp/ok && /tmp/ok")
    assert r.exit_code == 126 and "unreadable" in r.stderr, r.stderr
    again = approving.commands.run("chmod 0755 /tmp/ok && /tmp/ok")
    assert again.exit_code == 0, again.stderr
    assert [e.verdict for e in again.execs if e.path == "/tmp/ok"] == ["allow"]


# A verdict the judge keeps for a file must not outlive a change to it: a script that rewrote
# itself ran as what it became (a verdict kept by pid, file and argv, which also left that exec
# out of the records), and one rewritten at its size with its mtime set back (utime) was let
# run as the same file (kept by path, file, size and mtime). Its ctime moves at each change,
# and no process can set it.
REWRITE_ROUTES = {
    "a script that rewrites itself and runs again": (
        'printf \'#!/bin/sh\\nprintf "#!/bin/rm\\\\n" > /tmp/r1\\nexec /tmp/r1 "$@"\\n\' > /tmp/r1'
        " && chmod +x /tmp/r1 && /tmp/r1 -r gone"
    ),
    "a settled script rewritten at its size, its mtime set back": (
        "printf '#!/bin/sh\\n: ##\\n' > /tmp/r2 && chmod +x /tmp/r2 && sleep 2.2 && /tmp/r2 -r gone;"
        ' python3 -c \'import os; f = "/tmp/r2"; st = os.stat(f); open(f, "r+b").write(b"#!/bin/rm\\n#");'
        " os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))' && /tmp/r2 -r gone"
    ),
}


@pytest.mark.parametrize("route", list(REWRITE_ROUTES))
def test_a_verdict_kept_for_a_file_does_not_outlive_a_change_to_it(
    approving: Sandbox | None, route: str
) -> None:
    if approving is None:  # the tier said it cannot hold the rule
        return
    sbx = approving
    sbx.commands.run("mkdir -p gone/inner && touch gone/inner/f")
    r = sbx.commands.run(REWRITE_ROUTES[route])
    assert sbx.files.exists("gone/inner/f"), (route, r.stderr)
    assert "needs approval and was refused: commands.approve: rm -r" in r.stderr
    # each exec of it is in the records, the one a kept verdict could have answered included
    assert [e.verdict for e in r.execs if e.path.startswith("/tmp/r")] == ["allow", "refuse"], r.execs


def test_a_rule_holds_for_its_program_under_a_versioned_name(tier: str) -> None:
    """A rule names a program as people say it (`python -c`, `pip install`); the file is often
    `python3` or `pip3.11`: the rule is the same for them."""
    sbx = _rules_or_refusal(tier, SandboxRules(approve=("python -c",)))
    if sbx is None:
        return
    with sbx:
        six_sevens = "-c 'print(7 * 6)'"
        for line in (f"python3 {six_sevens}", f"python3.11 {six_sevens} || python3 {six_sevens}"):
            r = sbx.commands.run(line)
            assert "42" not in r.stdout, (line, r.stdout)
            assert "needs approval and was refused: commands.approve: python -c" in r.stderr
        assert sbx.commands.run("python3 -V").exit_code == 0  # the program itself runs


def test_a_git_alias_is_judged_as_the_command_a_rule_names(tier: str) -> None:
    """git runs an alias in itself, with no exec to judge, and code can define one anywhere
    (`-c`, a config file, the environment): a word that is none of git's own commands is
    judged as the rule's. git's own commands run as before."""
    sbx = _rules_or_refusal(tier, SandboxRules(approve=("git push",)))
    if sbx is None:
        return
    with sbx:
        if sbx.commands.run("command -v git").exit_code != 0:
            return  # no git in this tier's image: nothing to alias
        r = sbx.commands.run("git -c alias.p=version p; git config --global alias.q version; git q")
        assert "git version" not in r.stdout, r.stdout
        refused = {
            e.argv[-1]
            for e in r.execs
            if e.verdict == "refuse" and e.rule.startswith("commands.approve: git push")
        }
        assert refused == {"p", "q"}, r.execs
        assert "git version" in sbx.commands.run("git version").stdout


# npm's other spellings of `npm install` (npm takes aliases, typos and any prefix only one of
# its commands has): each installed a local package past a rule on `npm install` (found from
# outside, on the process tier).
NPM_SPELLINGS = ("add --offline", "--offline isntall", "in --offline", "ins --offline", "it --offline")


@contextlib.contextmanager
def _under_npm_install_rule(tier: str) -> Iterator[Sandbox | None]:
    """A sandbox under a rule on `npm install`; None where the tier refuses the rule or its
    image has no npm."""
    sbx = _rules_or_refusal(tier, SandboxRules(approve=("npm install",)))
    if sbx is None:
        yield None
        return
    with sbx:
        yield sbx if sbx.commands.run("command -v npm").exit_code == 0 else None


def test_a_rule_over_npm_install_holds_over_every_spelling_npm_takes(tier: str) -> None:
    with _under_npm_install_rule(tier) as sbx:
        if sbx is None:
            return
        sbx.files.write("pkg/package.json", '{"name": "pkg", "version": "1.0.0"}')
        sbx.files.write("app/package.json", '{"name": "app", "version": "1.0.0"}')
        for spelling in NPM_SPELLINGS:
            r = sbx.commands.run(f"cd app && npm {spelling} ../pkg")
            assert "needs approval and was refused: commands.approve: npm install" in r.stderr, (spelling, r)
            assert not sbx.files.exists("app/node_modules"), spelling
        assert sbx.commands.run("cd app && npm --version").exit_code == 0  # npm itself runs
        # the rules read npm's words as the image's npm does: every command, alias and prefix
        derefs = sbx.commands.run(NPM_DEREF)
        assert derefs.exit_code == 0, derefs
        read = json.loads(derefs.stdout)
        assert len(read) > 400 and {w: execnpm.npm_command(w) for w in read} == read


# npm's commands that install as `npm install` does (they reify node_modules, adding what the
# tree lacks and running its lifecycle scripts): each ran a local dependency's postinstall past
# a rule on `npm install` (found from outside, on the process tier).
NPM_INSTALLING = (
    "dedupe --offline --install-links", "ddp --offline --install-links",
    "prune --offline --install-links", "uninstall nothing --offline --install-links",
)  # fmt: skip


def test_a_rule_over_npm_install_holds_over_what_installs_as_it_does(tier: str) -> None:
    with _under_npm_install_rule(tier) as sbx:
        if sbx is None:
            return
        script = "node -e \"require('fs').writeFileSync(process.env.INIT_CWD + '/PWNED', '')\""
        dep = {"name": "dep", "version": "1.0.0", "scripts": {"postinstall": script}}
        sbx.files.write("dep/package.json", json.dumps(dep))
        app = {"name": "app", "version": "1.0.0", "dependencies": {"dep": "file:../dep"}}
        sbx.files.write("app/package.json", json.dumps(app))
        for line in NPM_INSTALLING:
            r = sbx.commands.run(f"cd app && npm {line}")
            assert r.exit_code == 126, (line, r)
            assert "needs approval and was refused: commands.approve: npm install" in r.stderr, (line, r)
            assert not sbx.files.exists("app/PWNED") and not sbx.files.exists("app/node_modules"), line
        assert sbx.commands.run("cd app && npm pkg get name").stdout.strip() == '"app"'  # npm's others run


# The image's npm's own reading of each of its words (lib/utils/cmd-list.js's deref).
NPM_DEREF = """node -e '
const npm = require("fs").realpathSync(process.argv[1]);
const { deref, commands, aliases } = require(require("path").join(npm, "../../lib/utils/cmd-list.js"));
const words = new Set(["installTest", "cleanInstall", "Install"]);
for (const w of [...commands, ...Object.keys(aliases)])
  for (let i = 1; i <= w.length; i++) words.add(w.slice(0, i));
const out = {}; for (const w of words) out[w] = deref(w) || null;
console.log(JSON.stringify(out))' "$(command -v npm)"
"""


def test_a_program_run_from_a_descriptor_is_judged_as_the_file_it_holds(approving: Sandbox | None) -> None:
    # fexecve of a memfd: judged by what it holds (a copy of true runs; of rm, above, not),
    # where the judge once looked the file up by a name it no longer had and refused it.
    if approving is None:
        return
    r = approving.commands.run(
        'python3 -c \'import os; f = os.memfd_create("t"); os.write(f, open("/bin/true", "rb").read());'
        ' os.execve(f, ["t"], {})\''
    )
    assert r.exit_code == 0, r.stderr
    assert [e.verdict for e in r.execs if e.argv == ("t",)] == ["allow"]


def test_a_multi_call_binary_is_masked_under_rules_over_argv(approving: Sandbox | None) -> None:
    """busybox runs its applets inside itself (`busybox sh -c 'rm -r x'` execs no rm): under
    rules over argv it is masked, as it is with any denied program."""
    if approving is None:
        return
    sbx = approving
    sbx.commands.run("mkdir -p gone/inner && touch gone/inner/f")
    for line in ("busybox sh -c 'rm -r gone'", "/bin/busybox rm -r gone", "echo gone | busybox xargs rm -r"):
        r = sbx.commands.run(line)
        assert r.exit_code != 0 and sbx.files.exists("gone/inner/f"), (line, r.stderr)


def test_every_allowed_exec_is_recorded_with_its_argv_each_time(approving: Sandbox | None) -> None:
    """The judge answers an allowed exec before recording it, and keeps its verdicts: the
    record is still made for each exec, the same one again included, with the argv judged;
    a PATH search's misses (nothing ran) are not records."""
    if approving is None:  # the tier said it cannot hold the rule
        return
    line = "/bin/true one; /bin/true one; env true two"
    for _ in range(2):  # the second time, every verdict is known
        r = approving.commands.run(line)
        assert r.exit_code == 0
        argvs = [list(e.argv) for e in r.execs]
        once = [["/bin/true", "one"], ["/bin/true", "one"], ["env", "true", "two"], ["true", "two"]]
        assert argvs[1:] == once  # env's PATH search: a miss (nothing ran) is no record
        assert all(e.verdict == "allow" for e in r.execs)
        assert r.execs[-1].path.endswith("/true")


def test_long_words_are_recorded_whole_whatever_pages_they_cross(approving: Sandbox | None) -> None:
    """The compiled judge reads an exec's words from the caller's memory to the end of a
    page at a time, one read serving every word on that page: words that run over a page's
    end, and words next to them, are recorded whole (the shell's, whose one word is the whole
    line, and the program's)."""
    if approving is None:  # the tier said it cannot hold the rule
        return
    words = [letter * size for letter, size in (("a", 1500), ("b", 1100), ("c", 7), ("d", 1300))]
    line = "/bin/true " + " ".join(words)  # a record under 4 KiB: the compiled judge's own
    r = approving.commands.run(line)
    assert r.exit_code == 0
    assert [list(e.argv[1:]) for e in r.execs] == [["-c", line], words]


def test_an_exec_waits_for_the_hosts_approver_and_runs_when_it_says_yes(tier: str) -> None:
    approver = YesTo("yes")
    sbx = _rules_or_refusal(tier, SandboxRules(approve=("rm -r",)), approver=approver)
    if sbx is None:
        return
    with sbx:
        sbx.commands.run("mkdir yes no")
        r = sbx.run_code(remove_each("yes", "no"))
        assert r.text == "[0, 'refused']", r
        assert not sbx.files.exists("yes") and sbx.files.exists("no")
        assert approver.asked == [("rm", "-r", "yes"), ("rm", "-r", "no")]
        # the refusal recorded for each folder of PATH Python tried rm in (asked once: kept)
        verdicts = [e.verdict for e in r.execs if e.argv[0] == "rm"]
        assert verdicts[0] == "approve" and set(verdicts[1:]) == {"refuse"}, r.execs


def test_an_approval_of_a_long_argv_is_asked_for_all_of_it(tier: str) -> None:
    """The approver was shown an exec's first 64 words: two execs alike in those and unlike
    after were the same request (one id, one decision). Its tail is shown now, and the words
    left out are one word naming how many and the SHA-256 of the whole argv."""
    approver = YesTo("never")
    sbx = _rules_or_refusal(tier, SandboxRules(approve=("rm -r",)), approver=approver)
    if sbx is None:
        return
    with sbx:
        head = " ".join(f"f{n}" for n in range(70))
        sbx.commands.run(f"rm -r {head} same {'x ' * 20}keep; rm -r {head} other {'x ' * 20}prod")
        first, second = approver.asked
        assert len(first) == len(second) == 64 and first[:40] == second[:40]
        assert (first[-1], second[-1]) == ("keep", "prod")
        (mark,) = [word for word in first if word.startswith("[... ")]
        assert "words not shown; the whole argv is sha256" in mark and mark not in second


def test_an_approval_past_64_words_shows_what_the_rule_matched_and_the_targets(tier: str) -> None:
    """`rm -f <62 files> -r /workspace/src` was asked as its first 63 words under the rule
    `rm -r`: the approver saw neither the `-r` nor the folder, said yes, and src was gone. The
    words a rule matched by and the argv's tail are shown, whatever stands before them."""
    approver = YesTo("never")
    sbx = _rules_or_refusal(tier, SandboxRules(approve=("rm -r",)), approver=approver)
    if sbx is None:
        return
    with sbx:
        sbx.commands.run("mkdir -p src && touch src/a.py")
        files = ", ".join(f"'/tmp/cache/{n}.tmp'" for n in range(62))
        r = sbx.run_code(f"import subprocess; subprocess.run(['rm', '-f', {files}, '-r', '/workspace/src'])")
        assert r.error is not None and sbx.files.exists("src/a.py")
        (asked,) = approver.asked
        assert len(asked) == 64 and asked[:2] == ("rm", "-f") and asked[-2:] == ("-r", "/workspace/src")
        # a flag the rule matched, far from both ends, is shown too
        flags = " ".join(f"/tmp/f{n}" for n in range(100))
        sbx.commands.run(f"rm -f {flags} -R {flags} /workspace/src")
        asked = approver.asked[-1]
        assert len(asked) == 64 and "-R" in asked and asked[-1] == "/workspace/src", asked
        refused = [e for e in sbx.commands.run(f"rm -f {flags} -R {flags} src").execs if e.argv[0] == "rm"]
        assert refused and "-R" in refused[0].argv and refused[0].argv[-1] == "src"  # the record alike
        assert sbx.files.exists("src/a.py")


def test_an_approval_of_an_argv_of_megabytes_is_asked_with_its_words_cut(tier: str) -> None:
    """An exec of twelve 100 KB words asked the host in one frame of 1.2 MB, over a header's
    1 MiB: the host ended the sandbox. The request keeps 32 KiB of the argv, each word cut
    marked with its length and SHA-256, so that words alike in their heads differ."""
    approver = YesTo("never")
    sbx = _rules_or_refusal(tier, SandboxRules(approve=("rm -r",)), approver=approver)
    if sbx is None:
        return
    with sbx:
        r = sbx.commands.run(f"w=$(head -c 100000 /dev/zero | tr '\\0' a); rm -r {'$w ' * 11}${{w}}b")
        assert r.exit_code != 0 and "needs approval and was refused" in r.stderr
        ((rm, dash, *words),) = approver.asked
        assert (rm, dash) == ("rm", "-r") and len(words) == 12
        assert all(" more characters; the word is sha256 " in word for word in words)
        assert sum(len(word.split("[... ")[0]) for word in words) <= 32 << 10
        assert words[-1] != words[-2]  # the last word's sha256 tells it from the others
        assert next(e.verdict for e in r.execs if e.argv[0] == "rm") == "refuse"


WRITE_ROUTES = {
    "shell redirect": "echo x > README",
    "python": 'python3 -c \'open("README", "w").write("x")\'',
    "dd": "dd if=/dev/zero of=README bs=1 count=1",
    "cp": "cp /etc/hostname README",
    "truncate": "truncate -s 0 keep.txt",
    "rm": "rm keep.txt",
    "mv out": "mv src/a.py a.py",
    "mkdir": "mkdir newdir",
    "ln": "ln -s src link",
    # into a written folder: a hard link would write the file through its other name (Landlock's
    # refer right refuses it, EXDEV), a rename would take it out of the read-only part; a link
    # the code may make elsewhere leads back to the read-only part
    "a hard link into src": "ln keep.txt src/k && echo x >> src/k",
    "a rename into src": "mv keep.txt src/",
    "through a link in /tmp": "ln -sfn /workspace /tmp/l; echo x > /tmp/l/README",
}


@pytest.mark.parametrize("route", list(WRITE_ROUTES))
def test_paths_outside_the_write_rules_are_read_only_to_code(writing: Sandbox | None, route: str) -> None:
    if writing is None:  # the tier said it cannot hold the rule
        return
    sbx = writing
    sbx.files.write("keep.txt", "kept")
    sbx.files.write("src/a.py", "a")
    # Names and contents; mode bits and times are not Landlock's (see docs/architecture.md)
    before = {e.path: (e.type, e.size, sbx.files.read(e.path) if e.type == "file" else "")
              for e in sbx.files.list(depth=3)}  # fmt: skip
    sbx.commands.run(WRITE_ROUTES[route])
    sbx.run_code(f"import subprocess; subprocess.run({WRITE_ROUTES[route]!r}, shell=True)")
    after = {e.path: (e.type, e.size, sbx.files.read(e.path) if e.type == "file" else "")
             for e in sbx.files.list(depth=3)}  # fmt: skip
    assert after == before, route
    assert sbx.commands.run("echo ok > src/b.py && echo t > /tmp/t && cat src/b.py").stdout == "ok\n"
    assert sbx.enforcement.paths is Mechanism.LANDLOCK


def test_a_seeded_link_at_a_written_folder_widens_no_write(tier: str, tmp_path: Path) -> None:
    """The supervisor makes a written glob's folder at start; a seed uploaded afterwards put
    a symbolic link there (`build -> .`), and the ruleset rebuilt for the replaced folder
    followed it: the whole workspace became writable (`gen -> docs`: docs/). A written path
    that is a link gets no rule: it stays read-only, and so does where it leads."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "d.txt").write_text("doc\n")
    (tmp_path / "README").write_text("README\n")
    (tmp_path / "build").symlink_to(".")
    (tmp_path / "gen").symlink_to("docs")
    sbx = _rules_or_refusal(tier, SandboxRules(write=("build/**", "gen/**")), workspace=tmp_path)
    if sbx is None:  # the tier said it cannot hold the rule
        return
    with sbx:
        record_baseline(sbx)
        before = _contents(sbx)
        writes = (
            "echo PWNED >> /workspace/README; echo PWNED > /workspace/docs/d.txt; touch /workspace/newfile;"
            " echo PWNED > build/README; echo PWNED > gen/d.txt; touch build/new gen/new; mkdir gen/dir"
        )
        ran = sbx.run_code(writes, language="bash")
        assert ran.logs.stderr.count("Permission denied") >= 6, ran.logs.stderr
        sbx.commands.run(writes)
        assert _contents(sbx) == before
        assert workspace_diff(sbx) == ""
        assert sbx.commands.run("echo t > /tmp/t && cat /tmp/t").stdout == "t\n"  # the rest holds


def test_a_link_code_makes_at_a_written_path_widens_no_write(tier: str, tmp_path: Path) -> None:
    """Code can make links in a written folder: one put where a written path was (a file
    rule's, a nested glob's folder) replaces it, and the ruleset rebuilt for the next command
    followed it to README and docs/. It gets no rule: the written folder around it stays
    writable, the link's target read-only."""
    (tmp_path / "out" / "sub").mkdir(parents=True)
    (tmp_path / "out" / "log.txt").write_text("log\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "d.txt").write_text("doc\n")
    (tmp_path / "README").write_text("README\n")
    rules = SandboxRules(write=("out/**", "out/log.txt", "out/sub/**"))
    sbx = _rules_or_refusal(tier, rules, workspace=tmp_path)
    if sbx is None:  # the tier said it cannot hold the rule
        return
    with sbx:
        record_baseline(sbx)
        made = sbx.commands.run("ln -sfn ../README out/log.txt && rm -r out/sub && ln -s ../docs out/sub")
        assert made.exit_code == 0, made.stderr
        before = _contents(sbx)
        writes = "echo PWNED >> README; echo PWNED > docs/d.txt; touch docs/new; echo PWNED >> out/log.txt"
        for _ in range(2):  # the first rebuilds the ruleset, the second runs under it
            sbx.commands.run(writes)
            sbx.run_code(writes, language="bash")
        assert _contents(sbx) == before
        assert sbx.commands.run("echo ok > out/x && cat out/x").stdout == "ok\n"  # still written
        diff = workspace_diff(sbx)
        named = [line[6:] for line in diff.splitlines() if line.startswith(("--- a/", "+++ b/"))]
        assert sorted(set(named)) == ["out/log.txt", "out/x"], diff  # the link is no file
        links = "Left out (links, FIFOs or sockets made during the run: a patch carries none)"
        assert diff.endswith(f"\n{links}: 'out/log.txt', 'out/sub'\n") and diff.count("Left out") == 1, diff


def _contents(sbx: Sandbox) -> dict[str, tuple[EntryType, int, str]]:
    """Every name in the workspace, its type and size, and a file's contents."""
    return {e.path: (e.type, e.size, sbx.files.read(e.path) if e.type == "file" else "")
            for e in sbx.files.list(depth=3)}  # fmt: skip


def test_hidden_paths_never_enter_the_sandbox(sbx_tier_workspace: tuple[str, Path]) -> None:
    tier, folder = sbx_tier_workspace
    rules = SandboxRules(hide=("secrets/**", ".env"))
    with Sandbox.create(tier, limits=LIMITS, rules=rules, workspace=folder) as sbx:
        names = {e.path for e in sbx.files.list(depth=5)}
        assert "src/app.py" in names and not any(n.startswith(("secrets", ".env")) for n in names)
        # every place the host writes files to or code can (the rest is the read-only image)
        places = "/workspace /tmp /run /home /root /dev/shm"
        r = sbx.commands.run(f"cat secrets/key .env; grep -rs TOPSECRET {places} | head -3")
        assert "TOPSECRET" not in r.stdout and not r.timed_out
        e = sbx.run_code("open('secrets/key').read()")
        assert e.error is not None and e.error.name == "FileNotFoundError"


def test_deny_globs_in_any_spelling_keep_a_seeded_workspaces_files_out(tmp_path: Path) -> None:
    """Deny globs written with the sandbox's own prefix, ``./``, ``//``, a character class, or in
    NFC over a folder named in NFD (as macOS names them) hid nothing: `grep -r . /workspace`
    printed the secret, the NFD folder's file and `.env`."""
    require_tier("process")
    import unicodedata

    from stockade.policy.engine import PolicyEngine
    from stockade.policy.load import parse_policy

    nfd = unicodedata.normalize("NFD", "données")
    for name in ("secrets/key", "keys/a.pem", "cfg/token", f"{nfd}/f.txt", ".env", "src/app.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("print('hi')\n" if name == "src/app.py" else f"TOPSECRET {name}\n")
    deny = ["/workspace/secrets/**", "./keys/**", "cfg//./token", "donn\u00e9es/**", "[.]env"]
    policy = parse_policy("[paths]\ndeny = [" + ", ".join(json.dumps(g) for g in deny) + "]\n")
    rules = PolicyEngine(policy).sandbox_rules()
    with Sandbox.create("process", limits=LIMITS, rules=rules, workspace=tmp_path) as sbx:
        r = sbx.commands.run("grep -r . /workspace; ls -a /workspace")
        assert "TOPSECRET" not in r.stdout and "src/app.py:print('hi')" in r.stdout, r.stdout
        assert not {"secrets", "keys", ".env", nfd} & set(r.stdout.split()), r.stdout  # cfg: its token only


def test_files_calls_under_path_rules_follow_no_symbolic_link(sbx_tier_workspace: tuple[str, Path]) -> None:
    """The host's policy judges a files call (a tool's read_file, write_file, apply_patch) by
    the path it names: under path rules a link on the way is refused, never followed to a file
    the rules keep read-only or hidden (code made src/rl -> ../README: a write_file of src/rl
    overwrote README, and src/sl -> ../secrets let one create secrets/planted)."""
    tier, folder = sbx_tier_workspace
    (folder / "README").write_text("original\n")
    rules = SandboxRules(write=("src/**",), hide=("secrets/**", ".env"))
    with Sandbox.create(tier, limits=LIMITS, rules=rules, workspace=folder, allow_weaker=True) as sbx:
        made = sbx.commands.run(
            "ln -s ../README src/rl; ln -s .. src/up; ln -s ../secrets src/sl; ln -s app.py src/al"
        )
        assert made.exit_code == 0, made.stderr
        for path in ("src/rl", "src/up/README", "src/sl/planted", "src/al"):
            with pytest.raises(PathEscapeError, match="symbolic link"):
                sbx.files.write(path, "pwned\n")
            with pytest.raises(PathEscapeError, match="symbolic link"):
                sbx.files.read(path)
        assert sbx.files.read("README") == "original\n"
        listed = {e.path for e in sbx.files.list(depth=5)}
        assert not any(n.startswith(("secrets", ".env")) for n in listed)
        assert sbx.files.read("src/app.py") == "print('hi')\n"  # a plain path as before
    with Sandbox.create(tier, limits=LIMITS, workspace=folder) as plain:  # no path rules: followed
        plain.commands.run("ln -s ../README src/rl")
        assert plain.files.read("src/rl") == "original\n"


@pytest.fixture
def sbx_tier_workspace(tier: str, tmp_path: Path) -> tuple[str, Path]:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "app.py").write_text("print('hi')\n")
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "key").write_text("TOPSECRET-1\n")
    (tmp_path / ".env").write_text("TOKEN=TOPSECRET-2\n")
    os.link(tmp_path / "secrets" / "key", tmp_path / "aaa-key")  # the hidden file, by another name
    for part in ("objects/ab", "refs/heads"):  # a repository store not named .git (a bare mirror)
        (tmp_path / "backup.git" / part).mkdir(parents=True)
    (tmp_path / "backup.git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / "backup.git" / "objects" / "ab" / "cd").write_text("TOPSECRET-3\n")
    return tier, tmp_path


def test_gvisor_holds_the_masks_and_with_consent_judges_the_rest_on_tool_calls_only() -> None:
    require_tier("gvisor")
    rules = SandboxRules(deny=("uname",), approve=("rm -r",), write=("src/**",))
    with Sandbox.create("gvisor", limits=LIMITS, rules=rules, allow_weaker=True) as sbx:
        assert sbx.enforcement.programs is Mechanism.MASK
        assert sbx.enforcement.commands is Mechanism.NONE and sbx.enforcement.paths is Mechanism.NONE
        assert any("judged on tool calls only" in w for w in sbx.enforcement.weakened)
        assert "Linux" not in sbx.commands.run("uname; /usr/bin/uname").stdout


def test_gvisor_starts_under_an_allowlist_and_runs_only_what_it_lists() -> None:
    # gVisor ignores masked paths: the ~300 programs an allowlist masks are bound over, and one
    # bind each failed runsc's start; their folders are masked copies, bound once each
    require_tier("gvisor")
    rules = SandboxRules(allow=("ls", "python3"))
    with Sandbox.create("gvisor", limits=LIMITS, rules=rules, allow_weaker=True) as sbx:
        assert sbx.commands.run(["ls", "/workspace"]).exit_code == 0
        assert sbx.commands.run(["python3", "-c", "print('listed')"]).stdout == "listed\n"
        for unlisted in ("uname", "/usr/bin/id", "cat", "/usr/sbin/nologin"):  # next to ls and python3
            assert sbx.commands.run([unlisted]).exit_code in (126, 127), unlisted
        assert "Linux" not in sbx.commands.run("/lib64/ld-linux-x86-64.so.2 /usr/bin/uname").stdout
        read = sbx.commands.run(["python3", "-c", "open('/usr/bin/uname', 'rb').read()"])
        assert "PermissionError" in read.stderr  # nothing to copy and run either


def test_gvisor_starts_under_a_long_deny_list() -> None:
    require_tier("gvisor")
    with Sandbox.create("gvisor", limits=LIMITS) as sbx:
        programs = sbx.commands.run(["ls", "/usr/bin"]).stdout.split()
    kept = {"ls", "sh", "dash", "bash", "env"}
    denied = ["uname", *[p for p in programs if p not in kept and not p.startswith("python")][:149]]
    with Sandbox.create("gvisor", limits=LIMITS, rules=SandboxRules(deny=tuple(denied))) as sbx:
        assert sbx.commands.run(["ls", "/workspace"]).exit_code == 0
        assert "Linux" not in sbx.commands.run("uname; /usr/bin/uname").stdout


# -- any policy, any route -------------------------------------------------------------------

PROGRAMS = {"uname": "Linux", "id": "uid=", "arch": "x86_64"}
ROUTE_TEMPLATES = (
    "{p}",
    "/usr/bin/{p}",
    "env {p}",
    "sh -c '{p}'",
    "echo | xargs {p}",
    "python3 -c 'import subprocess; subprocess.run([\"{p}\"])'",
    "python3 -c 'import os; os.system(\"{p}\")'",
    "perl -e 'system(\"{p}\")'",
    "cp /usr/bin/{p} /tmp/x && /tmp/x",
    "ln -sf /usr/bin/{p} /tmp/l && /tmp/l",
)


def output_of(rules: SandboxRules, line: str, language: str) -> str:
    """What ``line`` prints in a process sandbox under ``rules``, run as a command, by bash's
    run_code, or from Python's."""
    require_tier("process")
    with Sandbox.create("process", limits=LIMITS, rules=rules) as sbx:
        return run_in(sbx, line, language)


def run_in(sbx: Sandbox, line: str, language: str) -> str:
    """What ``line`` prints run in ``sbx`` as a command, by bash's run_code, or from Python's."""
    if language == "command":
        return sbx.commands.run(line).stdout
    if language == "run_code bash":
        return sbx.run_code(line, language="bash").logs.stdout
    return sbx.run_code(f"import subprocess\nsubprocess.run({line!r}, shell=True)").logs.stdout


@pytest.mark.parametrize("route", ROUTE_TEMPLATES)  # each route, whatever else is drawn
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    denied=st.sampled_from(sorted(PROGRAMS)),
    noise=st.lists(st.sampled_from(["curl", "wget", "rm -r", "git push", "nc"]), max_size=3),
    language=st.sampled_from(["command", "run_code bash", "run_code python"]),
)
def test_no_route_runs_a_denied_program_under_any_policy(
    route: str, denied: str, noise: list[str], language: str
) -> None:
    line = route.format(p=denied)
    out = output_of(SandboxRules(deny=(denied, *noise)), line, language)
    assert PROGRAMS[denied] not in out, (line, language, out)


# Rules over argv: `rm -r` denied, or needing an approval nobody gives, whatever route runs it.
# Each route deletes the tree `gone` if it runs rm -r.
ARGV_ROUTES = (
    "rm -r gone",
    "rm -fR gone",
    "env rm --recursive gone",
    "sh -c 'rm -r gone'",
    "find . -maxdepth 1 -name gone -exec rm -r {} +",
    "echo gone | xargs rm -vRf",
    "rm gone -r",  # GNU getopt takes flags after the operands
    "timeout 20 nice setsid rm -r gone",
    "r=rm; f=-r; $r $f gone",
    'python3 -c \'import subprocess; subprocess.run(["rm", "-r", "gone"])\'',
    'python3 -c \'import os; os.waitpid(os.posix_spawn("/bin/rm", ["rm", "-r", "gone"], {}), 0)\'',
    'perl -e \'system("rm", "-r", "gone")\'',
    "ln -sf /bin/rm /tmp/del && /tmp/del -r gone",
    "cp /bin/rm /tmp/x && /tmp/x -r gone",
    "cp /bin/rm /tmp/y && /tmp/y --recu gone",
    "printf '#!/usr/bin/env -S rm -r\\n' > /tmp/e && chmod +x /tmp/e && /tmp/e gone",
    "cp /bin/rm /tmp/p && echo >> /tmp/p && /tmp/p -r gone",
    "/lib64/ld-linux-x86-64.so.2 /bin/rm -r gone",
    "printf '#!/bin/rm -r\\n' > /tmp/s && chmod +x /tmp/s && /tmp/s gone",
    "mkdir -p /tmp/a/b/c /tmp/a/usr/bin && ln -sfn /tmp/a/b/c /tmp/l && cp /bin/rm /tmp/a/usr/bin/true"
    " && /tmp/l/../../usr/bin/true -r gone",
    'python3 -c \'import os; f = os.memfd_create("x"); os.write(f, open("/bin/rm", "rb").read());'
    ' os.execve(f, ["x", "-r", "gone"], {})\'',
)


def refusing(kind: str, rule: str, noise: list[str]) -> SandboxRules:
    """Rules that deny ``rule``, or ask an approval for it that nobody gives, among others."""
    if kind == "deny":
        return SandboxRules(deny=(rule, *noise))
    return SandboxRules(deny=tuple(noise), approve=(rule,))


@pytest.mark.parametrize("route", ARGV_ROUTES)  # each route, whatever else is drawn
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    kind=st.sampled_from(["deny", "approve"]),
    spelling=st.sampled_from(["rm -r", "rm -R", "rm --recursive"]),  # one action, any spelling
    noise=st.lists(st.sampled_from(["curl", "git push", "pip install", "uname", "ls -l"]), max_size=3),
    language=st.sampled_from(["command", "run_code bash", "run_code python"]),
)
def test_no_route_runs_a_command_the_rules_over_argv_refuse(
    route: str, kind: str, spelling: str, noise: list[str], language: str
) -> None:
    require_tier("process")
    rules = refusing(kind, spelling, noise)
    with Sandbox.create("process", limits=LIMITS, rules=rules) as sbx:
        sbx.commands.run("mkdir -p gone/inner && touch gone/inner/f")
        out = run_in(sbx, route, language)
        assert sbx.files.exists("gone/inner/f"), (route, rules, language, out)


# `git push` to a repository of the sandbox's own: each route pushes if it runs git push.
GIT_SETUP = (
    "git init -q --bare /tmp/bare.git && git init -q r && cd r"
    " && git -c user.email=a@b -c user.name=a commit -q --allow-empty -m x"
    " && git remote add origin /tmp/bare.git"
)
GIT_ROUTES = (
    "git push -q origin HEAD:main",
    "git -C /workspace/r push -q origin HEAD:main",
    "git --git-dir=.git push -q origin HEAD:main",
    "git -c alias.p=push p -q origin HEAD:main",
    "git send-pack /tmp/bare.git HEAD:refs/heads/main",
    "/usr/lib/git-core/git-push -q origin HEAD:main",
    "cp /usr/bin/git /tmp/g && /tmp/g push -q origin HEAD:main",
    "sh -c 'git push -q origin HEAD:main'",
    'python3 -c \'import subprocess; subprocess.run(["git", "push", "-q", "origin", "HEAD:main"])\'',
    # the kernel runs `git push /tmp/s HEAD:main`, and /tmp/s is the repository's other name
    "git config url./tmp/bare.git.insteadOf /tmp/s && printf '#!/usr/bin/git push\\n' > /tmp/s"
    " && chmod +x /tmp/s && /tmp/s HEAD:main",
    # past 4,096 words; a typo git runs as push inside itself, behind an option whose value
    # (`--shallow-file FILE`) the judge once took for the command
    "git $(yes -- -P | head -4100) push -q origin HEAD:main",
    "git -c help.autocorrect=immediate --shallow-file status pusj -q origin HEAD:main",
)


@pytest.mark.parametrize("route", GIT_ROUTES)  # each route, whatever else is drawn
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    kind=st.sampled_from(["deny", "approve"]),
    spelling=st.sampled_from(["git push", "git-push"]),  # one command, either spelling
    noise=st.lists(st.sampled_from(["curl", "rm -r", "pip install", "uname"]), max_size=2),
    language=st.sampled_from(["command", "run_code bash", "run_code python"]),
)
def test_no_route_pushes_where_the_rules_refuse_git_push(
    route: str, kind: str, spelling: str, noise: list[str], language: str
) -> None:
    require_tier("process")
    require("git", shutil.which("git") is not None, "the process tier runs the host's programs")
    rules = refusing(kind, spelling, noise)
    with Sandbox.create("process", limits=LIMITS, rules=rules) as sbx:
        assert sbx.commands.run(GIT_SETUP).exit_code == 0
        out = run_in(sbx, f"cd r && {route}", language)
        pushed = sbx.commands.run("git -C /tmp/bare.git rev-parse -q --verify main").exit_code == 0
        assert not pushed, (route, rules, language, out)


# Under an allowlist: the routes above, and those through what an allowlist lets run (a link
# or a copy named as a listed program, the loader that listed programs need).
SETUP = ("sh", "ln", "cp", "chmod")  # listed always: what the routes make their files with
LISTABLE = ("cat", "env", "xargs", "python3", "perl", "find", "awk", "ls")
ALLOWLIST_TEMPLATES = (
    *ROUTE_TEMPLATES,
    "ln -sf /usr/bin/{p} /tmp/{listed} && /tmp/{listed}",
    "cp /usr/bin/{p} /tmp/{listed} && /tmp/{listed}",
    "/lib64/ld-linux-x86-64.so.2 /usr/bin/{p}",
    "ln -sf /lib64/ld-linux-x86-64.so.2 /tmp/{listed} && /tmp/{listed} /usr/bin/{p}",
    'python3 -c \'import os; os.execv("/usr/bin/{p}", ["{listed}"])\'',
)


@pytest.mark.parametrize("route", ALLOWLIST_TEMPLATES)  # each route, whatever else is drawn
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    unlisted=st.sampled_from(sorted(PROGRAMS)),
    listed=st.lists(st.sampled_from(LISTABLE), min_size=1, max_size=4, unique=True),
    language=st.sampled_from(["command", "run_code python"]),
)
def test_no_route_runs_an_unlisted_program_under_any_allowlist(
    route: str, unlisted: str, listed: list[str], language: str
) -> None:
    line = route.format(p=unlisted, listed=listed[0])
    out = output_of(SandboxRules(allow=(*SETUP, *listed)), line, language)
    assert PROGRAMS[unlisted] not in out, (line, listed, language, out)


# An allow rule's words anywhere in an argv let it run: an option's value (`-C status`), a word
# past git's command, `-m pytest` after the code `-c` runs first. Each of these ran under it.
NAMED_ONLY = ("sh", "python3 -m pytest", "git status")
MERELY_CARRYING = {
    "python3 -c 'import os; os.makedirs(\"/tmp/victim/a\")' -m pytest": "test -d /tmp/victim/a",
    "git init -q status": "test -d status/.git",
    "git -C status -c user.name=a commit -q --allow-empty -m x": "false",
    "git -C status config core.hooksPath /x": "false",
}
DOING_WHAT_IT_NAMES = ("python3 -m pytest -k x", "git status -s", "git -C repo status")


def test_an_allow_rule_lets_run_only_what_does_what_it_names(tier: str) -> None:
    sbx = _rules_or_refusal(tier, SandboxRules(allow=NAMED_ONLY))
    if sbx is None:  # the tier said it cannot hold the rule
        return
    with sbx:
        has_git = sbx.commands.run("command -v git").exit_code == 0  # not in every tier's image
        for line, ran in MERELY_CARRYING.items():
            if line.startswith("git") and not has_git:
                continue
            r = sbx.commands.run(f"{line}; {ran} && echo RAN")
            assert "RAN" not in r.stdout, (line, r.stdout, r.stderr)
            verdicts = [e.verdict for e in r.execs if e.argv[:1] in (("python3",), ("git",))]
            assert verdicts and "allow" not in verdicts, (line, r.execs)
            assert "commands.allow" in r.stderr, (line, r.stderr)
        for line in DOING_WHAT_IT_NAMES:
            if line.startswith("git") and not has_git:
                continue
            r = sbx.commands.run(line)
            verdicts = [e.verdict for e in r.execs if e.argv[:1] in (("python3",), ("git",))]
            assert verdicts[:1] == ["allow"], (line, r.execs, r.stderr)


# -- the agent's sandbox: the policy file of the examples --------------------------------------


def test_the_example_policy_holds_against_code_in_run_code(tmp_path: Path) -> None:
    require_tier("process")
    from stockade.assembly import AgentConfig, build_agent
    from stockade.audit.events import EventKind
    from stockade.audit.log import AuditLog
    from stockade.audit.stores import MemoryStore
    from stockade.models import ScriptedModel, tool_call

    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "out.o").write_text("object")
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "key").write_text("TOPSECRET-KEY")
    (tmp_path / ".env").write_text("TOKEN=TOPSECRET-ENV")
    model = ScriptedModel(
        [
            tool_call(
                "run_code",
                {"code": "import subprocess; subprocess.run(['rm', '-rf', 'build'])", "language": "python"},
            ),
            tool_call("run_code", {"code": "print(open('secrets/key').read())", "language": "python"}),
            tool_call(
                "run_code",
                {"code": "import os; print(os.popen('cat .env; curl -V').read())", "language": "python"},
            ),
            "done",
        ]
    )
    log = AuditLog(MemoryStore())
    policy = Path(__file__).parents[2] / "examples" / "policy.toml"
    config = AgentConfig(model=model, policy=policy, audit=log, tier="process", record_runs=False)
    with build_agent(config) as agent:
        result = agent.run_sync("tidy up", workspace=tmp_path)
    observations = [c.observation for s in result.steps for c in s.tool_calls]
    assert "needs approval and was refused: commands.approve: rm -r" in observations[0]
    assert "FileNotFoundError" in observations[1] and "TOPSECRET" not in " ".join(observations)
    assert (tmp_path / "build" / "out.o").exists()  # the host folder is a seed: never written anyway
    execs = [e for e in log.store.events() if e.kind == EventKind.EXEC]
    refused = [e.attributes["argv"] for e in execs if e.attributes["verdict"] == "refuse"]
    assert ["rm", "-rf", "build"] in refused


# A policy whose sandbox asks a human before `rm -r`; `extra` adds what holds a call for one.
APPROVING_POLICY = """
version = 1
[trust]
level = "trusted"
[commands]
approve = ["rm -r", "cp"]
[models]
approved = ["scripted:*"]
"""


def _code(code: str) -> ToolCall:
    from stockade.models import tool_call

    return tool_call("run_code", {"language": "python", "code": code})


def _approving_run(
    tier: str, tmp_path: Path, extra: str, calls: list[ToolCall]
) -> tuple[list[str], list[str]]:
    """``calls`` made by an agent on ``tier`` (a workspace with src/, build/, dist/, docs/),
    under a human who approves every tool call put to them and no exec of `rm`: what they
    were asked (an exec as "run `ARGV`"), and each call's observation."""
    from stockade.assembly import AgentConfig, build_agent
    from stockade.models import ScriptedModel
    from stockade.policy.approval import ApprovalRequest, Choice
    from stockade.tools.base import Toolset
    from stockade.tools.builtin import default_toolset, shell

    asked: list[str] = []

    def human(request: ApprovalRequest) -> Choice:
        asked.append(request.action)
        return Choice.DENIED if request.action.startswith("run `rm") else Choice.APPROVED

    (tmp_path / "policy.toml").write_text(APPROVING_POLICY + extra)
    for folder in ("src", "build", "dist", "docs"):
        (tmp_path / "ws" / folder).mkdir(parents=True)
        (tmp_path / "ws" / folder / "keep.txt").write_text("keep me\n")
    config = AgentConfig(
        model=ScriptedModel([*calls, "done"]),
        policy=tmp_path / "policy.toml",
        tier=tier,
        approver=human,
        approval_dir=tmp_path / "approvals",
        record_runs=False,
        tools=Toolset([*default_toolset(), shell]),  # and the raw shell
    )
    with build_agent(config) as agent:
        result = agent.run_sync("tidy up", workspace=tmp_path / "ws")
    return asked, [c.observation for s in result.steps for c in s.tool_calls]


# What is left of the workspace (sys.stdout, not print: one leftover below rebinds print).
LEFT = _code(
    "import os, sys; sys.stdout.write(' '.join(['left:', *sorted(n for n in os.listdir() if n[0] != '.')]))"
)
# What an earlier call leaves behind in the interpreter, to run `rm -r` during a later call,
# and the later call's code that sets it off (code a human approves, seeing no `rm` in it).
LEFTOVERS = {
    "a thread": (
        "import threading, subprocess, os, time\n"
        "def watch():\n"
        "    while not os.path.exists('/tmp/go'):\n"
        "        time.sleep(0.01)\n"
        "    subprocess.run(['rm', '-r', '/workspace/src'])\n"
        "threading.Thread(target=watch, daemon=True).start()",
        "open('/tmp/go', 'w').close(); import time; time.sleep(1); print('hello')",
    ),
    # in the call's own thread: no look at the interpreter's threads tells it apart
    "a rebound name": (
        "import builtins, subprocess\n"
        "builtins.print = lambda *a: subprocess.run(['rm', '-r', '/workspace/src'])",
        "print('hello')",
    ),
}


@pytest.mark.parametrize("leftover", list(LEFTOVERS))
def test_an_approved_call_does_not_approve_what_an_earlier_call_left_running(
    tier: str, tmp_path: Path, leftover: str
) -> None:
    """Two failures in a row hold the next call for a human (an anomaly rule); they approve
    its code, which runs no `rm`. What an earlier call left in the interpreter runs `rm -r`
    during it: the human is asked about that exec on its own, says no, and src/ stays."""
    if tier not in CONFINES:
        return  # no exec judge there (test_gvisor_holds_the_masks_...)
    setup, trigger = LEFTOVERS[leftover]
    hold = '[anomaly.repeated_failure]\ntimes = 2\naction = "require_approval"\n'
    calls = [_code(setup), _code("1/0"), _code("1/0"), _code(trigger), LEFT]
    asked, observations = _approving_run(tier, tmp_path, hold, calls)
    assert len(asked) == 2 and asked[0].startswith("run_code(") and "hello" in asked[0]
    assert asked[1] == "run `rm -r /workspace/src`"
    assert "left: build dist docs src" in observations[-1]


def test_an_approved_call_approves_what_its_own_code_runs_where_no_other_code_can_run(
    tier: str, tmp_path: Path
) -> None:
    """Every call waits for a human here. Approving a command approves its `rm -r` too (one
    question), and so does approving the first run_code, in a new interpreter. Once code ran
    in the interpreter, what it left there can run during any later call: each `rm -r` is
    then asked on its own (and refused), the run_code's and the command's alike."""
    if tier not in CONFINES:
        return  # no exec judge there (test_gvisor_holds_the_masks_...)
    from stockade.models import tool_call

    removal = "import subprocess; print('rc', subprocess.run(['rm', '-r', '{}']).returncode)"
    calls = [
        tool_call("shell", {"command": "rm -r src && echo removed"}),
        _code(removal.format("build")),
        _code(removal.format("dist")),
        tool_call("shell", {"command": "rm -r docs"}),
        LEFT,
    ]
    risk = '[risk]\nmedium = "approve"\nhigh = "approve"\n'
    asked, observations = _approving_run(tier, tmp_path, risk, calls)
    assert [a.split("(")[0] for a in asked] == [
        "shell",
        "run_code",
        "run_code",
        "run `rm -r dist`",
        "shell",
        "run `rm -r docs`",
        "run_code",
    ]
    assert "removed" in observations[0] and "rc 0" in observations[1]
    assert all("needs approval and was refused" in o for o in observations[2:4])
    assert "left: dist docs" in observations[-1]


def test_a_yes_to_one_exec_covers_no_other_exec_of_its_call(tier: str, tmp_path: Path) -> None:
    """A run_code starts a `cp` and an `rm -r`, each needing approval: the human approves the
    copy and refuses the removal, each asked on its own, and src/ stays. In a new interpreter the
    same code asks about the copy again (a yes is spent) and not about the removal (a no
    stands). Before, the yes to the copy marked the whole call approved: the `rm -r` ran
    unasked, past the human's no (found from outside)."""
    if tier not in CONFINES:
        return  # no exec judge there (test_gvisor_holds_the_masks_...)
    both = (
        "import subprocess\n"
        "subprocess.run(['cp', '/workspace/docs/keep.txt', '/workspace/copy.txt'])\n"
        "subprocess.run(['rm', '-r', '/workspace/src'])"
    )
    calls = [_code(both), _code("import os; os._exit(3)"), _code(both), LEFT]
    asked, observations = _approving_run(tier, tmp_path, "", calls)
    copy, removal = "run `cp /workspace/docs/keep.txt /workspace/copy.txt`", "run `rm -r /workspace/src`"
    assert asked == [copy, removal, copy]
    assert all("rm: needs approval and was refused" in o for o in (observations[0], observations[2]))
    assert "left: build copy.txt dist docs src" in observations[-1]


# Code chooses the argv an exec shows: each of these runs `rm -r` under another argv[0].
HIDDEN_RM = {
    "exec -a": "subprocess.run(['true', '-r', '/workspace/src'], executable=shutil.which('rm'))",
    "a copy named true": (
        "shutil.copy(shutil.which('rm'), '/tmp/true'); os.chmod('/tmp/true', 0o755)\n"
        "subprocess.run(['/tmp/true', '-r', '/workspace/build'])"
    ),
    "a #! script": (
        "open('/tmp/s1', 'w').write('#!' + os.path.realpath(shutil.which('rm')) + ' -r\\n')\n"
        "os.chmod('/tmp/s1', 0o755); subprocess.run(['/tmp/s1', '/workspace/dist'])"
    ),
}


def test_an_approval_says_what_runs_whatever_argv_the_code_gave(tier: str, tmp_path: Path) -> None:
    """`rm -r` run as `true -r /workspace/src` (exec -a), as a copy named /tmp/true, and as
    the interpreter of a `#!/bin/rm -r` script was asked as "run `true -r ...`": a human
    refusing every `rm` said yes, and the folders were gone. The question names what runs."""
    if tier not in CONFINES:
        return  # no exec judge there (test_gvisor_holds_the_masks_...)
    calls = [_code(f"import os, shutil, subprocess\n{code}") for code in HIDDEN_RM.values()]
    asked, observations = _approving_run(tier, tmp_path, "", [*calls, LEFT])
    rm = "rm"
    assert asked == [
        f"run `{rm} -r /workspace/src` (started as `true -r /workspace/src`)",
        f"run `{rm} -r /workspace/build` (started as `/tmp/true -r /workspace/build`)",
        f"run `{rm} -r /tmp/s1 /workspace/dist` (started as `/tmp/s1 /workspace/dist`)",
    ], asked
    assert "left: build dist docs src" in observations[-1]


def test_the_compiled_judge_and_the_python_judge_record_the_same_execs(
    tier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the host built the compiled judge, the execs it lets run are recorded by it (a
    pipe the supervisor drains at the job's end): the same records, in the same order, as
    when every exec is judged in Python, past the pipe's room (64 KiB: then an exec goes to
    Python, which drains first) and the report's cap too."""
    if tier not in CONFINES:
        return  # no exec judge there (test_gvisor_holds_the_masks_...)
    rounds = 30 if tier == "microvm" else 1100  # more than a report keeps (MAX_EXEC_RECORDS)
    line = (
        f"/bin/true one; ls / > /dev/null; i=0; p={'x' * 100}; "
        f"while [ $i -lt {rounds} ]; do /bin/true $i $p; i=$((i+1)); done; "
        # a path too long for one record (over 4 KiB with its argv): the Python judge's
        f"d=/tmp/{'/'.join(['d' * 250] * 15)}; mkdir -p $d; cp /bin/true $d/t; $d/t long; "
        'rm -r nothing; python3 -c \'import subprocess; subprocess.run(["true", "a b"])\''
    )
    seen: dict[str, tuple[list[Any], list[Any]]] = {}
    for judge in ("compiled", "python"):
        monkeypatch.setenv("STOCKADE_EXEC_JUDGE", judge)
        with Sandbox.create(tier, limits=LIMITS, rules=SandboxRules(approve=("rm -r",))) as sbx:
            r = sbx.commands.run(line)
            e = sbx.run_code("import subprocess; subprocess.run(['/bin/true', 'code'])")
        seen[judge] = ([(x.path, x.argv, x.verdict) for x in r.execs], [(x.path, x.argv) for x in e.execs])
    assert seen["compiled"] == seen["python"]
    records, from_code = seen["compiled"]
    assert records[0][0] == "/bin/sh"  # its argv as the host bounds a record's text
    assert records[1:3] == [
        ("/bin/true", ("/bin/true", "one"), "allow"),
        ("/usr/bin/ls", ("ls", "/"), "allow"),
    ]
    assert from_code == [("/bin/true", ("/bin/true", "code"))]


def test_commands_running_at_once_each_get_their_own_exec_records(tier: str) -> None:
    """The compiled judge's records of every job share one pipe, taken in when a job ends: a
    command that ends while others run must leave their records to them (and take none of
    them), whether the pipe then holds a few records (one read) or many (several)."""
    if tier not in CONFINES:
        return
    many = 10 if tier == "microvm" else 60
    loop = "i=0; while [ $i -lt {n} ]; do /bin/true {name} $i; i=$((i+1)); done"
    batches = (
        {  # "slow" execs twice before "quick" ends, and once after
            "slow": ("/bin/true slow; /bin/true slow; sleep 1; /bin/true slow", 3),
            "quick": ("sleep 0.3; /bin/true quick; /bin/true quick", 2),
        },
        {
            name: (loop.format(n=many * k, name=name), many * k)
            for k, name in ((1, "one"), (2, "two"), (3, "three"))
        },
    )
    rules = SandboxRules(deny=("uname",))
    for batch in batches:
        with Sandbox.create(tier, limits=LIMITS, rules=rules) as sbx, ThreadPoolExecutor(3) as pool:
            runs = {name: pool.submit(sbx.commands.run, line) for name, (line, _) in batch.items()}
            done = {name: run.result() for name, run in runs.items()}
        for name, result in done.items():
            words = [e.argv[1] for e in result.execs if e.path == "/bin/true"]
            assert words == [name] * batch[name][1], (name, words)


# Left running by one call: a thread that, once the call returned, runs what the rules let run
# (judge.c's, where it runs), many times over (past what a report keeps), then what they deny
# and what needs an approval (both judged in Python), and says so in the workspace.
LEFT_BEHIND = (
    "import subprocess, threading, time\n"
    "def run(*argv):\n"
    "    try:\n"
    "        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    "    except OSError:\n"  # refused: EPERM at the exec
    "        pass\n"
    "def later():\n"
    "    time.sleep(1)\n"
    "    for i in range({rounds}):\n"
    "        run('/bin/true', '{tag}')\n"
    "    run('/usr/bin/id', '-u')\n"
    "    run('rm', '-r', '/workspace/keep')\n"
    "    open('/workspace/done-{tag}', 'w').close()\n"
    "threading.Thread(target=later).start()"
)


def _asked_into(asked: list[ExecRecord]) -> Any:
    def approve(record: ExecRecord) -> bool:
        asked.append(record)
        return True

    return approve


def _wait_for(sbx: Sandbox, path: str) -> None:
    deadline = time.monotonic() + 60
    while not sbx.files.exists(path):  # a files call: it lists no execs
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.2)


@pytest.mark.parametrize("judge", ["compiled", "python"])
def test_execs_judged_between_calls_are_listed_by_the_next_call_and_taken_at_close(
    tier: str, judge: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a run_code left running execs after its call returned: the next call lists those
    execs first (marked ``between``), the denied one and the one that needed an approval
    (refused, the approver never asked: no call to ask under) past a flood of allowed ones
    (kept to a report's bounds, the rest counted); those still pending at close reach the
    audit trail. Before, no job led them, and they were dropped, recorded nowhere (found
    from outside: a thread's `cp -r` between an agent's calls)."""
    if tier not in CONFINES:
        return  # no exec judge there (test_gvisor_holds_the_masks_...)
    from stockade.audit.events import EventKind
    from stockade.audit.sandbox import AuditedBackend
    from stockade.sandbox import _registry
    from stockade.testing import capture_audit

    monkeypatch.setenv("STOCKADE_EXEC_JUDGE", judge)
    rounds = 20 if tier == "microvm" else 1000  # more than a report keeps of allowed execs
    asked: list[ExecRecord] = []
    rules = SandboxRules(deny=("id -u",), approve=("rm -r",))
    with capture_audit() as audit:
        backend = AuditedBackend(_registry.backend(tier), audit, run_id="between")
        with Sandbox.create(backend=backend, limits=LIMITS, rules=rules, approver=_asked_into(asked)) as sbx:
            sbx.files.write("keep/file", "x")
            assert sbx.run_code(LEFT_BEHIND.format(rounds=rounds, tag="one")).execs == ()
            _wait_for(sbx, "done-one")
            after = sbx.run_code("print(1)")
            assert after.logs.stdout == "1\n"
            # (a PATH search tries /usr/bin/rm and /bin/rm: each refused, each recorded)
            judged = [(e.argv, e.verdict) for e in after.execs if e.argv[:1] != ("/bin/true",)]
            assert list(dict.fromkeys(judged)) == [
                (("/usr/bin/id", "-u"), "deny"),
                (("rm", "-r", "/workspace/keep"), "refuse"),
            ]
            assert all(e.between for e in after.execs)
            trues = [e for e in after.execs if e.argv == ("/bin/true", "one")]
            assert len(trues) + after.execs_omitted == rounds and trues
            assert sbx.run_code("print(2)").execs == ()  # each handed over once
            # Pending at close: taken then, into the trail.
            sbx.run_code(LEFT_BEHIND.format(rounds=2, tag="two"))
            _wait_for(sbx, "done-two")
            assert sbx.files.exists("keep/file")
        assert asked == []
    events = [e.attributes for e in audit.of(EventKind.EXEC) if "argv" in e.attributes]  # not "omitted"
    assert all(a.get("between") is True for a in events)
    closing = [(str(a["argv"]), a.get("verdict")) for a in events if "of" not in a]
    denied, refused = str(["/usr/bin/id", "-u"]), str(["rm", "-r", "/workspace/keep"])
    assert closing[:2] == [(str(["/bin/true", "two"]), "allow")] * 2
    assert list(dict.fromkeys(closing[2:])) == [(denied, "deny"), (refused, "refuse")]
    listed = [(str(a["argv"]), a.get("verdict")) for a in events if a.get("of") == "run_code"]
    assert (denied, "deny") in listed and (refused, "refuse") in listed


KILL_THE_ZYGOTE = "import os, signal; os.kill(os.getppid(), signal.SIGKILL)"


def test_resets_under_a_policy_leave_no_descriptor_behind(tier: str) -> None:
    """A reset under a policy renews it in place, or (a zygote code changed: killed, here,
    every other time) execs a fresh supervisor, handing over its state and the exec judge's
    listener on descriptors of their own: what was only a step on the way must not cross
    the exec. With 40 descriptors a process (the supervisor holds 20-30), a reset that left
    one behind would end these in "Too many open files" (it did: two a reset)."""
    limits = Limits(memory_mb=256, timeout_s=30, pids=64, open_files=64 * 40)
    with Sandbox.create(tier, limits=limits, rules=SandboxRules(deny=("uname",))) as sbx:
        assert sbx.commands.run("ulimit -n").stdout == "40\n"
        for i in range(25):
            if i % 2:
                sbx.run_code(KILL_THE_ZYGOTE)
            sbx.reset()
            assert sbx.run_code("print(1)").logs.stdout == "1\n"
            assert sbx.commands.run("echo ok").stdout == "ok\n"


# execve(path, argv, envp) by the raw system call, its fourth and fifth arguments (unused by
# the kernel, and where the exec key rides) set to each pair given: the exit status of each
# (100 + errno where the exec failed), one a line.
RAW_EXECVE = """
import ctypes, os, shutil, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
path = shutil.which("uname").encode()
words = [path, *[w.encode() for w in sys.argv[1:]]]
argv = (ctypes.c_char_p * (len(words) + 1))(*words, None)
envp = (ctypes.c_char_p * 1)(None)
for pair in (0, 0), (-1, -1), (1, 0), (0, 1), tuple(int.from_bytes(os.urandom(8), "little") for _ in "ab"):
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        libc.syscall(59, path, argv, envp, *map(ctypes.c_ulong, pair), ctypes.c_ulong(0))
        os._exit(100 + ctypes.get_errno())
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_an_exec_carrying_any_value_where_the_key_rides_is_judged(tier: str) -> None:
    """The filter lets the command shim's own exec through unjudged when it carries the exec
    key (128 random bits, in execve's unused fourth and fifth arguments) that only the
    supervisor's memory outside its forks holds: whatever an exec of the code carries there
    it is judged, its denial included."""
    sbx = _rules_or_refusal(tier, SandboxRules(deny=("uname -a",)))
    if sbx is None:
        return
    with sbx:
        for words, status in ((["-a"], "101"), (["-s"], "0")):  # EPERM: denied; -s runs
            r = sbx.commands.run(["python3", "-c", RAW_EXECVE, *words])
            assert r.stdout.split() == [status] * 5, r
        assert sbx.commands.run(["sh", "-c", "uname -a"]).exit_code == 126


def _judge_wakes(sbx: Sandbox) -> int:
    """How often the supervisor's threads other than its main one (the compiled exec judge)
    went to sleep to wait, read from the host's /proc: once per notification it answered."""
    ns = sbx.commands.run("readlink /proc/self/ns/pid").stdout.strip()
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or os.readlink(proc / "ns/pid") != ns:
                continue
            status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines())
        except OSError:
            continue
        if status["NSpid"].split()[-1] != "1":
            continue
        wakes = 0
        for task in (proc / "task").iterdir():
            if task.name != proc.name:
                lines = (task / "status").read_text().splitlines()
                wakes += int(dict(line.split(":", 1) for line in lines)["voluntary_ctxt_switches"])
        return wakes
    raise AssertionError(f"no supervisor in the pid namespace {ns}")


@pytest.mark.parametrize("host_tier", ["process", "docker"])  # the host sees their threads
def test_a_command_wakes_the_judge_for_its_own_exec_only_before_and_after_a_reset(host_tier: str) -> None:
    """The shim's exec carries the exec key past the filter: 30 commands of one exec each
    (`sh -c true`) wake the compiled judge about 30 times, not 60; after a reset that execs a
    fresh supervisor (the zygote killed) too, which takes the key over with the listener."""
    require_tier(host_tier)
    with Sandbox.create(host_tier, limits=LIMITS, rules=SandboxRules(approve=("rm -r",))) as sbx:
        for _reset in range(2):
            sbx.commands.run("true")
            before = _judge_wakes(sbx)
            for _ in range(30):
                assert sbx.commands.run("true").exit_code == 0
            assert 30 <= _judge_wakes(sbx) - before <= 36
            sbx.run_code(KILL_THE_ZYGOTE)
            sbx.reset()


# Reads /proc/PID/syscall of each process about to start (the next pids) for an execve that
# carries anything in its fourth and fifth arguments, the exec key's place, while two threads
# read the same processes' maps over and over: an exec that maps its file then waits for the
# memory's lock, asleep, where /proc shows its registers. Prints what it found, or "none".
KEY_WATCHER = r"""
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
static volatile int next_pid;
static int last_pid(void) {
    char b[32];
    int fd = open("/proc/sys/kernel/ns_last_pid", O_RDONLY), n = fd < 0 ? 0 : read(fd, b, 31);
    if (fd >= 0) close(fd);
    b[n > 0 ? n : 0] = 0;
    return atoi(b);
}
static void *contend(void *unused) {
    static char buf[2][65536];
    char *mine = buf[unused != 0], path[64];
    for (;;)
        for (int i = 0; i < 4; i++) {
            snprintf(path, sizeof path, "/proc/%d/maps", next_pid + i);
            int fd = open(path, O_RDONLY);
            for (int k = 0; fd >= 0 && k < 50 && pread(fd, mine, 65536, 0) > 0; k++) {}
            if (fd >= 0) close(fd);
        }
}
int main(int argc, char **argv) {
    pthread_t t[2];
    for (long i = 0; i < 2; i++) pthread_create(&t[i], 0, contend, (void *)i);
    char path[64], line[512];
    long execs = 0;
    for (time_t end = time(0) + atoi(argv[1]); time(0) < end;) {
        int last = last_pid();
        next_pid = last - 1;
        for (int p = last - 1; p <= last + 3; p++) {
            snprintf(path, sizeof path, "/proc/%d/syscall", p);
            int fd = open(path, O_RDONLY), n = fd < 0 ? 0 : read(fd, line, 511);
            if (fd >= 0) close(fd);
            if (n <= 3 || strncmp(line, "59 ", 3)) continue;
            line[n] = 0;
            execs++;
            char *word = line;
            for (int k = 0; k < 4 && word; k++) word = strchr(word, ' ') ? strchr(word, ' ') + 1 : 0;
            if (word && strncmp(word, "0x0 0x0 ", 8)) {
                printf("key: %s", line);
                return 0;
            }
        }
    }
    printf("none (%ld execs seen)\n", execs);
    return 0;
}
"""


def test_no_process_of_the_code_sees_the_exec_key_of_an_exec_under_way(tier: str, tmp_path: Path) -> None:
    """The shim's exec carries the exec key in its registers, and /proc/PID/syscall shows a
    sleeping exec's registers to any process that may ptrace it: the code read the key in
    its first few commands (an exec that maps its file waits for the memory's lock while
    other threads read /proc/PID/maps), and then any exec of its own passed the filter
    unjudged. The shim's file cannot be read, so its exec leaves it non-dumpable (the
    kernel's would_dump) until it runs: no process of the code sees its registers."""
    if tier not in CONFINES:
        return
    cc = shutil.which("gcc") or shutil.which("cc")
    require("a C compiler", cc is not None, "to build the watcher")
    assert cc is not None
    (tmp_path / "watch.c").write_text(KEY_WATCHER)
    built = subprocess.run(
        [cc, "-O2", "-static", "-pthread", "-o", str(tmp_path / "watch"), str(tmp_path / "watch.c")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    seconds = 12 if tier == "microvm" else 5
    with Sandbox.create(tier, limits=LIMITS, rules=SandboxRules(approve=("rm -r",))) as sbx:
        sbx.files.write("watch", (tmp_path / "watch").read_bytes())
        sbx.commands.run("chmod +x watch")
        with ThreadPoolExecutor(1) as pool:
            watching = pool.submit(sbx.commands.run, ["./watch", str(seconds)])
            commands = 0
            while not watching.done():
                assert sbx.commands.run("true").exit_code == 0
                commands += 1
            out = watching.result().stdout
    assert out.startswith("none"), (out, commands)
    assert commands > 20, out  # the watcher had commands to watch


# What a command's process is (each read by the process itself: a shell that waits for a
# child blocks its signals meanwhile): its signals, niceness, OOM score, descriptors; the
# supervisor's OOM score (the shell's parent's parent's); and how a start that fails is told.
AS_STARTED = (
    ["grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"],
    ["cut", "-d ", "-f19", "/proc/self/stat"],
    ["cat", "/proc/self/oom_score_adj"],
    ["ls", "/proc/self/fd"],
    ["sh", "-c", "cat /proc/$(cut -d' ' -f4 /proc/$PPID/stat)/oom_score_adj"],
    ["/usr/bin/env"],
    ["no-such-program"],
    ["/usr/bin/no-such-program"],
    ["sh", "-c", "exit 7"],
    ["sh", "-c", "kill -TERM $$"],
)


def _glibcs_own_signals_aside(out: str) -> str:
    """The command's signal lines with glibc's own two (32 and 33) left out: its posix_spawn,
    which starts a command's shim where no rules are, leaves them ignored in the child;
    judge.c's start leaves them at their default."""
    return "\n".join(
        f"SigIgn:\t{int(line.split()[1], 16) & ~(3 << 31):016x}" if line.startswith("SigIgn:") else line
        for line in out.splitlines()
    )


def test_a_command_under_rules_is_started_as_one_without_them(tier: str) -> None:
    """Under rules a command's shim is started by judge.c (its exec past the filter by the
    key, non-dumpable while it execs) and its command's exec is judged: the process is what
    it is with no rules at all (no signal blocked, nice 19, first for the OOM killer, no
    descriptor of the supervisor's), the supervisor keeps its own OOM score, a start that
    fails is told alike, and the command's exec is recorded with its path and argv."""
    if tier not in CONFINES:
        return
    seen = {}
    for rules in (None, SandboxRules(deny=("curl",), approve=("rm -r",), write=("src/**",))):
        with Sandbox.create(tier, limits=LIMITS, rules=rules) as sbx:
            results = [sbx.commands.run(argv) for argv in AS_STARTED]
            results.append(sbx.commands.run("pwd", cwd="/workspace/missing"))
            results.append(sbx.commands.run(["pwd"], envs={"PATH": "/usr/local/bin:/workspace:/bin"}))
            seen[rules] = [(r.exit_code, _glibcs_own_signals_aside(r.stdout), r.stderr) for r in results]
            if rules is not None:
                assert [e.argv for e in results[2].execs] == [tuple(AS_STARTED[2])]
                assert results[2].execs[0].path.endswith("/bin/cat")
                shell = results[4].execs[0]
                assert (shell.path, shell.argv) == ("/usr/bin/sh", tuple(AS_STARTED[4]))
    plain, ruled = seen.values()
    assert ruled == plain
    assert ruled[0][1].splitlines() == ["SigBlk:\t0000000000000000", "SigIgn:\t0000000000000000"]
    assert [out.strip() for _, out, _ in ruled[1:4]] == ["19", "1000", "0\n1\n2\n3"]  # 3: ls's own
    assert ruled[4][1].strip() != "1000"  # the supervisor's
    assert [status for status, _, _ in ruled[5:]] == [0, 127, 127, 7, 143, 126, 0]


def test_a_program_found_in_a_folder_code_writes_is_judged_at_its_exec(approving: Sandbox | None) -> None:
    """A command given as an argv is found on its PATH as execvp finds it, and judged at its
    exec: a copy of `rm` named `true` in a folder the code writes, first on the PATH, is
    stopped as `rm`; gone, the image's `true` runs."""
    if approving is None:
        return
    path = {"PATH": "/workspace/bin:/usr/bin:/bin"}
    approving.commands.run("mkdir -p bin gone/inner && touch gone/inner/f && cp /bin/rm bin/true")
    r = approving.commands.run(["true", "-r", "gone"], envs=path)
    assert r.exit_code != 0 and approving.files.exists("gone/inner/f"), r
    approving.commands.run("rm bin/true")
    assert approving.commands.run(["true", "-r", "gone"], envs=path).exit_code == 0
    assert approving.files.exists("gone/inner/f")


def test_a_denied_program_given_as_an_argv_runs_by_no_name(denying: Sandbox) -> None:
    """A command given as an argv (no shell): a denied program runs under none of its
    names, and a program the rules allow runs."""
    for argv in (["uname"], ["/usr/bin/uname"], ["/bin/uname"], ["env", "uname"], ["/usr/bin/env", "uname"]):
        r = denying.commands.run(argv)
        assert r.exit_code != 0 and "Linux" not in r.stdout, (argv, r)
    assert denying.commands.run(["echo", "runs"]).stdout == "runs\n"


class LateVerdict:
    """Refuses every exec; asked the second time, it first sends the supervisor a verdict
    that says yes to request 1, as a host's answer to the last user's first request would
    arrive late from another thread."""

    def __init__(self) -> None:
        self.sbx: Sandbox | None = None
        self.asked = 0

    def __call__(self, record: ExecRecord) -> bool:
        self.asked += 1
        if self.asked == 2 and self.sbx is not None:
            instance: Any = self.sbx.instance
            while not hasattr(instance, "channel"):
                instance = instance.inner
            instance.channel.call({"op": "verdict", "req": 1, "allow": True}).result(time.monotonic() + 10)
        return False


def test_a_late_verdict_for_the_last_user_never_answers_the_next_users_exec(tier: str) -> None:
    """Approval requests are numbered for the sandbox's whole life, across a reset that execs
    a fresh supervisor (the zygote killed): they restarted at 1 there, so a verdict for the
    last user's request 1 approved the next user's `rm -r` (it deleted the folder)."""
    late = LateVerdict()
    sbx = _rules_or_refusal(tier, SandboxRules(approve=("rm -r",)), approver=late)
    if sbx is None:
        return
    with sbx:
        late.sbx = sbx
        assert sbx.commands.run("mkdir a; rm -r a; ls").stdout == "a\n"
        sbx.run_code(KILL_THE_ZYGOTE)
        sbx.reset()
        r = sbx.commands.run("mkdir b; rm -r b; ls")
        # refused (and recorded) in each folder of PATH the shell tried it in
        assert r.stdout == "b\n" and {e.verdict for e in r.execs if e.argv[0] == "rm"} == {"refuse"}
        assert late.asked == 2


ZYGOTE = "import os; print(os.getppid())"  # an interpreter's parent


def test_a_reset_under_a_policy_keeps_its_folders_and_zygote_and_forgets_the_last_user(tier: str) -> None:
    """The folders the write rules made are the ruleset's (it holds their inodes): a reset
    empties them and keeps them, their modes as first seen, so that the rules hold for the
    next user with no fresh supervisor (the zygote is the same), and its judge starts anew."""
    if tier not in CONFINES:
        return
    rules = SandboxRules(approve=("rm -r",), write=("src/**",))
    with Sandbox.create(tier, limits=LIMITS, rules=rules) as sbx:
        zygote = sbx.run_code(ZYGOTE).logs.stdout
        mode = sbx.commands.run("stat -c %a src").stdout
        first = sbx.commands.run("mkdir -p src/deep && echo x > src/deep/f && chmod 500 src && echo done")
        assert first.stdout == "done\n"
        sbx.reset()
        assert sbx.run_code(ZYGOTE).logs.stdout == zygote
        assert sbx.commands.run("stat -c %a src; ls -A src").stdout == mode
        assert sbx.commands.run("echo y > src/new && cat src/new").stdout == "y\n"
        outside = sbx.commands.run("echo z > elsewhere")
        assert outside.exit_code != 0 and "Permission denied" in outside.stderr
        r = sbx.commands.run("/bin/true x; rm -r nothing")
        assert [(e.argv, e.verdict) for e in r.execs[1:3]] == [
            (("/bin/true", "x"), "allow"),
            (("rm", "-r", "nothing"), "refuse"),
        ]


def test_the_exec_judge_holds_across_a_reset(tier: str) -> None:
    """A reset renews the rules in place, or execs a fresh supervisor (the zygote killed):
    then the compiled judge stops first (its thread would otherwise take that exec's
    notification), and the fresh one judges and records again."""
    if tier not in CONFINES:
        return
    with Sandbox.create(tier, limits=LIMITS, rules=SandboxRules(approve=("rm -r",))) as sbx:
        for i in range(4):
            if i % 2:
                sbx.run_code(KILL_THE_ZYGOTE)
            sbx.reset()
            r = sbx.commands.run("/bin/true x; rm -r nothing")
            assert [(e.argv, e.verdict) for e in r.execs[1:3]] == [
                (("/bin/true", "x"), "allow"),
                (("rm", "-r", "nothing"), "refuse"),
            ]


SHIM_RULES = {
    "no policy": SandboxRules(),
    "denied programs": SandboxRules(deny=("uname",)),
    "judged execs and writes": SandboxRules(approve=("rm -r",), write=("src/**",)),
    "an allowlist": SandboxRules(allow=("sh", "cat", "uname")),
}


@pytest.mark.parametrize("name", list(SHIM_RULES))
def test_commands_start_under_the_compiled_shim_with_any_policy_and_across_resets(
    tier: str, name: str
) -> None:
    """Every command's shim is the compiled one (supervisor/shim.c, spawned, not a fork of
    the supervisor): a silent fall back to the Python shim would keep every rule and lose
    the milliseconds (tens on gVisor) it saves on each command. After a reset too: under an
    allowlist the fresh supervisor may make no memfd, and keeps the one it was handed."""
    from stockade.sandbox import _shim

    require("the compiled shim (a C compiler, x86_64)", _shim.program() is not None)
    rules = SHIM_RULES[name]
    if rules.judges_execs and rules != SHIM_RULES["denied programs"]:
        sbx = _rules_or_refusal(tier, rules)
    else:
        sbx = Sandbox.create(tier, limits=LIMITS, rules=rules)
    if sbx is None:  # the tier said it cannot hold the rules
        return
    with sbx:
        for _ in range(2):
            r = sbx.commands.run("cat /proc/$PPID/cmdline; echo; uname")
            # The shim's command line; a fork of the supervisor's would be python's.
            assert r.stdout.startswith("shim\0"), (r.stdout, r.stderr)
            assert ("Linux" in r.stdout) is (rules != SHIM_RULES["denied programs"]), r.stdout
            sbx.reset()


def test_an_exec_the_rules_stop_is_reported_past_a_thousand_they_let_run() -> None:
    """A report keeps 1,000 execs: the first the rules let run, and every one they stopped or
    asked about; the rest are counted. A loop of 1,200 `true` pushed the `rm -r` after it out
    of the report and out of the audit trail, with no note."""
    require_tier("process")
    with Sandbox.create("process", limits=LIMITS, rules=SandboxRules(approve=("rm -r",))) as sbx:
        r = sbx.commands.run("for i in $(seq 1200); do /bin/true; done; mkdir -p d; rm -r d; echo done")
        assert r.stdout.endswith("done\n")
        stopped = {(e.argv, e.verdict) for e in r.execs if e.verdict != "allow"}
        assert stopped == {(("rm", "-r", "d"), "refuse")}  # (once a folder of PATH it was tried in)
        assert len(r.execs) + r.execs_omitted >= 1 + 1 + 1200 + 1 + 1  # sh, seq, the trues, mkdir, rm
        assert len(r.execs) <= 1000 and r.execs_omitted > 0


def _data_rules(
    *, write: tuple[str, ...], data: dict[str, tuple[str, ...]], tools: dict[str, list[str]]
) -> SandboxRules:
    """A role `dev` that runs code, and data classes it may read but not write (``tools``:
    the tools each is kept to)."""
    policy = Policy.model_validate(
        {
            "paths": {"read": ["**"], "write": list(write)},
            "roles": {"dev": {"tools": ["read_file", "write_file", "run_code", "list_files", "apply_patch"]}},
            "data": [{"paths": list(paths), "tier": tier} for tier, paths in data.items()],
            "data_access": {
                tier: {"read": ["dev"], "write": [], "tools": tools.get(tier, [])} for tier in data
            },
        }
    )
    return PolicyEngine(policy, role="dev").sandbox_rules()


def test_code_neither_reads_a_class_kept_to_other_tools_nor_changes_a_read_only_one(
    tier: str, tmp_path: Path
) -> None:
    """`data_access.X.tools` without run_code: code could read the class, so it never enters;
    `data_access.X.write` without the role, outside the written folders: the kernel keeps it
    read-only to code (a run_code had overwritten it, and read_file then returned the forgery)."""
    for path, text in {
        "customers/c.csv": "CUSTOMER\n",
        "reports/r.csv": "REPORT\n",
        "src/app.py": "app\n",
    }.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    rules = _data_rules(
        write=("src/**",),
        data={"confidential": ("customers/**",), "internal": ("reports/**",)},
        tools={"confidential": ["read_file"]},
    )
    sbx = _rules_or_refusal(tier, rules, workspace=tmp_path)
    if sbx is None:  # the tier said it cannot hold the rules
        return
    with sbx:
        read = sbx.run_code("print(open('/workspace/customers/c.csv').read())")
        assert "CUSTOMER" not in read.logs.stdout
        assert read.error is not None and read.error.name == "FileNotFoundError"
        wrote = sbx.run_code("open('/workspace/reports/r.csv', 'w').write('TAMPERED')")
        assert wrote.error is not None and wrote.error.name == "PermissionError"
        sbx.commands.run("echo TAMPERED > reports/r.csv; echo x > reports/new.csv; rm -f reports/r.csv")
        assert sbx.files.read("reports/r.csv") == "REPORT\n"
        assert {e.path for e in sbx.files.list("reports")} == {"reports/r.csv"}
        assert sbx.run_code("print(open('/workspace/reports/r.csv').read())").logs.stdout == "REPORT\n\n"
        assert sbx.commands.run("echo ok > src/b.py && cat src/b.py").stdout == "ok\n"
        assert sbx.enforcement.paths is Mechanism.LANDLOCK and not sbx.enforcement.weakened


def test_a_file_where_a_written_folder_goes_opens_nothing_for_writing(tier: str, tmp_path: Path) -> None:
    """Landlock's rule holds an inode: a seeded *file* named `out` (for `out/**`) got the
    folder's rule, and hard-linked to a read-only file (a class the role may read, not
    write) it made that file writable by code, on every tier that confines (found from
    outside). A written folder must be a folder, and a written file have one name."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "patients.csv").write_text("PATIENTS\n")
    os.link(tmp_path / "data" / "patients.csv", tmp_path / "out")  # `out` is the class's file
    (tmp_path / "notes.txt").write_text("NOTES\n")
    os.link(tmp_path / "notes.txt", tmp_path / "notes-link.txt")  # a written file with two names
    rules = _data_rules(write=("out/**", "notes.txt"), data={"confidential": ("data/**",)}, tools={})
    sbx = _rules_or_refusal(tier, rules, workspace=tmp_path)
    if sbx is None:
        return
    with sbx:
        for target in ("data/patients.csv", "out", "notes-link.txt", "notes.txt"):
            forged = sbx.run_code(f"open('/workspace/{target}', 'w').write('FORGED')")
            assert forged.error is not None and forged.error.name == "PermissionError", (target, forged)
        assert sbx.files.read("data/patients.csv") == "PATIENTS\n"
        assert sbx.files.read("notes.txt") == "NOTES\n"


def test_a_read_only_class_beneath_a_written_folder_is_refused_with_its_fix(
    tier: str, tmp_path: Path
) -> None:
    """Landlock grants a written folder whole: no tier can keep `src/data/**` read-only under
    `src/**`. Refused, naming the class's rule, unless the caller accepts less."""
    (tmp_path / "src" / "data").mkdir(parents=True)
    (tmp_path / "src" / "data" / "d.csv").write_text("DATA\n")
    rules = _data_rules(write=("src/**",), data={"confidential": ("src/data/**",)}, tools={})
    with pytest.raises(LimitNotEnforceable) as refused:
        Sandbox.create(tier, limits=LIMITS, rules=rules, workspace=tmp_path)
    assert refused.value.setting == "data_access.confidential.write"
    assert "narrow paths.write" in (refused.value.fix or "")
    if tier not in CONFINES:  # its kernel holds no write rule either
        return
    with Sandbox.create(tier, limits=LIMITS, rules=rules, workspace=tmp_path, allow_weaker=True) as sbx:
        assert any(w.startswith("data_access.confidential.write:") for w in sbx.enforcement.weakened)
        assert sbx.files.read("src/data/d.csv") == "DATA\n"
