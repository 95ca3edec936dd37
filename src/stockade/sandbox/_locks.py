"""A bound on the POSIX file locks a sandbox holds: host memory no cgroup charges.

Every byte-range lock (``fcntl`` ``F_SETLK``/``F_SETLKW``, ``lockf``) on a range of its own is a
192-byte ``struct file_lock`` from the kernel's ``file_lock_cache``, which Linux charges to no
memory cgroup (the accounting 5.15 added was reverted in 6.3 for its cost) and counts against
nothing (``RLIMIT_LOCKS`` is ignored). Measured from outside: one process-tier sandbox at
``memory_mb=128`` held 3.6 million locks, 659 MiB of the host's unreclaimable slab, while its
cgroup showed 79 MiB; the default ``open_files`` allowed 16 million (3 GB).

So the host counts them, on the memory watch's thread (``_thrash``), every ``PERIOD_S``: first
the host's whole count, the lock cache's objects in use (``host_locks``: one 16 us read of
SLUB's sysfs); only when that is over ``MOST`` are the watched sandboxes' processes (their
memory group's ``cgroup.procs``) counted, each by its open files' ``fdinfo``, which lists
the locks the process holds on that file (``held_by``). A sandbox whose processes hold more
than ``MOST`` (768 KiB of the host's) loses its processes holding the most, one after another,
until the rest hold no more; each kill is counted with its OOM kills.

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
(``_seccomp``, ``confine.deny_calls``) refuse them with ``EINVAL``, as a kernel before 3.15
would, which their users handle (SQLite, glibc and Python's standard library use POSIX
locks). ``flock`` locks and leases are one per open file at most: ``open_files`` bounds them
(3 MiB at the default).

Between two rounds, code can take as many locks as its CPU allows (~100,000 a second from
Python at one core): that is what a sandbox can hold above ``MOST`` before the kill. Four
processes taking 100,000 each were stopped at 1-8 MiB in 0.2-0.4 s.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

__all__ = ["LOCK_BYTES", "MOST", "PERIOD_S", "held_by", "hoarders", "host_locks", "pause"]

LOCK_BYTES = 192  # sizeof(struct file_lock) on x86_64, the slab's object size
MOST = 4096  # POSIX locks a sandbox may hold: 768 KiB of the host's
PERIOD_S = 0.1
BUSY = 10  # the watch spends at most one part in this many of a CPU counting
# The lock cache's objects in use: SLUB's own count, else its line of /proc/slabinfo. A cache
# merged with others of its size (a link to ":0000192") counts theirs too: only ever more.
GAUGE = "/sys/kernel/slab/file_lock_cache/objects"
SLABINFO = "/proc/slabinfo"


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
    return 1 << 62


def held_by(pid: int, most: int = 1 << 62) -> int:
    """The POSIX locks ``pid`` holds: each of its open files' ``fdinfo`` lists its locks on
    that file (0 for a process gone). Counted no further once past ``most``: a hog's files
    are not all read before its kill."""
    folder = f"/proc/{pid}/fdinfo"
    try:
        fds = os.listdir(folder)
    except OSError:
        return 0
    held = 0
    for fd in fds:
        try:
            held += _read(f"{folder}/{fd}").count(b": POSIX ")
        except OSError:
            continue  # closed meanwhile
        if held > most:
            break
    return held


def pause(spent_s: float) -> float:
    """How long to wait before the next round, after one that took ``spent_s``: ``PERIOD_S``,
    longer when counting took more than a tenth of it (many sandboxes' files read)."""
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
