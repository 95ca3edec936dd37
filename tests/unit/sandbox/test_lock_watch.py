"""The host's bound on a sandbox's POSIX file locks (``_locks``): counted from its processes'
open files, for a memory group written by the test, held by killing the biggest holders.

The locks here are real (taken by processes the test starts, counted by the host's kernel);
the real cgroups and sandboxes are in the integration tests (``test_host_limits``)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stockade.sandbox import _locks, _thrash
from stockade.sandbox._thrash import MemoryGroup, Watch

MiB = 1 << 20

# Take N locks on distinct ranges of one file, say so, and hold them.
HOLDER = r"""
import fcntl, sys, time
with open(sys.argv[1], "w") as f:
    for j in range(int(sys.argv[2])):
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 2 * j)
    print("held", flush=True)
    time.sleep(60)
"""


def test_the_biggest_holders_go_first_until_the_rest_fit() -> None:
    held = Counter({1: 50, 2: 30, 3: 20, 99: 10_000})  # 99: the host's, not the group's
    assert _locks.hoarders(held, [1, 2, 3], most=100) == []
    assert _locks.hoarders(held, [1, 2, 3], most=60) == [1]
    assert _locks.hoarders(held, [1, 2, 3], most=10) == [1, 2, 3]
    assert _locks.hoarders(held, [3, 4], most=0) == [3]  # 4 holds none: never chosen


@pytest.fixture
def hold(tmp_path: Path) -> Iterator[Callable[[int], subprocess.Popen[str]]]:
    """Start a process that holds ``count`` locks (once it holds them)."""
    procs: list[subprocess.Popen[str]] = []

    def start(count: int) -> subprocess.Popen[str]:
        locked = tmp_path / f"locked-{len(procs)}"
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(locked), str(count)], stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def _group(folder: Path, *, procs: list[int]) -> MemoryGroup:
    folder.mkdir(exist_ok=True)
    (folder / "memory.max").write_text(f"{256 * MiB}\n")
    (folder / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in procs))
    return MemoryGroup(folder, v2=True)


def test_a_group_over_the_bound_loses_its_biggest_holder_and_the_kill_is_counted(
    tmp_path: Path, hold: Callable[[int], subprocess.Popen[str]]
) -> None:
    big, small, other = hold(_locks.MOST - 100), hold(200), hold(_locks.MOST)
    assert (_locks.held_by(big.pid), _locks.held_by(small.pid)) == (_locks.MOST - 100, 200)
    watch = Watch(_group(tmp_path / "g", procs=[big.pid, small.pid]))  # other: not the group's
    watch.hold_locks()
    assert watch.kills == 1
    assert big.wait(timeout=10) == -9 and small.poll() is None and other.poll() is None
    assert _locks.held_by(big.pid) == 0


def test_a_group_within_the_bound_keeps_its_locks(
    tmp_path: Path, hold: Callable[[int], subprocess.Popen[str]]
) -> None:
    procs = [hold(_locks.MOST // 2), hold(_locks.MOST // 2)]
    watch = Watch(_group(tmp_path / "g", procs=[p.pid for p in procs]))
    watch.hold_locks()
    assert watch.kills == 0 and all(p.poll() is None for p in procs)


def test_the_watch_thread_stops_a_hoarder_within_a_few_periods(
    tmp_path: Path, hold: Callable[[int], subprocess.Popen[str]]
) -> None:
    small = hold(10)
    big = hold(_locks.MOST + 1)
    watch = _thrash.watch(_group(tmp_path / "g", procs=[big.pid, small.pid]))
    try:
        started = time.monotonic()
        assert big.wait(timeout=10) == -9
        assert time.monotonic() - started < 5 * _locks.PERIOD_S
        while watch.kills == 0 and time.monotonic() - started < 5:  # counted just after the kill
            time.sleep(0.01)
        assert watch.kills == 1 and small.poll() is None
    finally:
        watch.close()


def test_the_hosts_count_bounds_every_process_count(hold: Callable[[int], subprocess.Popen[str]]) -> None:
    before = _locks.host_locks()
    holder = hold(1000)
    assert _locks.host_locks() >= before + 1000 - 200  # (others' locks come and go meanwhile)
    assert _locks.host_locks() >= _locks.held_by(holder.pid) == 1000


def test_a_long_count_is_done_less_often() -> None:
    assert _locks.pause(0.0001) == _locks.PERIOD_S
    assert _locks.pause(0.05) == pytest.approx(0.45)  # a tenth of a CPU at most
