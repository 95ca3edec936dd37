"""The compiled command shim (``supervisor/shim.c``), run here on the host as the supervisor
runs it in a sandbox: ``shim RULESET CWD PROGRAM ARG...``, leading its own session. It runs
the program as the Python shim did (found in PATH, in CWD, with its environment, nothing
but 0/1/2 open, at nice 19, first for the OOM killer), ends as the program did, kills what
the program left behind, and says why when it cannot start it, with the shell's statuses."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from stockade.sandbox import _shim
from tests.conftest import require
from tests.unit.sandbox.supervisor_modules import supervisor_module

PATH = "/usr/local/bin:/usr/bin:/bin"
reaper = supervisor_module("reaper")  # the supervisor's own, as it imports it


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = _shim.build(tmp_path_factory.mktemp("shim"))
    require("the compiled shim (a C compiler, x86_64)", built is not None)
    assert built is not None
    return built


def run(
    shim: Path, cwd: str, argv: list[str], env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(shim), "-", "-", cwd, *argv],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={"PATH": PATH, **(env or {})},
        pass_fds=pass_fds,
        start_new_session=True,  # as the supervisor starts it
    )


def test_it_runs_the_program_from_path_in_its_folder_and_ends_as_it_did(shim: Path, tmp_path: Path) -> None:
    done = run(shim, str(tmp_path), ["sh", "-c", 'pwd; echo "$WHO"; echo err >&2; exit 3'], {"WHO": "me"})
    assert (done.returncode, done.stdout, done.stderr) == (3, f"{tmp_path}\nme\n", "err\n")
    by_path = run(shim, "/", ["/bin/sh", "-c", "exit 0"])
    assert by_path.returncode == 0


def test_it_starts_the_program_with_the_codes_descriptor_limit(shim: Path) -> None:
    """FILES is the code's RLIMIT_NOFILE, soft and hard, below the supervisor's (which holds
    its relay's connections besides): "-" leaves the supervisor's."""
    done = subprocess.run(
        [str(shim), "-", "64", "/", "sh", "-c", "ulimit -Sn; ulimit -Hn"],
        capture_output=True, text=True, timeout=30, check=False, env={"PATH": PATH}, start_new_session=True,
    )  # fmt: skip
    assert (done.returncode, done.stdout.split()) == (0, ["64", "64"]), done.stderr
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    ours = run(shim, "/", ["sh", "-c", "ulimit -Hn"]).stdout.strip()
    assert ours == ("unlimited" if hard == resource.RLIM_INFINITY else str(hard))


def test_a_program_ended_by_a_signal_ends_the_shim_by_the_same_signal(shim: Path) -> None:
    assert run(shim, "/", ["sh", "-c", "kill -TERM $$"]).returncode == -signal.SIGTERM
    assert run(shim, "/", ["sh", "-c", "kill -KILL $$"]).returncode == -signal.SIGKILL


def test_what_the_program_leaves_behind_is_killed_when_it_ends(shim: Path) -> None:
    done = run(
        shim, "/", ["sh", "-c", "sleep 300 & echo $!; (sleep 300 & echo $!) ; setsid sleep 300 & echo $!"]
    )
    left = [int(pid) for pid in done.stdout.split()]
    assert done.returncode == 0 and len(left) == 3
    for pid in left:  # adopted by the shim (a subreaper), killed and reaped before it ended
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_program_gets_only_its_three_descriptors_a_low_priority_and_the_oom_killers_eye(
    shim: Path,
) -> None:
    r, w = os.pipe()
    try:
        done = run(
            shim, "/", ["sh", "-c", "ls /proc/$$/fd; cat /proc/self/oom_score_adj; nice"], pass_fds=(r, w)
        )
    finally:
        os.close(r)
        os.close(w)
    assert done.stdout.split() == ["0", "1", "2", "1000", "19"]


@pytest.mark.parametrize(
    ("argv", "status", "said"),
    [
        (["no-such-program-xyz"], 127, "stockade: no-such-program-xyz: No such file or directory"),
        (["/no/such/program"], 127, "stockade: /no/such/program: No such file or directory"),
        (["/"], 126, "stockade: /: Permission denied"),
        (["./data"], 126, "stockade: ./data: Permission denied"),
        (["./garbage"], 126, "stockade: ./garbage: Exec format error"),
    ],
)
def test_a_program_that_cannot_start_gets_the_shells_status_and_a_line_why(
    shim: Path, tmp_path: Path, argv: list[str], status: int, said: str
) -> None:
    (tmp_path / "data").write_text("not a program")  # and not executable
    (tmp_path / "garbage").write_bytes(b"\x00\x01 neither ELF nor script")
    (tmp_path / "garbage").chmod(0o755)
    done = run(shim, str(tmp_path), argv)
    assert (done.returncode, done.stdout, done.stderr) == (status, "", said + "\n")


def test_a_folder_it_cannot_enter_stops_it_before_the_program_runs(shim: Path, tmp_path: Path) -> None:
    done = run(shim, str(tmp_path / "gone"), ["touch", str(tmp_path / "ran")])
    assert done.returncode == 126
    assert done.stderr == f"stockade: cannot enter {tmp_path / 'gone'}: No such file or directory\n"
    assert not (tmp_path / "ran").exists()


def test_a_program_not_executable_in_one_path_folder_is_found_in_the_next(shim: Path, tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    for folder, text in ((first, "first"), (second, "second")):
        folder.mkdir()
        (folder / "prog").write_text(f"#!/bin/sh\necho {text}\n")
    (second / "prog").chmod(0o755)  # the first is not executable: skipped, as execvp does
    done = run(shim, "/", ["prog"], {"PATH": f"{first}:{second}"})
    assert (done.returncode, done.stdout) == (0, "second\n")
    (second / "prog").chmod(0o644)
    refused = run(shim, "/", ["prog"], {"PATH": f"{first}:{second}"})
    assert (refused.returncode, refused.stderr) == (126, "stockade: prog: Permission denied\n")


def test_it_waits_for_the_program_not_for_what_it_left(shim: Path) -> None:
    start = time.monotonic()
    done = run(shim, "/", ["sh", "-c", "sleep 30 >/dev/null 2>&1 & exit 0"])
    assert done.returncode == 0 and time.monotonic() - start < 20


# -- how the supervisor starts it (supervisor/reaper.py, supervisor/jobs.py) ---------------


def test_the_supervisor_runs_it_from_a_sealed_memfd(shim: Path, tmp_path: Path) -> None:
    (tmp_path / reaper.SHIM).write_bytes(shim.read_bytes())
    fd = reaper.load_shim(str(tmp_path))
    assert fd >= 0 and reaper.load_shim(str(tmp_path / "nothing here")) == -1
    try:
        with pytest.raises(PermissionError):  # sealed: nobody changes it again
            os.write(fd, b"\0")
        r, w = os.pipe()
        try:
            pid = reaper.spawn_program(
                fd, ["sh", "-c", "echo $WHO; pwd"], {"PATH": PATH, "WHO": "me"}, "/tmp", (w, w, w)
            )
        finally:
            os.close(w)
        with os.fdopen(r) as out:
            said = out.read()
        assert said == "me\n/tmp\n"
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        os.close(fd)


def test_a_kernel_that_will_not_run_it_leaves_the_sandbox_on_the_python_shim(tmp_path: Path) -> None:
    jobs = supervisor_module("jobs")
    (tmp_path / "not-a-program").write_bytes(b"\0" * 64)
    sup = SimpleNamespace(shim=os.open(tmp_path / "not-a-program", os.O_RDONLY), rules=None)
    r, w = os.pipe()
    try:
        assert jobs.compiled_shim(sup, ["true"], {"PATH": PATH}, "/", (r, w, w)) == 0
    finally:
        os.close(r)
        os.close(w)
    assert sup.shim == -1  # and its descriptor closed: every command forks the Python shim now
