"""Process trees inside the sandbox, read from /proc: our children, and killing a whole tree
(scan /proc, SIGKILL, repeat until empty), fork bombs and gVisor's late clones included.

Apart from the shims (``reaper.py``) that start the processes: the supervisor's loop, a
command's end, the interpreter's and a reset kill trees without starting any. Standard
library only (C modules where it matters for start-up time).
"""

from __future__ import annotations

import _signal as signal
import errno
import os
import time

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Iterator, Optional


def _stats() -> "Iterator[tuple[int, int, int, bool]]":
    """(pid, parent, process group, alive) of each process, in pid order. A dead one, only
    waiting to be reaped, may still be the parent of live ones (seen on gVisor: a killed
    shell's child not yet given to the subreaper)."""
    for pid in sorted(int(name) for name in os.listdir("/proc") if name.isdigit()):
        try:  # three system calls, where open() and read() make nine
            fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            data = os.read(fd, 4096)
        except OSError:
            continue
        finally:
            os.close(fd)
        fields = data[data.rindex(b")") + 2 :].split()
        yield pid, int(fields[1]), int(fields[2]), fields[0] not in (b"Z", b"X") or _threads_live(pid)


def _threads_live(pid: int) -> bool:
    """Whether a process whose leader is a zombie still has threads that run: a leader that
    ended with ``SYS_exit`` alone (not ``exit_group``) leaves its other threads going, and its
    stat says Z. Taken for dead, such a process outlived every kill, a reset included, and
    read the next user's files and environment. Linux lists the live threads under its
    ``task`` (a true zombie: itself alone); gVisor lists none there but counts them in its
    status's ``Threads`` (a true zombie: 1)."""
    try:
        if len(os.listdir(f"/proc/{pid}/task")) > 1:
            return True
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh.read(8192).splitlines():
                if line.startswith(b"Threads:"):
                    return int(line.split()[1]) > 1
    except (OSError, ValueError, IndexError):
        pass
    return False


def own_children(childless: "frozenset[int]" = frozenset()) -> "Optional[set[int]]":
    """Our children, every thread's (``/proc/self/task/*/children``: two reads where a pass
    over /proc reads every process's stat), or None where the kernel has no such file.
    ``childless``: threads that never fork, whose file is not read (the compiled judge's:
    an orphan is adopted by the thread group's leader, never by another thread while it
    lives, so a thread that forks nothing never has a child)."""
    found: "set[int]" = set()
    try:
        for tid in os.listdir("/proc/self/task"):
            if int(tid) in childless:
                continue
            fd = os.open(f"/proc/self/task/{tid}/children", os.O_RDONLY | os.O_CLOEXEC)
            try:
                while True:
                    data = os.read(fd, 65536)
                    if not data:
                        break
                    found.update(int(pid) for pid in data.split())
            finally:
                os.close(fd)
    except (OSError, ValueError):  # no such file here (or a read cut a number: look the slow way)
        return None
    return found


def kill_descendants(
    root: int, group: int = 0, spare: int = 0, protect: "frozenset[int]" = frozenset()
) -> "list[int]":
    """SIGKILL every live descendant of ``root`` and, with ``group``, every member of that
    process group wherever it was adopted, with theirs; not ``spare`` (whose descendants die
    all the same), nor ``protect`` and theirs. Returns the pids signalled.

    Each is killed as the pass over /proc finds it, in pid order (a parent mostly comes
    before its children; the rest are killed at the end of the pass): beside a fork bomb on
    gVisor each read waits its turn behind the bomb's processes (a pass of 60 took up to 3 s
    when it killed at its end), fewer of them with each kill.
    """
    doomed = {root}
    tree: "dict[int, list[int]]" = {}
    dead: "set[int]" = set()
    killed: "list[int]" = []

    def kill(pid: int) -> None:
        doomed.add(pid)
        if pid != spare and pid not in dead:
            killed.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    for pid, parent, pgrp, alive in _stats():
        tree.setdefault(parent, []).append(pid)
        if not alive:
            dead.add(pid)
        if pid != root and pid not in protect and (parent in doomed or (group and pgrp == group)):
            kill(pid)
    todo = list(doomed)
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in doomed and child not in protect:
                kill(child)
                todo.append(child)
    return killed


def kill_group(root: int) -> bool:
    """SIGKILL the process group ``root`` leads, in one call: a shim leads its own session,
    so this takes most of its tree at once. First thing at a deadline: on gVisor every process
    inside is scheduled alike (no priority is honoured), so beside 63 spinning forks each of
    the supervisor's system calls waits its turn, and what it does before this one delays it.
    Whether ``root`` leads a group."""
    try:
        if os.getpgid(root) != root:
            return False
        os.killpg(root, signal.SIGKILL)
    except OSError:
        return False
    return True


def kill_tree(root: int, include_root: bool, spare: int = 0, *, settle: bool = False) -> None:
    """SIGKILL every descendant of ``root`` until none is left (fork bombs included), but
    ``spare`` (whose own descendants die all the same). ``settle`` (a reset, whose next
    user must find nothing): done only when a scan a millisecond after an empty one finds
    none too, for a clone the kill overtook that gVisor completes a moment later, its child
    adopted by ``root`` after the scan (a pid hopper outlived a reset in CI run 134, under
    load).

    A process forked between a scan and the kill is the child of a killed process, so it
    is reparented to the subreaper (``root``) and found by the next scan. With ``root``
    killed too, and leading its group, the group is killed again each round and its members
    are found wherever they went: gVisor's kill of a group misses a child being forked at
    that moment (measured: up to 21 of a bomb's 64 processes lived on after one), and with
    ``root`` dead that child is adopted outside its tree.
    """
    group = root if include_root and kill_group(root) else 0
    settled = not settle
    for _ in range(1000):
        if group:
            try:
                os.killpg(group, signal.SIGKILL)
            except OSError:  # nobody is left in it
                group = 0
        found = kill_descendants(root, group, spare)
        if not found:
            if settled:
                break
            settled = True
            time.sleep(0.001)
            continue
        settled = not settle
        wait_gone(found, 0.001)
    if include_root:
        try:
            os.kill(root, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_gone(pids: "list[int]", timeout: float) -> None:
    """Until the processes killed in ``pids`` have exited, or ``timeout``: the next scan then
    finds what they forked before they died. A pidfd says when (a killed process takes
    0.1-0.3 ms to go, which a sleep rounded up to a millisecond per reset); where there is
    none (no os.pidfd_open, or a kernel without it), a sleep."""
    fds: "list[int]" = []
    try:
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is None:
            raise OSError(errno.ENOSYS, "no pidfd_open")
        for pid in pids[:64]:
            try:
                fds.append(pidfd_open(pid))
            except ProcessLookupError:  # gone already
                continue
    except OSError:  # no pidfds here
        for fd in fds:
            os.close(fd)
        time.sleep(timeout)
        return
    if not fds:
        return
    import select

    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    try:
        left = len(fds)
        while left:
            wait = deadline - time.monotonic()
            if wait <= 0:
                break
            for fd, _ in poller.poll(wait * 1000):
                poller.unregister(fd)
                left -= 1
    finally:
        for fd in fds:
            os.close(fd)
