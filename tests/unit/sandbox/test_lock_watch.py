"""The host's bound on a sandbox's POSIX file locks (``_locks``): counted from its processes'
open files, for a memory group written by the test, held by killing the biggest holders.

The locks here are real (taken by processes the test starts, counted by the host's kernel);
the real cgroups and sandboxes are in the integration tests (``test_host_limits``)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stockade.sandbox import _locks, _thrash
from stockade.sandbox._thrash import MemoryGroup, Watch
from tests.conftest import require

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
    # Not against a count taken before: the host's other processes take and let go of locks
    # meanwhile, by hundreds (CI runs 127 and 131, the test run alone)
    holder = hold(1000)
    assert _locks.host_locks() >= _locks.held_by(holder.pid) == 1000


def test_a_long_count_is_done_less_often() -> None:
    assert _locks.pause(0.0001) == _locks.PERIOD_S
    assert _locks.pause(0.05) == pytest.approx(0.45)  # a tenth of a CPU at most


# Take N flock locks on files it maps, closing each descriptor: the locks live with the
# mappings, listed by no descriptor. With "fork", a child keeps the mappings and the taker
# exits. Says the holder's pid.
MAPPED_HOLDER = r"""
import ctypes, fcntl, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
for i in range(int(sys.argv[2])):
    fd = os.open(f"{sys.argv[1]}-{i % 100}", os.O_RDONLY | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_SH)
    assert libc.mmap(None, 4096, 1, 1, fd, 0) != ctypes.c_void_p(-1).value
    os.close(fd)
if sys.argv[3] == "fork" and os.fork():
    os._exit(0)
print(os.getpid(), flush=True)
time.sleep(60)
"""


@pytest.fixture
def hide(tmp_path: Path) -> Iterator[Callable[[int, bool], int]]:
    """Start a process that holds ``count`` flock locks through mappings; the holder's pid."""
    procs: list[subprocess.Popen[str]] = []
    holders: list[int] = []

    def start(count: int, fork: bool) -> int:
        name = tmp_path / f"mapped-{len(procs)}"
        how = "fork" if fork else "stay"
        proc = subprocess.Popen(
            [sys.executable, "-c", MAPPED_HOLDER, str(name), str(count), how],
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        holders.append(int(proc.stdout.readline()))
        return holders[-1]

    yield start
    for pid in holders:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for proc in procs:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def _alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _alive(pid)


def test_the_lock_table_gives_flock_locks_to_their_taker_or_to_who_maps_the_file() -> None:
    locks = _locks.table(
        b"1: POSIX  ADVISORY  WRITE 10 fe:00:5 0 EOF\n"
        b"2: FLOCK  ADVISORY  READ 10 fe:00:6 0 EOF\n"
        b"2: -> FLOCK  ADVISORY  WRITE 11 fe:00:6 0 EOF\n"  # a waiter: a task asleep
        b"3: FLOCK  ADVISORY  READ 99 00:2a:7 0 EOF\n"  # its taker is gone; 11 maps the file
        b"4: OFDLCK ADVISORY  WRITE -1 fe:00:8 0 EOF\n"
        b"5: FLOCK  ADVISORY  READ 98 fe:00:9 0 EOF\n"  # its taker gone; 20 maps the file
        b"6: FLOCK  ADVISORY  READ 97 fe:00:9 0 EOF\n"  # the host's own: a live process took it
    )
    assert [lock.kind for lock in locks] == ["POSIX", "FLOCK", "FLOCK", "OFDLCK", "FLOCK", "FLOCK"]
    assert locks[2].file == ("00:2a", 7)
    maps = {10: set(), 11: {("00:2a", 7)}, 20: {("fe:00", 9)}}
    alive = {10, 11, 20, 97}.__contains__
    held = _locks.hidden_holders(locks, {0: [10, 11], 1: [20]}, maps=maps.__getitem__, alive=alive)
    assert held[0] == Counter({10: 1, 11: 1})
    assert held[1] == Counter({20: 1})  # mapped by a sandbox's process: its, not the host's


def test_the_lock_table_is_read_again_only_when_that_many_more_are_unlisted() -> None:
    unlisted = _locks.Unlisted()
    assert not unlisted.due(_locks.HIDDEN_MOST)
    assert unlisted.due(_locks.HIDDEN_MOST + 1)
    unlisted.looked(_locks.HIDDEN_MOST + 1, freed=0)  # the host's own, or within the bound
    assert not unlisted.due(2 * _locks.HIDDEN_MOST)
    assert not unlisted.due(100)  # fewer since: the baseline follows them down
    assert unlisted.due(100 + _locks.HIDDEN_MOST + 1)


@pytest.mark.alone  # the host's lock table: another worker's locks would be its newest
def test_a_group_hiding_flock_locks_in_mappings_loses_its_hider(
    tmp_path: Path, hide: Callable[[int, bool], int], hold: Callable[[int], subprocess.Popen[str]]
) -> None:
    hider, fine = hide(_locks.HIDDEN_MOST + 500, False), hide(100, False)
    other = hold(10)  # POSIX locks, listed by its descriptors
    assert _locks.held_by(hider) == 0 and _locks.host_locks() > _locks.HIDDEN_MOST + 500
    watch = Watch(_group(tmp_path / "g", procs=[hider, fine, other.pid]))
    assert _thrash._hold_locks([watch], _locks.Unlisted())
    assert watch.kills == 1 and _gone(hider)
    assert _alive(fine) and other.poll() is None


@pytest.mark.alone  # the host's lock table: another worker's locks would be its newest
def test_locks_kept_by_a_child_after_their_taker_exits_are_the_childs(
    tmp_path: Path, hide: Callable[[int, bool], int]
) -> None:
    child = hide(_locks.HIDDEN_MOST + 500, True)
    watch = Watch(_group(tmp_path / "g", procs=[child]))
    _thrash._hold_locks([watch], _locks.Unlisted())
    assert watch.kills == 1 and _gone(child)


# Take PIPED POSIX locks on a pipe on the last CPU, then LISTED on a file on the first, at the
# largest offsets (the longest lines of /proc/locks, which lists each CPU's locks in turn);
# say so, and hold them.
BEHIND_LISTED = r"""
import fcntl, os, sys, time
listed, piped = int(sys.argv[2]), int(sys.argv[3])
cpus = sorted(os.sched_getaffinity(0))
read, write = os.pipe()
os.sched_setaffinity(0, {cpus[-1]})
for j in range(piped):
    fcntl.lockf(write, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 2 * j)
os.sched_setaffinity(0, {cpus[0]})
with open(sys.argv[1], "w") as f:
    for j in range(listed):
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, (1 << 62) + 2 * j)
    print("held", flush=True)
    time.sleep(60)
"""


@pytest.mark.alone  # the host's lock table: another worker's locks would be read too
def test_locks_listed_first_in_the_table_hide_none_behind_them(tmp_path: Path) -> None:
    """/proc/locks lists each CPU's locks in turn. A look used to read its first 256 KiB
    and scale each holder's share: 4,090 locks (within the bound, listed by a descriptor) at
    the largest offsets on the first CPU filled it, and 300,000 on a pipe behind them were
    never seen. A look now reads on until it finds a sandbox over the bound (at most the
    whole table), and never scales a share."""
    require("two CPUs (each CPU's locks are a list of the table)", len(os.sched_getaffinity(0)) >= 2)
    argv = [sys.executable, "-c", BEHIND_LISTED, str(tmp_path / "listed"), "4090", "20000"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "held\n"
            assert _locks.held_by(proc.pid) == 4090  # within the bound: no POSIX kill
            watch = Watch(_group(tmp_path / "g", procs=[proc.pid]))
            assert _thrash._hold_locks([watch], _locks.Unlisted())
            assert watch.kills == 1 and proc.wait(timeout=10) == -9
        finally:
            proc.kill()


def test_a_look_reads_the_table_in_pieces_of_whole_lines_until_told_enough(tmp_path: Path) -> None:
    line = b"1: FLOCK  ADVISORY  WRITE 10 fe:00:5 0 EOF\n"
    listed = tmp_path / "locks"
    listed.write_bytes(line * (3 * _locks.STEP_BYTES // len(line)))
    pieces: list[int] = []

    def count(locks: list[_locks.Lock]) -> bool:
        pieces.append(len(locks))
        return False

    assert _locks.read_table(1 << 30, count, str(listed))
    assert sum(pieces) == 3 * _locks.STEP_BYTES // len(line) and len(pieces) >= 3
    assert not _locks.read_table(1 << 30, lambda locks: True, str(listed))  # enough at once
    assert not _locks.read_table(_locks.STEP_BYTES, lambda locks: False, str(listed))  # its budget


# Watch WATCHES files of /usr with one inotify descriptor, dup it DUPS times, fork a child
# (inheriting them all), take N POSIX locks on a pipe and 10 on a file, and say so. Each read
# of the inotify descriptor's fdinfo lists every watch, rebuilt by the kernel.
INOTIFY_HOLDER = r"""
import ctypes, fcntl, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
watches, dups, locks = (int(a) for a in sys.argv[1:4])
ifd, n = libc.inotify_init1(0), 0
for folder, _, files in os.walk("/usr"):
    for name in [folder] + [os.path.join(folder, f) for f in files]:
        if n < watches and libc.inotify_add_watch(ifd, name.encode(), 1) >= 0:
            n += 1
kept = [os.dup(ifd) for _ in range(dups)]
read, write = os.pipe()
for j in range(locks):
    fcntl.lockf(write, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 2 * j)
with open(sys.argv[4], "w") as f:
    for j in range(10):
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 2 * j)
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    print(ifd, write, flush=True)
    time.sleep(60)
"""


@pytest.fixture
def watcher(tmp_path: Path) -> Iterator[Callable[[int, int, int], tuple[int, int, int]]]:
    """Start a process that watches ``watches`` files with inotify, dup'd ``dups`` times, and
    holds ``locks`` POSIX locks on a pipe; (its pid, its inotify descriptor, the pipe's)."""
    procs: list[subprocess.Popen[str]] = []

    def start(watches: int, dups: int, locks: int) -> tuple[int, int, int]:
        locked = tmp_path / f"watched-{len(procs)}"
        argv = [sys.executable, "-c", INOTIFY_HOLDER, str(watches), str(dups), str(locks), str(locked)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
        procs.append(proc)
        assert proc.stdout is not None
        inotify, pipe = (int(word) for word in proc.stdout.readline().split())
        return proc.pid, inotify, pipe

    yield start
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_descriptors_that_name_no_file_are_not_read_but_their_files_are_said(
    watcher: Callable[[int, int, int], tuple[int, int, int]],
) -> None:
    """An inotify descriptor's fdinfo lists each of its watches, rebuilt by the kernel at
    each read: 150,000 of /usr made 16 MiB, dup'd 100 times into 20 processes, and a round
    of counting never ended. A pipe, a socket or an anon inode is not read; its locks
    (POSIX locks work on a pipe) are found through its file, in the lock table."""
    pid, inotify, pipe = watcher(10_000, 20, 50)
    assert len(Path(f"/proc/{pid}/fdinfo/{inotify}").read_bytes()) > MiB
    budget = _locks.Budget()
    listing = _locks.listed_by(pid, budget=budget)
    assert listing.posix == 10 and listing.whole  # the file's; the pipe's are not listed
    assert budget.spent[pid] < 64 << 10
    piped = os.stat(f"/proc/{pid}/fd/{pipe}")
    assert (f"{os.major(piped.st_dev):02x}:{os.minor(piped.st_dev):02x}", piped.st_ino) in listing.unread


def test_a_dup_of_a_file_is_read_once_and_another_open_file_of_it_counted_too(tmp_path: Path) -> None:
    path = tmp_path / "locked"
    first, second = os.open(path, os.O_RDWR | os.O_CREAT), os.open(path, os.O_RDWR)
    dups = [os.dup(first) for _ in range(20)]
    # what this process holds besides (a database another test of this worker left open
    # keeps its lock: CI 154 counted 102)
    before = _locks.held_by(os.getpid())
    try:
        for j in range(100):
            fcntl.lockf(first, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 2 * j)
        # another open file of the same path: its fdinfo lists the locks taken through it
        fcntl.lockf(second, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 1001)
        assert _locks.held_by(os.getpid()) - before == 101  # 2,101 counting each dup
        assert len(_locks.open_files(os.getpid(), [first, second, *dups])) == 2
    finally:
        for fd in (first, second, *dups):
            os.close(fd)


# Open FILES files without a lock, then take LOCKS on another; say so, and hold them.
MANY_FILES = r"""
import fcntl, os, resource, sys, time
files, locks = int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (files + 64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
kept = [os.open(f"{sys.argv[1]}-{i}", os.O_RDWR | os.O_CREAT) for i in range(files)]
with open(sys.argv[1], "w") as f:
    for j in range(locks):
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 2 * j)
    print("held", flush=True)
    time.sleep(60)
"""


@pytest.fixture
def many_files(tmp_path: Path) -> Iterator[Callable[[int, int], subprocess.Popen[str]]]:
    """Start a process with ``files`` open files and ``locks`` locks on one more."""
    procs: list[subprocess.Popen[str]] = []

    def start(files: int, locks: int) -> subprocess.Popen[str]:
        name = tmp_path / f"many-{len(procs)}"
        argv = [sys.executable, "-c", MANY_FILES, str(name), str(files), str(locks)]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
        assert procs[-1].stdout is not None and procs[-1].stdout.readline() == "held\n"
        return procs[-1]

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_a_group_whose_files_cost_more_than_a_round_is_read_over_rounds_never_killed_for_it(
    tmp_path: Path, many_files: Callable[[int, int], subprocess.Popen[str]]
) -> None:
    """One sandbox spends at most its budget of a round, then the next round reads on from
    there: 12,000 descriptors and no lock cost 0.2 s a round, and a process of them was
    killed as a hog. A hog of locks behind them is still found, within a few rounds."""
    idle, hog = many_files(2000, 0), many_files(2000, _locks.MOST + 1)
    watch = Watch(_group(tmp_path / "g", procs=[idle.pid, hog.pid]))
    rounds = 0
    while hog.poll() is None and rounds < 40:
        watch.hold_locks(_locks.Budget(most_bytes=64 << 10))  # ~300 descriptors a round
        assert watch.cost < 96 << 10
        rounds += 1
    assert hog.wait(timeout=10) == -9 and watch.kills == 1 and rounds > 2
    for _ in range(20):
        watch.hold_locks(_locks.Budget(most_bytes=64 << 10))
    assert watch.kills == 1 and idle.poll() is None


def test_opens_of_one_path_are_told_apart_within_the_budget(tmp_path: Path) -> None:
    """Telling dups from other opens of one path (``kcmp``) is charged to the budget: 19,000
    opens of one path, sorted at once, cost a round 0.5 s beyond it."""
    path = tmp_path / "opened"
    fds = [os.open(path, os.O_RDWR | os.O_CREAT) for _ in range(2000)]
    try:
        reading, budget = _locks.Reading(os.getpid()), _locks.Budget(most_bytes=64 << 10)
        reading.advance(budget)
        assert not reading.done and budget.spent[os.getpid()] < 96 << 10
        while not reading.done:
            reading.advance(_locks.Budget(most_bytes=64 << 10))
    finally:
        for fd in fds:
            os.close(fd)


def test_an_inotify_stall_in_one_group_leaves_another_groups_locks_held(
    tmp_path: Path,
    watcher: Callable[[int, int, int], tuple[int, int, int]],
    hold: Callable[[int], subprocess.Popen[str]],
) -> None:
    # A round read each inotify dup of each process in full: here 2 x 20 x 1 MiB and more
    pid, _, _ = watcher(10_000, 20, 50)
    stalling = Watch(_group(tmp_path / "a", procs=[pid, *_children(pid)]))
    hog = hold(_locks.MOST + 1)
    other = Watch(_group(tmp_path / "b", procs=[hog.pid]))
    assert _thrash._hold_locks([stalling, other], _locks.Unlisted())
    assert other.kills == 1 and hog.wait(timeout=10) == -9
    assert stalling.kills == 0 and _alive(pid)
    assert stalling.cost < MiB


@pytest.mark.alone  # the host's lock table: another worker's locks would be its newest
def test_posix_locks_on_a_pipe_are_found_in_the_lock_table(
    tmp_path: Path, watcher: Callable[[int, int, int], tuple[int, int, int]]
) -> None:
    pid, _, _ = watcher(10, 0, _locks.HIDDEN_MOST + 500)
    watch = Watch(_group(tmp_path / "g", procs=[pid]))
    assert _thrash._hold_locks([watch], _locks.Unlisted())
    assert watch.kills == 1 and _gone(pid)


def test_a_lock_round_that_never_ends_leaves_the_thrash_watch_working(
    tmp_path: Path, hold: Callable[[int], subprocess.Popen[str]]
) -> None:
    """Counting locks and sampling for thrashing are two threads: one round of counting
    (here a group whose process list never comes) stalls no thrash kill."""
    hold(_locks.MOST + 1)  # the host over the bound: every group's locks are counted
    stuck = tmp_path / "stuck"
    stuck.mkdir()
    os.mkfifo(stuck / "cgroup.procs")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    Path(f"/proc/{sleeper.pid}/oom_score_adj").write_text("1000")
    thrashing = tmp_path / "thrashing"
    thrashing.mkdir()
    (thrashing / "memory.max").write_text(f"{256 * MiB}\n")
    (thrashing / "memory.current").write_text(f"{255 * MiB}\n")
    (thrashing / "cgroup.procs").write_text(f"{sleeper.pid}\n")
    watches = [_thrash.watch(MemoryGroup(stuck, v2=True)), _thrash.watch(MemoryGroup(thrashing, v2=True))]
    try:
        refaults, deadline = 0, time.monotonic() + 3 * _thrash.SUSTAINED_S + 10
        while sleeper.poll() is None and time.monotonic() < deadline:
            refaults += 100 * _thrash.REFAULTS_PER_S  # far over the line, whatever the wait
            (thrashing / "memory.stat").write_text(f"workingset_refault_file {refaults}\n")
            time.sleep(_thrash.PERIOD_S / 5)
        assert sleeper.poll() == -9 and watches[1].kills == 1
    finally:
        for w in watches:
            w.close()
        sleeper.kill()
        sleeper.wait()
        # let the count's thread out of the list it waits for, empty
        writer = os.open(stuck / "cgroup.procs", os.O_RDWR)
        (stuck / "listed").write_text("")
        os.replace(stuck / "listed", stuck / "cgroup.procs")
        os.close(writer)
