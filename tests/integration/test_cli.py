"""The sandbox commands of ``stockade``, run as a user would: a real process, real sandboxes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stockade.sandbox import _registry
from tests.conftest import require_tier

STOCKADE = [sys.executable, "-m", "stockade.cli.main"]


def stockade(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*STOCKADE, *args], input=stdin, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture(autouse=True)
def _process_tier() -> None:
    require_tier("process")


def test_exec_passes_output_and_exit_code_through() -> None:
    r = stockade("exec", "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (r.returncode, r.stdout, r.stderr) == (7, "out\n", "err\n")


def test_exec_applies_limits_and_says_why_it_stopped() -> None:
    r = stockade("exec", "--timeout", "0.5", "--", "sleep", "30")
    assert r.returncode != 0 and "timed out" in r.stderr
    r = stockade("exec", "--memory", "64", "--", "python3", "-c", "b = bytearray(512 * 1024 * 1024)")
    assert r.returncode != 0 and ("memory limit" in r.stderr or "MemoryError" in r.stderr)


def test_exec_seeds_a_workspace_copy_and_reads_stdin(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("from the host\n")
    r = stockade("exec", "--workspace", str(tmp_path), "--", "sh", "-c", "cat data.txt; cat; touch new")
    assert r.stdout == "from the host\n"  # stdin is empty: not a terminal, nothing piped
    assert not (tmp_path / "new").exists()
    r = stockade("exec", "--", "cat", stdin="piped\n")
    assert r.stdout == "piped\n"


def test_exec_refuses_what_this_host_cannot_enforce() -> None:
    require_tier("gvisor")
    r = stockade("exec", "--tier", "gvisor", "--network", "--", "true")  # gVisor runs without network here
    assert r.returncode == 2 and "fix: use tier='docker'" in r.stderr, r.stderr
    # the process tier walls its whole network (slirp4netns, the host's firewall) as root here
    r = stockade("exec", "--network", "--", "true")
    assert r.returncode == 0, r.stderr


def test_run_code_prints_output_and_the_last_value(tmp_path: Path) -> None:
    r = stockade("run-code", "-", stdin="print('hi')\n6 * 7\n")
    assert r.returncode == 0 and r.stdout == "hi\n42\n"
    script = tmp_path / "fail.py"
    script.write_text("raise ValueError('nope')\n")
    r = stockade("run-code", str(script))
    assert r.returncode == 1 and "ValueError: nope" in r.stderr
    r = stockade("run-code", "--language", "bash", "-", stdin="echo $((2 + 3))")
    assert r.stdout == "5\n"


@pytest.mark.microvm  # the microVM's probe starts a guest
def test_doctor_reports_every_tier_and_how_limits_are_enforced() -> None:
    r = stockade("doctor")
    assert r.returncode == 0
    for tier in _registry.TIERS:
        assert tier in r.stdout
    assert "enforced by: memory=cgroup" in r.stdout.replace("\n", " ").replace("  ", " ")
    reports = {t["tier"]: t for t in json.loads(stockade("doctor", "--json").stdout)}
    assert list(reports) == list(_registry.TIERS)
    assert reports["process"]["available"] is True
    assert str(reports["process"]["enforcement"]["memory"]).startswith("cgroup")
    # Each tier states how late a call past its timeout may stop (gVisor's kernel honours
    # no priority, so it states more than the process tier).
    assert "a call past its timeout is stopped within 1 s more" in r.stdout
    assert reports["process"]["timeout_margin_s"] == 1.0
    if reports["gvisor"]["available"]:
        assert reports["gvisor"]["timeout_margin_s"] > reports["process"]["timeout_margin_s"]


def test_gc_runs_cleanly() -> None:
    r = stockade("gc")
    assert r.returncode == 0 and "leftover" in r.stdout
    assert os.path.exists("/")  # the host is still there


def test_the_readme_sandbox_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = readme.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == ["0 42", "42"]


def test_exec_says_what_was_cut_and_takes_a_larger_cap() -> None:
    big = "python3 -c \"import sys; sys.stdout.write('x' * (3 * 1024 * 1024))\""
    r = stockade("exec", "--", "sh", "-c", big)
    assert r.returncode == 0 and len(r.stdout) == 1024 * 1024
    assert "stdout was cut: 1.0 MiB of 3.0 MiB kept" in r.stderr and "--max-output" in r.stderr
    r = stockade("exec", "--max-output", "4M", "--", "sh", "-c", big)
    assert r.returncode == 0 and len(r.stdout) == 3 * 1024 * 1024 and "cut" not in r.stderr
    r = stockade("exec", "--max-output", "lots", "--", "true")
    assert r.returncode == 2 and "--max-output" in r.stderr


def test_exec_env_and_json() -> None:
    r = subprocess.run(
        [*STOCKADE, "exec", "--env", "GREETING=hello world", "-e", "FROM_HOST", "--json", "--", "sh", "-c",
         'echo "$GREETING / $FROM_HOST"; exit 4'],
        env={**os.environ, "FROM_HOST": "host value"},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 4, r.stderr
    result = json.loads(r.stdout)
    assert result["stdout"] == "hello world / host value\n" and result["exit_code"] == 4
    assert result["tier"] == "process" and result["truncated"] is False
    r = stockade("exec", "--env", "A=B=C", "--env", "X", "--", "true")
    assert r.returncode == 2 and "--env" in r.stderr


def _rundirs_of(pid: int) -> list[Path]:
    from stockade.sandbox._process_rundirs import OWNER_FILE, default_state_dir

    base = default_state_dir(os.geteuid() == 0)
    found = []
    for rundir in base.glob("sbx-*"):
        try:
            if (rundir / OWNER_FILE).read_text().split()[0] == str(pid):
                found.append(rundir)
        except (OSError, IndexError):
            continue
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_exec_stopped_by_a_signal_removes_its_sandbox(signum: int) -> None:
    from stockade.sandbox import _cgroups

    proc = subprocess.Popen(
        [*STOCKADE, "exec", "--timeout", "60", "--", "sh", "-c", "echo ready; sleep 60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        (rundir,) = _rundirs_of(proc.pid)
        sandbox_id = rundir.name
        started = time.monotonic()
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=20)
        took = time.monotonic() - started
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signum, stderr
    assert "stopped by SIG" in stderr and took < 5
    assert not rundir.exists()
    mounts = Path("/proc/self/mountinfo").read_text()
    assert sandbox_id not in mounts and sandbox_id not in _cgroups.leftover_groups()


def test_exec_json_shows_what_the_command_printed_as_escapes_that_decode_the_same() -> None:
    """`exec --json` printed the 8-bit CSI (U+009B) and bidi override (U+202E) a command wrote
    raw, for the terminal to act on."""
    r = stockade("exec", "--json", "--", "python3", "-c", "print('ok \\u202eevil \\u009b2J')")
    assert r.returncode == 0, r.stderr
    assert "\u202e" not in r.stdout and "\x9b" not in r.stdout
    assert "\\u202e" in r.stdout and "\\u009b" in r.stdout
    assert json.loads(r.stdout)["stdout"] == "ok \u202eevil \x9b2J\n"
