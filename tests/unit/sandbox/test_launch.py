"""The process tier's launcher (``sandbox/launch.c``): it writes "0" to each file it is given
(a cgroup's join file), takes the uid, and execs the rest with the environment it was given;
anything it cannot do stops the chain with the shell's exit statuses and a line on stderr."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from stockade.sandbox import _launch
from tests.conftest import require


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = _launch.build(tmp_path_factory.mktemp("launch"))
    require("the process tier's launcher (a C compiler, x86_64)", built is not None)
    assert built is not None
    return built


def run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False, env=env or {})


def test_it_joins_every_file_then_runs_the_program_with_its_environment(
    launcher: Path, tmp_path: Path
) -> None:
    files = [tmp_path / name for name in ("memory", "pids", "cpu")]
    for f in files:
        f.write_text("")
    argv = _launch.chain(launcher, None, [str(f) for f in files], ["/bin/sh", "-c", 'echo "$WHO"'])
    done = run(argv, env={"WHO": "the program"})
    assert (done.returncode, done.stdout, done.stderr) == (0, "the program\n", "")
    assert [f.read_text() for f in files] == ["0", "0", "0"]


def test_it_takes_the_uid_and_gid_and_drops_every_group(launcher: Path) -> None:
    require("root (only root takes another uid)", os.geteuid() == 0, "the tier drops to a uid only as root")
    script = 'cat /proc/self/status | grep -E "^(Uid|Gid|Groups|CapEff|CapPrm):"'
    done = run(_launch.chain(launcher, 65533, [], ["/bin/sh", "-c", script]))
    status = dict(line.split(":", 1) for line in done.stdout.splitlines())
    assert status["Uid"].split() == ["65533"] * 4 and status["Gid"].split() == ["65533"] * 4
    assert status["Groups"].split() == []
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0


@pytest.mark.parametrize(
    ("args", "status", "says"),
    [
        (["-", "1", "/nonexistent/tasks", "/bin/true"], 125, "cannot open /nonexistent/tasks"),
        (["-", "0", "/nonexistent/program"], 127, "cannot execute /nonexistent/program"),
        (["12a", "0", "/bin/true"], 2, "bad arguments"),
        (["-", "3", "/bin/true"], 2, "bad arguments"),  # more files than words
        (["4294967296", "0", "/bin/true"], 2, "bad arguments"),  # not an id
        (["-"], 2, "usage"),
    ],
)
def test_what_it_cannot_do_stops_the_chain_and_says_why(
    launcher: Path, args: list[str], status: int, says: str
) -> None:
    done = run([str(launcher), *args])
    assert done.returncode == status and says in done.stderr and done.stdout == ""


def test_a_join_file_it_cannot_write_stops_it_before_the_program_runs(launcher: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    done = run(_launch.chain(launcher, None, [str(tmp_path)], ["/bin/sh", "-c", f"touch {marker}"]))
    assert done.returncode == 125 and "cannot" in done.stderr and not marker.exists()
