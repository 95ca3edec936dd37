"""The thrash watch's judgement and its kill, on memory cgroup folders written by the test.

The real cgroups are in the integration tests (``test_containment``): there, a sandbox that
re-reads its files at its limit is killed for memory instead of stalling to its timeout."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade.sandbox import _thrash
from stockade.sandbox._thrash import PERIOD_S, REFAULTS_PER_S, SUSTAINED_S, MemoryGroup, ThrashJudge, Watch

MiB = 1 << 20
FAST = REFAULTS_PER_S * 4  # refaults per second well over the line
STEP = PERIOD_S


def _judged(samples: list[tuple[bool, int]]) -> list[bool]:
    judge, refaults = ThrashJudge(), 0
    out = []
    for i, (at_limit, rate) in enumerate(samples):
        refaults += int(rate * STEP)
        out.append(judge.thrashing(i * STEP, at_limit, refaults))
    return out


def test_refaulting_at_the_limit_for_the_sustained_time_is_thrashing_once() -> None:
    steps = int(SUSTAINED_S / STEP)
    verdicts = _judged([(True, FAST)] * (steps + 1))
    assert verdicts == [False] * steps + [True]
    # the stretch starts again after a verdict: the next kill needs as long again
    assert _judged([(True, FAST)] * (2 * steps + 2)).count(True) == 2


@pytest.mark.parametrize(
    "interruption",
    [(False, FAST), (True, REFAULTS_PER_S // 4)],
    ids=["room-left", "few-refaults"],
)
def test_one_sample_with_room_or_without_refaults_restarts_the_stretch(
    interruption: tuple[bool, int],
) -> None:
    steps = int(SUSTAINED_S / STEP)
    samples = [(True, FAST)] * (steps - 1) + [interruption] + [(True, FAST)] * (steps - 1)
    assert not any(_judged(samples))


def test_a_clock_that_does_not_move_judges_nothing() -> None:
    judge = ThrashJudge()
    assert not judge.thrashing(5.0, True, 0)
    assert not judge.thrashing(5.0, True, 10**9)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _group(folder: Path, *, v2: bool, used: int, limit: int, refaults: int, procs: list[int]) -> MemoryGroup:
    folder.mkdir(exist_ok=True)
    if v2:
        (folder / "memory.current").write_text(f"{used}\n")
        (folder / "memory.max").write_text(f"{limit}\n")
        (folder / "memory.stat").write_text(
            f"anon {used}\nworkingset_refault_anon 0\nworkingset_refault_file {refaults}\n"
        )
    else:
        (folder / "memory.usage_in_bytes").write_text(f"{used}\n")
        (folder / "memory.limit_in_bytes").write_text(f"{limit}\n")
        # v1's own counters leave out its children: the watch reads the totals
        (folder / "memory.stat").write_text(
            f"workingset_refault_file 0\ntotal_workingset_refault_file {refaults}\n"
        )
    (folder / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in procs))
    return MemoryGroup(folder, v2=v2)


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_a_thrashing_group_loses_its_largest_process_and_the_kill_is_counted(
    tmp_path: Path, sleeper: subprocess.Popen[bytes], v2: bool
) -> None:
    # The test's own process is larger than the sleeper; the sleeper is made the kernel's
    # choice by its oom_score_adj, as user code is in a sandbox (1000).
    Path(f"/proc/{sleeper.pid}/oom_score_adj").write_text("1000")
    limit = 256 * MiB
    watch, now, refaults = None, 0.0, 0
    while now <= SUSTAINED_S + STEP:
        group = _group(
            tmp_path / "g", v2=v2, used=limit - MiB, limit=limit, refaults=refaults, procs=[sleeper.pid]
        )
        watch = watch or Watch(group)
        watch.sample(now)
        now, refaults = now + STEP, refaults + int(FAST * STEP)
    assert watch is not None and watch.kills == 1
    assert sleeper.wait(timeout=10) == -9


def test_room_below_the_limit_is_not_thrashing_whatever_it_rereads(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    limit = 256 * MiB
    watch, now, refaults = None, 0.0, 0
    while now <= 3 * SUSTAINED_S:
        group = _group(
            tmp_path / "g", v2=True, used=limit // 2, limit=limit, refaults=refaults, procs=[sleeper.pid]
        )
        watch = watch or Watch(group)
        watch.sample(now)
        now, refaults = now + STEP, refaults + int(FAST * STEP)
    assert watch is not None and watch.kills == 0 and sleeper.poll() is None


def test_a_process_gone_or_at_minus_1000_is_never_the_choice(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    group = _group(tmp_path / "g", v2=True, used=0, limit=MiB, refaults=0, procs=[gone.pid])
    assert not _thrash._kill_largest(group)
    try:  # lowering it takes CAP_SYS_RESOURCE
        Path(f"/proc/{sleeper.pid}/oom_score_adj").write_text("-1000")
    except PermissionError:
        return
    group = _group(tmp_path / "g", v2=True, used=0, limit=MiB, refaults=0, procs=[sleeper.pid])
    assert not _thrash._kill_largest(group)
    assert sleeper.poll() is None


def test_watches_come_and_go_with_their_groups(tmp_path: Path) -> None:
    group = _group(tmp_path / "g", v2=True, used=0, limit=MiB, refaults=0, procs=[])
    w = _thrash.watch(group)
    assert w in _thrash._watcher.watched
    w.close()
    w.close()
    assert w not in _thrash._watcher.watched


def test_the_counters_read_from_memory_stat() -> None:
    assert _thrash._fields(b"anon 4096\nworkingset_refault_file 17\nnot a number\n") == {
        b"anon": 4096,
        b"workingset_refault_file": 17,
    }
    assert _thrash._room(256 * MiB) == 4 * MiB and _thrash._room(4096 * MiB) == 64 * MiB
