"""A watch on sandboxes' memory cgroups: a sandbox that thrashes at its memory limit has its
largest process killed, as the limit's OOM killer would, instead of stalling to its timeout.

Without swap, a sandbox at its memory limit can give back only file pages, and those it holds
are mostly the code of the programs it runs (its interpreter and libraries, when the page
cache had not held them before). The kernel evicts them, the program faults them straight
back in from disk, reclaim counts that as progress, and the OOM killer never runs. Measured on
a 256 MiB Docker sandbox compiling 2 MB of Python after the page cache was dropped: 8-60 s of
stall and up to 65,000 disk reads, or the whole timeout; with the page cache warm, the OOM kill
came after 0.4 s.

One thread per host process samples every watched group twice a second. A group that is at its
limit (less than 1/64 of it, or 4 MiB, left) and refaulted (faulted back pages it had just
been made to give up) at least ``REFAULTS_PER_S`` times a second, in every sample for
``SUSTAINED_S`` seconds, is thrashing: the watch kills the process the kernel's OOM killer
would choose (``_kill_largest``: the most resident memory, plus ``oom_score_adj`` thousandths of
the limit; a command's processes run at 1000, so they go before the supervisor, and the
interpreter goes by its size), and counts the kill with the group's OOM kills. Callers then
see ``MemoryLimitExceeded`` or ``oom_killed``, as for the kernel's kill.

What it trades: a program whose working set is just over its limit, and that would have
crawled to its end re-reading its own files, is killed for memory instead; systemd-oomd makes
the same call on memory pressure. Both cgroup versions keep what it needs
(``workingset_refault_*`` in ``memory.stat``, the usage and the limit); per-cgroup pressure
(PSI) would be the finer measure, but cgroup v1 groups have none.

Another thread holds each watched group's POSIX file locks, kernel memory no cgroup charges,
to ``_locks.MOST``, every ``_locks.PERIOD_S`` (a thread of its own: a round of counting costs
what the sandboxes' descriptors make it, within a budget each, and must not delay a thrash
kill): a group over it loses its processes holding the most, counted apart
(``Watch.lock_kills``: no memory limit's); and the ``flock`` locks it holds through
mappings, which no descriptor lists, to ``_locks.HIDDEN_MOST`` (``_locks.Unlisted``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from stockade.sandbox import _locks

__all__ = ["MemoryGroup", "ThrashJudge", "Watch", "memory_group_of", "watch"]

PERIOD_S = 0.5
REFAULTS_PER_S = 256  # 1 MiB/s of 4 KiB pages read back; the thrashes measured did 100,000 and more
SUSTAINED_S = 3.0


@dataclass(frozen=True)
class MemoryGroup:
    """The folder of a memory cgroup, v1 (its memory controller's) or v2."""

    folder: Path
    v2: bool

    @property
    def oom_counter(self) -> Path:
        return self.folder / ("memory.events" if self.v2 else "memory.oom_control")

    @property
    def usage(self) -> Path:
        return self.folder / ("memory.current" if self.v2 else "memory.usage_in_bytes")

    @property
    def limit(self) -> Path:
        return self.folder / ("memory.max" if self.v2 else "memory.limit_in_bytes")


def memory_group_of(pid: int) -> MemoryGroup | None:
    """The memory cgroup ``pid`` is in, on this host (None if it has none, or is gone)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    entries = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    for _, controllers, path in entries:
        if "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (folder / "memory.oom_control").exists():
                return MemoryGroup(folder, v2=False)
    for _, controllers, path in entries:
        if controllers == "":
            folder = Path("/sys/fs/cgroup") / path.lstrip("/")
            if (folder / "memory.events").exists():
                return MemoryGroup(folder, v2=True)
    return None


class ThrashJudge:
    """Whether samples of (at the limit, refaults so far) taken at ``now`` say the group thrashes."""

    def __init__(self) -> None:
        self._last: tuple[float, int] | None = None
        self._since: float | None = None

    def thrashing(self, now: float, at_limit: bool, refaults: int) -> bool:
        if not at_limit:  # its refaults are not read then: the next sample at the limit starts over
            self._last = self._since = None
            return False
        last, self._last = self._last, (now, refaults)
        if last is None or now <= last[0]:
            return False
        if refaults - last[1] < REFAULTS_PER_S * (now - last[0]):
            self._since = None
            return False
        if self._since is None:
            self._since = last[0]
        if now - self._since < SUSTAINED_S:
            return False
        self._since = None  # a fresh stretch before the next kill
        return True


class Watch:
    """One watched group; ``kills`` counts the processes this watch killed: for thrashing
    (``thrash_kills``, reported as the memory limit's) and for locks (``lock_kills``, as
    themselves)."""

    def __init__(self, group: MemoryGroup) -> None:
        self.group = group
        # each thread of the watch counts its own kills: one for thrashing, one for locks
        self.thrash_kills = self.lock_kills = 0
        self._judge = ThrashJudge()
        # From the last hold_locks: every lock the group's descriptors list, by process those
        # that are not POSIX (its descriptors' flock locks and leases), and by process the
        # files of its descriptors not read (pipes, sockets, anon inodes).
        self.listed = 0
        self.flocks: dict[int, int] = {}
        self.unread: dict[int, frozenset[tuple[str, int]]] = {}
        self.cost = 0  # what the last round spent of its budget, in bytes (``_locks.Budget``)
        # Each process's last whole count, and the one being read over rounds (with where
        # the next round begins when none is: the process after the last one read).
        self._counted: dict[int, _locks.Listing] = {}
        self._reading: _locks.Reading | None = None
        self._next = 0

    @property
    def kills(self) -> int:
        return self.thrash_kills + self.lock_kills

    def close(self) -> None:
        _watcher.discard(self)

    def sample(self, now: float) -> None:
        counters = _counters(self.group)
        if counters is not None and self._judge.thrashing(now, *counters) and _kill_largest(self.group):
            self.thrash_kills += 1

    def hold_locks(self, budget: _locks.Budget | None = None) -> None:
        """Kill the group's processes holding the most POSIX locks while it holds over
        ``_locks.MOST``: as it counts them, so that a hog dies before the rest are read. A
        round reads what ``budget`` (``_locks.Budget()``) allows and goes on from there the
        next round (each process's last whole count stands for it meanwhile): a sandbox's
        descriptors cost it time, never a process (16,000 files and no lock cost 0.2 s a
        round, and a process of them was killed as a hog)."""
        budget = budget or _locks.Budget()
        procs = sorted(self.procs())
        self._counted = {pid: listing for pid, listing in self._counted.items() if pid in procs}
        if self._reading is not None and self._reading.pid not in procs:
            self._reading = None
        # from the process whose reading the last round left, then those after it, around
        first = self._reading.pid if self._reading is not None else self._next
        start = next((i for i, pid in enumerate(procs) if pid >= first), 0)
        for pid in procs[start:] + procs[:start]:
            reading = self._reading or _locks.Reading(pid)
            listing = reading.advance(budget, _locks.MOST)
            if listing.whole or listing.posix > _locks.MOST:
                self._counted[pid], self._reading = listing, None
            else:
                self._reading = reading
            self.cost = budget.spent.total()
            self._tally()
            held = {p: max(c.posix, listing.posix if p == pid else 0) for p, c in self._counted.items()}
            held.setdefault(pid, listing.posix)
            for victim in _locks.hoarders(held, held, _locks.MOST):
                held[victim] = 0
                self._counted.pop(victim, None)
                if _kill(self.group, victim):
                    self.lock_kills += 1
            if self._reading is not None:  # the budget is spent: the rest the next round
                return
        self._next = 0

    def _tally(self) -> None:
        """``listed``, ``flocks`` and ``unread`` from each process's last count (its reading
        so far where that lists more)."""
        counted = dict(self._counted)
        if self._reading is not None:
            partial = self._reading.listing()
            if self._reading.pid not in counted or partial.listed > counted[self._reading.pid].listed:
                counted[self._reading.pid] = partial
        self.listed = sum(c.listed for c in counted.values())
        self.flocks = {pid: c.listed - c.posix for pid, c in counted.items()}
        self.unread = {pid: c.unread for pid, c in counted.items()}

    def procs(self) -> list[int]:
        return [int(pid) for pid in _read(self.group.folder / "cgroup.procs").split()]

    def hiding(self, holders: Mapping[int, int]) -> bool:
        """Whether the group hides more than ``_locks.HIDDEN_MOST`` (``hold_hidden``)."""
        return sum(max(0, n - self.flocks.get(pid, 0)) for pid, n in holders.items()) > _locks.HIDDEN_MOST

    def hold_hidden(self, holders: Mapping[int, int]) -> int:
        """Kill the group's processes hiding the most locks (``holders``: those
        ``/proc/locks`` gives them, less those their descriptors list) while the group hides
        over ``_locks.HIDDEN_MOST``; the locks of the processes killed."""
        hidden = {pid: max(0, count - self.flocks.get(pid, 0)) for pid, count in holders.items()}
        freed = 0
        for victim in _locks.hoarders(hidden, hidden, _locks.HIDDEN_MOST):
            if _kill(self.group, victim):
                self.lock_kills += 1
                freed += holders[victim]
        return freed


def watch(group: MemoryGroup) -> Watch:
    """Start watching ``group``; the caller closes the watch when the group goes."""
    w = Watch(group)
    _watcher.add(w)
    return w


class _Watcher:
    """The threads that watch every group, started with the first, asleep while none is
    open: one samples for thrashing, one counts locks (a slow round of counting must not
    leave a thrashing sandbox unkilled, nor the reverse)."""

    def __init__(self) -> None:
        self.state = threading.Condition()
        self.watched: set[Watch] = set()
        self.threads: list[threading.Thread] = []
        self.unlisted = _locks.Unlisted()

    def add(self, w: Watch) -> None:
        with self.state:
            self.watched.add(w)
            if not self.threads:
                for name, loop in (
                    ("stockade-thrash-watch", self._sample),
                    ("stockade-lock-watch", self._count),
                ):
                    self.threads.append(threading.Thread(target=loop, name=name, daemon=True))
                    self.threads[-1].start()
            self.state.notify_all()

    def discard(self, w: Watch) -> None:
        with self.state:
            self.watched.discard(w)

    def _waiting(self) -> list[Watch]:
        with self.state:
            while not self.watched:
                self.state.wait()
            return list(self.watched)

    def _sample(self) -> None:
        while True:
            watched = self._waiting()
            now = time.monotonic()
            for w in watched:
                with contextlib.suppress(OSError, ValueError):  # a group removed meanwhile
                    w.sample(now)
            time.sleep(PERIOD_S)

    def _count(self) -> None:
        while True:
            watched = self._waiting()
            started = time.thread_time()
            killed = _hold_locks(watched, self.unlisted)
            # after a kill, the next round at once: a hog's other processes may be taking locks
            time.sleep(_locks.PERIOD_S if killed else _locks.pause(time.thread_time() - started))


_watcher = _Watcher()


def _hold_locks(watched: list[Watch], unlisted: _locks.Unlisted) -> bool:
    """The groups' locks counted, only when the host holds more than a sandbox may; whether
    a process was killed. ``/proc/locks`` is read only when ``unlisted`` says that many locks
    appeared that no watched descriptor lists (held through mappings, or the host's own)."""
    host = _locks.host_locks()
    if host <= _locks.MOST:
        return False
    kills = sum(w.lock_kills for w in watched)
    listed = 0
    for w in watched:
        with contextlib.suppress(OSError, ValueError):  # a group removed meanwhile
            w.hold_locks()
            listed += w.listed
    if sum(w.lock_kills for w in watched) > kills:
        # a POSIX hog was killed, its count cut short: the next round, at once, counts again
        # (the lock table is read when its locks have gone, not while they make it slow)
        return True
    if host != _locks.UNKNOWN and unlisted.due(host - listed):
        freed, whole = _hold_hidden(watched, host)
        if whole:  # else the next round looks again: what was not read may hide more
            unlisted.looked(host - listed, freed)
    return sum(w.lock_kills for w in watched) > kills


def _hold_hidden(watched: list[Watch], host: int) -> tuple[int, bool]:
    """Read the host's lock table until a watched group is found hiding over the bound (at
    most the whole of it, ``host`` locks' worth), give its flock locks and leases to the
    groups' processes, and kill those hiding the most; the locks of the processes killed
    (as counted), and whether the whole table was read."""
    groups: dict[int, list[int]] = {}
    for i, w in enumerate(watched):
        with contextlib.suppress(OSError, ValueError):
            groups[i] = w.procs()
    unread = {pid: files for w in watched for pid, files in w.unread.items()}
    # once each a look: the host's own locks name a few live takers many times
    maps, alive = functools.cache(_locks.mapped_files), functools.cache(_locks.running)
    held: dict[int, Counter[int]] = {i: Counter() for i in groups}

    def enough(locks: list[_locks.Lock]) -> bool:
        for i, found in _locks.hidden_holders(locks, groups, maps, alive, unread).items():
            held[i].update(found)
        return any(watched[i].hiding(held[i]) for i in groups)

    try:
        whole = _locks.read_table(host * _locks.LINE_BYTES, enough)
    except OSError:
        return 0, False
    return sum(watched[i].hold_hidden(held[i]) for i in groups), whole


def _read(path: Path) -> bytes:
    # os.read, not a text file: sampled twice a second per sandbox
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def _counters(group: MemoryGroup) -> tuple[bool, int] | None:
    """(whether the group is at its limit, pages it has refaulted), or None if it is gone.

    At its limit: less room left than ``_room(limit)``. (v1's ``memory.failcnt`` would say it
    exactly, but stays 0 here through a whole thrash.) Its ``memory.stat``, the longest read,
    only then: the judge needs refaults only at the limit."""
    try:
        used = int(_read(group.usage))
        cap = _read(group.limit).strip()
        if not (cap.isdigit() and int(cap) - used < _room(int(cap))):
            return False, 0
        fields = _fields(_read(group.folder / "memory.stat"))
    except OSError:
        return None
    prefix = b"" if group.v2 else b"total_"  # v1's own counters leave out its children
    return True, sum(fields.get(prefix + b"workingset_refault_" + kind, 0) for kind in (b"anon", b"file"))


def _room(limit: int) -> int:
    # A group this close to its limit reclaims on every charge; what it holds is all it uses.
    return max(limit // 64, 4 << 20)


def _fields(text: bytes) -> dict[bytes, int]:
    out: dict[bytes, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(b" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _kill_largest(group: MemoryGroup) -> bool:
    """SIGKILL the group's process the kernel's OOM killer would choose; whether one was killed.

    Its choice (``oom_badness``): the most resident memory, plus ``oom_score_adj``
    thousandths of the limit; never a process at -1000. (``/proc/PID/oom_score`` would say it,
    but scaled to the host's memory, not the group's: equal for every process of a sandbox.)"""
    procs = group.folder / "cgroup.procs"
    page = os.sysconf("SC_PAGE_SIZE")
    cap = _read(group.limit).strip()
    limit = int(cap) if cap.isdigit() else 0  # v2's "max": no limit, no adjustment by it
    best, best_points = 0, -1
    for pid in _read(procs).split():
        with contextlib.suppress(OSError, ValueError, IndexError):
            adj = int(_read(Path(f"/proc/{int(pid)}/oom_score_adj")))
            points = int(_read(Path(f"/proc/{int(pid)}/statm")).split()[1]) * page + adj * limit // 1000
            if adj > -1000 and points > best_points:
                best, best_points = int(pid), points
    return bool(best) and _kill(group, best)


def _kill(group: MemoryGroup, pid: int) -> bool:
    """SIGKILL ``pid`` if it is still a process of the group; whether it was killed."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        # The pid is pinned now; if it was reused by a process outside the group, it is not listed.
        if str(pid).encode() not in _read(group.folder / "cgroup.procs").split():
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)
