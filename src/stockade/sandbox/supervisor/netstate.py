"""Whether the sandbox's network namespace is back to fresh after a reset killed everything.

The kernel keeps sockets that no process holds: a TCP connection its code closed first
stays in TIME_WAIT for 60 s (its addresses and ports, chosen by code, readable in
/proc/net/tcp and taken for the next user's bind), and unix sockets put in flight inside
one another (SCM_RIGHTS to themselves) live, queues full and charged to the sandbox's
memory cgroup, until the kernel's unix garbage collector runs (seconds later). A reset kills
processes and cannot free those. So after it, every socket of the namespace must be one a
live process holds (the supervisor's, the zygote's: their inodes are in their fd tables) or
one that was there at start-up; anything else is state of the last user, and the reset fails
(the host replaces the sandbox). Tiers set ``net.ipv4.tcp_max_tw_buckets`` to 0 in the
namespace where they can (no TIME_WAIT kept at all); this check is what holds everywhere.

Standard library only.
"""

from __future__ import annotations

import os
import time

from baseline import sockets

# How long a reset waits for the kernel to let go of what the killed processes left (a
# connection's last FIN on the loopback, the unix garbage collector) before it gives up.
SETTLE_S = 1.0


def held() -> "set[int]":
    """The socket inodes every process we can see holds open."""
    inodes: "set[int]" = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def leftovers(
    at_start: "list[int]", unseen: "list[int]", host_names: "list[str]", settle_s: float = SETTLE_S
) -> "list[str]":
    """What the namespace holds beyond the sockets it had at start-up (``at_start``), those of
    the processes we can see and ``unseen`` (held by a live process whose fds we cannot
    read: the zygote), once the kernel had ``settle_s`` to let go of it; empty: fresh.

    ``host_names``: the names of the host's listening sockets the sandbox connects to (the
    egress proxy's). The host's end of each such connection is made in the connecting
    socket's namespace, ours, and bears the listener's name; the host holds it until its
    proxy is renewed, after this reset."""
    known = {*at_start, *unseen}
    deadline = time.monotonic() + settle_s
    while True:
        mine = held() | set(unseen) | _named(host_names)
        if _counted_clean(mine):
            return []
        left = _unheld(known, mine)
        if not left or time.monotonic() >= deadline:
            break
        _collect_unix_garbage()
        time.sleep(0.005)
    return [
        f"{count} {table} socket(s) no process holds are left in the network namespace"
        for table, count in left
    ]


def _named(names: "list[str]") -> "set[int]":
    """The unix sockets of the namespace that bear one of ``names``."""
    if not names:
        return set()
    wanted = {name.encode() for name in names}
    try:
        with open("/proc/net/unix", "rb") as fh:
            lines = fh.read().splitlines()[1:]
    except OSError:
        return set()
    found: "set[int]" = set()
    for line in lines:
        fields = line.split(None, 7)
        if len(fields) == 8 and fields[7] in wanted and fields[6].isdigit():
            found.add(int(fields[6]))
    return found


def _counted_clean(mine: "set[int]") -> bool:
    """Whether the namespace's own counts say it holds no socket but ``mine`` and no
    TIME_WAIT: /proc/net/sockstat, 0.1 ms, where reading /proc/net/tcp walks the host's
    whole connection table (1.2 ms each for tcp and tcp6). False when it cannot tell (no
    such file on gVisor): the tables decide."""
    try:
        with open("/proc/net/sockstat", "rb") as fh:
            lines = fh.read().split(b"\n")
    except OSError:
        return False
    used = tw = -1
    for line in lines:
        words = line.split()
        if words[:2] == [b"sockets:", b"used"] and len(words) > 2:
            used = int(words[2])
        elif words[:1] == [b"TCP:"] and b"tw" in words:
            tw = int(words[words.index(b"tw") + 1])
    return used == len(mine) and tw == 0


def _unheld(known: "set[int]", mine: "set[int]") -> "list[tuple[str, int]]":
    out = []
    for table, inodes in sockets().items():
        count = sum(1 for inode in inodes if inode not in known and (not inode or inode not in mine))
        if count:
            out.append((table, count))
    return out


def _collect_unix_garbage() -> None:
    """Have the kernel's unix garbage collector run now: it is scheduled when a unix socket
    is released while sockets are in flight, and our own pair closing is one."""
    import socket  # only here: a sandbox's start imports this module, and never needs it

    try:
        a, b = socket.socketpair()
    except OSError:
        return
    a.close()
    b.close()
