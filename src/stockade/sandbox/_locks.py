"""A bound on the POSIX file locks a sandbox holds: host memory no cgroup charges.

Every byte-range lock (``fcntl`` ``F_SETLK``/``F_SETLKW``, ``lockf``) on a range of its own is a
192-byte ``struct file_lock`` from the kernel's ``file_lock_cache``, which Linux charges to no
memory cgroup (the accounting 5.15 added was reverted in 6.3 for its cost) and counts against
nothing (``RLIMIT_LOCKS`` is ignored). Measured from outside: one process-tier sandbox at
``memory_mb=128`` held 3.6 million locks, 659 MiB of the host's unreclaimable slab, while its
cgroup showed 79 MiB; the default ``open_files`` allowed 16 million (3 GB).

So the host counts them, on a thread of the memory watch's (``_thrash``; its own, so that a
slow count never delays a thrash kill), every ``PERIOD_S``: first the host's whole count, the
lock cache's objects in use (``host_locks``: one 16 us read of SLUB's sysfs); only when that
is over ``MOST`` are the watched sandboxes' processes (their memory group's ``cgroup.procs``)
counted, each by its open files' ``fdinfo``, which lists the locks the process holds on that
file (``listed_by``). A sandbox whose processes hold more than ``MOST`` (768 KiB of the
host's) loses its processes holding the most, one after another, until the rest hold no
more; each kill is counted as a lock kill (``locks_killed``, never ``oom_killed``).

Reading a sandbox's ``fdinfo`` is work the sandbox chooses, and one round serves every
sandbox of the host process: an inotify descriptor's lists each of its watches, rebuilt by
the kernel at each read (150,000 of ``/usr``: 16 MiB), and one dup'd 100 times into 20
processes made a round that never ended: the watch took 0.6-0.9 of a core, and a hog in
another sandbox held 100,000 locks until its command's timeout. So only a descriptor whose
link is a path is read (a file, a device, a memfd), one per open file (``open_files``:
``kcmp`` says which descriptors are dups, which list the same locks); pipes, sockets and
anon inodes (epoll, inotify, fanotify, io_uring, eventfd...) are not, but they take locks
too, so their files are kept (``Listing.unread``) for the look at the lock table below. And
a round spends at most ``ROUND_BYTES`` and ``ROUND_CPU_S`` of its thread's CPU on one sandbox
(``Budget``, ``kcmp`` calls included; a sandbox at ``MOST`` locks costs ~300 KiB): past
that, the next round reads on from where it stopped (``Reading``). A kill is only ever for
locks counted: killing the costliest process instead killed lock-free sandboxes (12,000
descriptors cost a round 0.2 s) whenever the host was over ``MOST``, which another tenant
holding its allowed ``MOST`` makes it.

A process's descriptor table is its thread group leader's, the one ``cgroup.procs`` lists: a
thread with a table of its own (``clone`` with ``CLONE_THREAD``, without ``CLONE_FILES``) held
300,000 locks unseen, so the sandbox's filters refuse making one.

Not ``/proc/locks``, which lists every lock of the host in one table: each ``read`` returns
one 4 KiB page, and for each the kernel walks its lists from the start holding the host's
``file_rwsem`` for writing (every lock call on the host waits): 0.7 ms at 2,000 locks,
5-10 ms at 8,000, 0.4-1.2 s at 50,000, and a read begun while a hog took 100,000 locks a
second lasted 5 s, the hog at 400,000 before it ended. ``fdinfo`` costs a read per open file
of the sandbox's and a line per lock it holds, under that file's own lock only. ``MOST`` is
fixed and small: SQLite holds a handful, other users of ``lockf`` a few each. The watch
takes at most a tenth of a CPU (``pause``) but right after a kill (a hog's other processes
may be taking locks): a host whose own locks keep the count over ``MOST`` has its sandboxes'
files read every round, less often when they are many.

A lock is found through its owner: a POSIX lock belongs to a descriptor table, and goes
when its process closes any descriptor of the file, so it is listed by an open file of a
process of the sandbox as long as it lives. An OFD lock (``F_OFD_*``) belongs to an open file,
which can outlive every process (one in flight in a socket's queue): the sandbox's filters
(``_seccomp``, ``callfilters.deny_calls``) refuse them with ``EINVAL``, as a kernel before 3.15
would, which their users handle (SQLite, glibc and Python's standard library use POSIX
locks).

``flock`` locks and leases belong to an open file too, one at most each, and an open file
lives as long as anything refers to it: a descriptor, and also a mapping of it (``mmap`` then
``close``: the file stays open with its lock, listed by no descriptor's ``fdinfo``, outside
``open_files``; measured, 200,000 from one 256 MiB sandbox, 38 MB of the host's). Mapped files
are bounded only by memory (``_filetable``), and the locks on them by nothing, so the same
round also finds locks no descriptor lists: the host's count less every lock the watched
sandboxes' ``fdinfo`` listed is what nobody listed (``unlisted``: the host's own processes'
locks, objects of caches merged with the lock cache, and locks held through mappings). When
that has grown by more than ``HIDDEN_MOST`` since the last look (``Unlisted``), the host reads
``/proc/locks`` (``read_table``) until a sandbox is found hiding more, at most the whole table
(``LINE_BYTES`` a lock of the host's count); never a sample scaled to the whole, which the
table's order lets a sandbox bias (each CPU's locks are listed in turn: 4,090 allowed ones at
the longest lines on CPU 0 filled the 256 KiB read, and 300,000 on a pipe taken on CPU 1 were
never seen). It gives each ``flock`` lock and lease, and each POSIX lock on a file of a
descriptor not read (a pipe's, an anon inode's), to a sandbox: to its taker (the pid it lists)
when that is a process of the sandbox, else, when its taker no longer runs (a child holding
the mapping), to a process of the sandbox that maps the file (``/proc/PID/maps`` names each
mapping's device and inode, as ``/proc/locks`` does). A process holding more such locks than
its descriptors list is hiding the rest; a sandbox hiding more than ``HIDDEN_MOST`` (768 KiB)
loses its processes hiding the most, as for POSIX locks. That read is costly as said above,
but it is taken only when that many locks appeared unlisted, and it ends with a kill or, once
the whole table was read, with the new count as the baseline: a host whose own locks grow has
it read again after each ``HIDDEN_MOST`` more, and one whose own locks drop lets a sandbox
hide that many more before the next look. A shared descriptor (one open file in several
processes' tables) is listed once per process: that can hide as many locks as the sandbox's
descriptors, which ``open_files`` bounds.

Between two rounds, code can take as many locks as its CPU allows (~100,000 a second from
Python at one core): that is what a sandbox can hold above ``MOST`` before the kill. Four
processes taking 100,000 each were stopped at 1-8 MiB in 0.2-0.4 s.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "HIDDEN_MOST",
    "LOCK_BYTES",
    "MOST",
    "PERIOD_S",
    "ROUND_BYTES",
    "ROUND_CPU_S",
    "Budget",
    "Listing",
    "Lock",
    "Reading",
    "Unlisted",
    "held_by",
    "hidden_holders",
    "hoarders",
    "host_locks",
    "listed_by",
    "mapped_files",
    "open_files",
    "pause",
    "read_table",
    "running",
    "table",
]

LOCK_BYTES = 192  # sizeof(struct file_lock) on x86_64, the slab's object size
MOST = 4096  # POSIX locks a sandbox may hold: 768 KiB of the host's
# flock locks and leases a sandbox may hold that no descriptor of it lists (through mappings)
HIDDEN_MOST = 4096
# A line of /proc/locks for one lock is at most this long ("1234567: POSIX  ADVISORY  WRITE",
# a pid, a device and an inode, two offsets of 19 digits: ~115 bytes): a look reads at most
# this much a lock of the host's count, its whole table.
LINE_BYTES = 128
# A look at /proc/locks attributes its locks a piece of this much at a time, and stops once a
# sandbox is found over the bound. Each read of the table returns one page and walks its
# lists from their start, under the lock every lock call of the host takes: the whole table
# costs quadratic time in its length (a look begun at 20,000 locks lasted 4.6 s while a hog
# went on to 92,000); this much costs ~2 ms.
STEP_BYTES = 256 * 1024
UNKNOWN = 1 << 62  # host_locks when the host's count cannot be read
PERIOD_S = 0.1
BUSY = 10  # the watch spends at most one part in this many of a CPU counting
# The lock cache's objects in use: SLUB's own count, else its line of /proc/slabinfo. A cache
# merged with others of its size (a link to ":0000192") counts theirs too: only ever more.
GAUGE = "/sys/kernel/slab/file_lock_cache/objects"
SLABINFO = "/proc/slabinfo"
# What one round may spend reading one sandbox's fdinfo, the kernel's work building it
# included (its CPU is the reading thread's): 4,096 locks list ~300 KiB, 16,384 descriptors
# (``open_files``) ~1.6 MiB. A sandbox costing more is read on the next round.
ROUND_BYTES = 8 << 20
ROUND_CPU_S = 2 * PERIOD_S
DESCRIPTOR_BYTES = 128  # what a descriptor costs beyond its fdinfo (its link read), as bytes
KCMP_BYTES = 16  # what a kcmp call costs, as bytes (the budget's CPU counts it too)
# kcmp(2), which tells whether two descriptors are one open file: its number by machine
KCMP = {"x86_64": 312, "aarch64": 272, "riscv64": 272}.get(platform.machine())
KCMP_FILE = 0
_libc = ctypes.CDLL(None, use_errno=True)


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parts = []
        while chunk := os.read(fd, 1 << 16):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def host_locks() -> int:
    """How many file locks the host holds, at least (unknown: more than any bound)."""
    try:
        return int(_read(GAUGE).split()[0])
    except (OSError, ValueError, IndexError):
        pass
    try:
        for line in _read(SLABINFO).splitlines():
            if line.startswith(b"file_lock_cache "):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return UNKNOWN


def held_by(pid: int, most: int = UNKNOWN) -> int:
    """The POSIX locks ``pid`` holds on the files its descriptors name (0 for a process
    gone). Counted no further once past ``most``: a hog's files are not all read before its
    kill."""
    return listed_by(pid, most).posix


class Budget:
    """What one round may still spend reading one sandbox's fdinfo (``ROUND_BYTES``, and
    ``ROUND_CPU_S`` of the reading thread's CPU, ``kcmp`` calls included), and what each of
    its processes cost."""

    def __init__(self, most_bytes: int = ROUND_BYTES, most_cpu_s: float = ROUND_CPU_S) -> None:
        self.bytes_left = most_bytes
        self._until = time.thread_time() + most_cpu_s
        self.spent: Counter[int] = Counter()

    def spend(self, pid: int, size: int) -> bool:
        """Count ``size`` bytes read for ``pid``; whether the budget still holds."""
        self.spent[pid] += size
        self.bytes_left -= size
        return self.bytes_left >= 0 and time.thread_time() <= self._until


@dataclass(frozen=True)
class Listing:
    """What a process's descriptors list: its POSIX locks, all its locks (with its ``flock``
    locks and leases), the files of the descriptors not read (``unread``, as (device,
    inode): pipes, sockets, anon inodes), and whether every other one was read (``whole``:
    not when the budget ran out, the rest left for the next round)."""

    posix: int = 0
    listed: int = 0
    unread: frozenset[tuple[str, int]] = field(default_factory=frozenset)
    whole: bool = True


class Reading:
    """One pass over a process's descriptors, which may take several rounds: each round reads
    on from where the last one's budget ran out (at least one descriptor a round), so that a
    process with many descriptors and no locks costs time, never its life, and every
    descriptor is read within a number of rounds its count bounds.

    Only files a path names are read: a pipe's, a socket's or an anon inode's (epoll,
    inotify, fanotify, io_uring, eventfd...) can list a whole collection, rebuilt by the
    kernel at each read (an inotify descriptor watching 150,000 files lists 16 MiB: dup'd 100
    times into 20 processes, a round never ended, and no sandbox's locks were held
    meanwhile). Those hold locks too (POSIX and ``flock``, on a pipe or an eventfd as on a
    file): their files are said instead (``unread``), for the look at the lock table to find
    them. Each open file is read once (``kcmp`` against those of its path read so far)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fds: list[int] | None = None  # its descriptors when the pass began, in order
        self._at = 0
        self._read: dict[str, list[int]] = {}  # by path, the descriptors read, in kcmp's order
        self.posix = self.listed = 0
        self.unread: set[tuple[str, int]] = set()

    @property
    def done(self) -> bool:
        return self._fds is not None and self._at >= len(self._fds)

    def listing(self) -> Listing:
        return Listing(self.posix, self.listed, frozenset(self.unread), self.done)

    def advance(self, budget: Budget | None = None, most: int = UNKNOWN) -> Listing:
        """Read on until done, ``budget`` is spent, or past ``most`` POSIX locks."""
        folder = f"/proc/{self.pid}"
        if self._fds is None:
            try:
                self._fds = sorted(int(entry) for entry in os.listdir(f"{folder}/fd"))
            except OSError:
                self._fds = []  # gone
            if budget is not None:
                budget.spend(self.pid, len(self._fds) * 8)
        while self._at < len(self._fds):
            fd = self._fds[self._at]
            self._at += 1
            size = DESCRIPTOR_BYTES + self._read_one(folder, fd, budget)
            if self.posix > most:
                break
            if budget is not None and not budget.spend(self.pid, size):
                break
        return self.listing()

    def _read_one(self, folder: str, fd: int, budget: Budget | None) -> int:
        """Count ``fd``'s locks unless a dup of a descriptor read was; the bytes it cost."""
        try:
            link = os.readlink(f"{folder}/fd/{fd}")
            if not link.startswith("/"):
                st = os.stat(f"{folder}/fd/{fd}")
                self.unread.add((f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", st.st_ino))
                return 0
        except OSError:
            return 0  # closed meanwhile
        same = self._read.setdefault(link, [])
        place, compared = _place(self.pid, same, fd)
        if budget is not None:
            budget.spend(self.pid, compared * KCMP_BYTES)
        if place is None:
            return 0  # a dup: its locks are listed by the one read
        try:
            info = _read(f"{folder}/fdinfo/{fd}")
        except OSError:
            return 0
        same.insert(place, fd)
        self.posix += info.count(b": POSIX ")
        self.listed += info.count(b"lock:\t")
        return len(info)


def listed_by(pid: int, most: int = UNKNOWN, budget: Budget | None = None) -> Listing:
    """The locks ``pid``'s descriptors list (``Reading``), as far as ``budget`` lets one
    round read, and no further once past ``most`` POSIX."""
    return Reading(pid).advance(budget, most)


def _kcmp(pid: int, a: int, b: int) -> int:
    """-1, 0 or 1 as ``pid``'s descriptor ``a``'s open file is before, is, or is after ``b``'s
    (in an order of the kernel's)."""
    assert KCMP is not None
    answer = _libc.syscall(KCMP, pid, pid, KCMP_FILE, a, b)
    if answer not in (0, 1, 2):  # -1: an error; 3: no order (never for files)
        raise OSError(ctypes.get_errno(), "kcmp")
    return int(answer and (-1 if answer == 1 else 1))


def _place(pid: int, read: list[int], fd: int) -> tuple[int | None, int]:
    """Where ``fd`` goes among ``read`` (``pid``'s descriptors of one path, in the kernel's
    order of open files), None if it is a dup of one of them; and how many ``kcmp`` calls
    that took (a binary search: 19,000 opens of one path sorted at once cost 0.5 s a round,
    uncharged). Never a dup where the kernel does not say (no ``kcmp``, a descriptor
    closed meanwhile)."""
    if KCMP is None:
        return len(read), 0
    low, high, compared = 0, len(read), 0
    try:
        while low < high:
            middle = (low + high) // 2
            compared += 1
            order = _kcmp(pid, read[middle], fd)
            if order == 0:
                return None, compared
            low, high = (middle + 1, high) if order < 0 else (low, middle)
    except OSError:
        return len(read), compared
    return low, compared


def open_files(pid: int, fds: list[int]) -> list[int]:
    """One descriptor of each open file among ``fds`` (``pid``'s): a dup (``dup``, ``fork``'s
    copy) lists the same locks as its original, and read again would count them again (and
    cost as much again). All of them where the kernel does not say (no ``kcmp``)."""
    read: list[int] = []
    for fd in fds:
        place, _ = _place(pid, read, fd)
        if place is not None:
            read.insert(place, fd)
    return sorted(read, key=fds.index)


@dataclass(frozen=True)
class Lock:
    """One lock of ``/proc/locks``: its kind (POSIX, FLOCK, LEASE, OFDLCK...), the pid that
    took it (-1 for an OFD lock) and its file, as (device "maj:min" in hex, inode)."""

    kind: str
    pid: int
    file: tuple[str, int]


def table(text: bytes) -> list[Lock]:
    """The locks of ``text``, lines of ``/proc/locks``; waiters (``->``) left out: each is a
    task asleep on a lock, bounded by tasks."""
    locks = []
    for line in text.decode("ascii", "replace").splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":
            continue
        device, _, inode = fields[5].rpartition(":")
        try:
            locks.append(Lock(fields[1], int(fields[4]), (device, int(inode))))
        except ValueError:
            continue
    return locks


def read_table(most: int, enough: Callable[[list[Lock]], bool], path: str = "/proc/locks") -> bool:
    """Give ``enough`` the host's locks (``table``), piece by piece (``STEP_BYTES``, whole
    lines), until it says it has enough, the table ends, or ``most`` bytes were read; whether
    the whole table was. Not a sample scaled to the whole: the table lists each CPU's locks
    in turn, so a sandbox taking 4,090 on one CPU at the largest offsets filled the first
    256 KiB a look read then, while its 300,000 on a pipe were listed after them, unseen."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        rest, size = b"", 0
        while True:
            parts, got, ended = [rest], 0, False
            while got < STEP_BYTES:
                if not (chunk := os.read(fd, 1 << 16)):
                    ended = True
                    break
                parts.append(chunk)
                got += len(chunk)
            text, size = b"".join(parts), size + got
            cut = len(text) if ended else text.rfind(b"\n") + 1
            text, rest = text[:cut], text[cut:]
            if enough(table(text)) or ended:
                return ended
            if size >= most:
                return False
    finally:
        os.close(fd)


def mapped_files(pid: int) -> set[tuple[str, int]]:
    """The files ``pid`` maps, as (device, inode) from ``/proc/PID/maps`` (empty if gone)."""
    try:
        text = _read(f"/proc/{pid}/maps").decode("ascii", "replace")
    except OSError:
        return set()
    files = set()
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) >= 5 and fields[4] != "0":
            files.add((fields[3], int(fields[4])))
    return files


def running(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie does not (a taker that exited, its parent not
    waiting for it, has left its cgroup, and its locks live on in its children's mappings)."""
    try:
        stat = _read(f"/proc/{pid}/stat")
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def hidden_holders(
    locks: Iterable[Lock],
    groups: Mapping[int, Iterable[int]],
    maps: Callable[[int], set[tuple[str, int]]] = mapped_files,
    alive: Callable[[int], bool] = running,
    unread: Mapping[int, frozenset[tuple[str, int]]] | None = None,
) -> dict[int, Counter[int]]:
    """The locks of ``locks`` no descriptor's ``fdinfo`` listed, that each group's processes
    hold, by group (a key of ``groups``, whose values are its pids) and process: its
    ``flock`` locks and leases, and its POSIX locks on the files of ``unread`` (by pid: its
    descriptors not read, a pipe's or an anon inode's). A ``flock`` lock or lease is its
    taker's when that is a process of a group; else, when its taker is gone, a process of a
    group that maps the file (``maps`` read only then: its mapping kept by a child). A lock a
    live process of the host took is that process's: the host's daemons hold a few, and each
    one sent the watch through every sandbox process's maps (60,000 mappings each: a round
    of seconds, the next round nine times later, and a hog's locks unbounded meanwhile).
    OFD locks are not here."""
    owner = {pid: key for key, pids in groups.items() for pid in pids}
    unread = unread or {}
    held: dict[int, Counter[int]] = {key: Counter() for key in groups}
    left = []
    for lock in locks:
        if lock.kind == "OFDLCK":
            continue
        if lock.kind == "POSIX":
            if lock.pid in owner and lock.file in unread.get(lock.pid, ()):
                held[owner[lock.pid]][lock.pid] += 1
        elif lock.pid in owner:
            held[owner[lock.pid]][lock.pid] += 1
        elif not alive(lock.pid):
            left.append(lock)
    if left:
        mapper: dict[tuple[str, int], int] = {}
        for pid in owner:
            for file in maps(pid):
                mapper.setdefault(file, pid)
        for lock in left:
            if (holder := mapper.get(lock.file)) is not None:
                held[owner[holder]][holder] += 1
    return held


class Unlisted:
    """When to read ``/proc/locks``: the locks no watched descriptor listed (the host's count
    less those listed) grew by more than ``HIDDEN_MOST`` since the last read; the count
    after that read (less the locks it had killed) is the new baseline, and a lower count
    since lowers it."""

    def __init__(self) -> None:
        self.baseline = 0

    def due(self, unlisted: int) -> bool:
        self.baseline = min(self.baseline, unlisted)
        return unlisted - self.baseline > HIDDEN_MOST

    def looked(self, unlisted: int, freed: int) -> None:
        self.baseline = max(0, unlisted - freed)


def pause(spent_s: float) -> float:
    """How long to wait before the next round, after one that took ``spent_s`` of its thread's
    CPU (the kernel's, building the files read, included): ``PERIOD_S``, longer when counting
    took more than a tenth of it (many sandboxes' files read)."""
    return max(PERIOD_S, spent_s * (BUSY - 1))


def hoarders(held: Mapping[int, int], procs: Iterable[int], most: int) -> list[int]:
    """The processes of ``procs`` to kill, holders of the most locks first, so that the rest
    hold at most ``most``; none while they do."""
    mine = sorted(((held.get(pid, 0), pid) for pid in set(procs) if held.get(pid, 0)), reverse=True)
    total = sum(count for count, _ in mine)
    chosen = []
    for count, pid in mine:
        if total <= most:
            break
        chosen.append(pid)
        total -= count
    return chosen
