"""Per-sandbox cgroups: memory, CPU and process-count limits, OOM counting, and kill-all.

cgroup v2 where the unified hierarchy has the controllers, v1 (one directory per
controller) otherwise. Only usable with write access to the hierarchy (root, or a
delegated subtree); callers fall back to rlimits and say so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stockade.sandbox import _thrash
from stockade.types import Mechanism

ROOT = Path("/sys/fs/cgroup")
PARENT = "stockade"
_V1_CONTROLLERS = ("memory", "pids", "cpu")

# Joins each cgroup (writing 0 moves the writer itself), then becomes the rest of the chain:
# every process the chain starts is born inside. A shell, not preexec_fn: forking a threaded
# Python and running Python code before exec can deadlock.
_ENTER = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo 0 > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
# The file the shell writes to. Moving a whole process (cgroup.procs) takes the kernel's
# global threadgroup lock for writing, which waits for an RCU grace period: 6-18 ms on this
# kind of host, the largest single cost of a cold start. On cgroup v1 the shell moves its one
# thread instead (``tasks``): the kernel skips that lock when a thread moves itself, and a
# single-threaded process whose only thread is inside is inside (0.6 ms for three groups).
# cgroup v2 moves threads only within a threaded subtree: there, cgroup.procs.
_JOIN_FILE = {Mechanism.CGROUP_V1: "tasks", Mechanism.CGROUP_V2: "cgroup.procs"}


def tcp_buffer_bytes(memory_bytes: int) -> int:
    """What a sandbox's TCP buffers may hold where its memory limit does not count them
    (cgroup v1): an eighth of its memory, and no less than 16 MiB (a local test server's
    buffers fit)."""
    return max(16 * 1024 * 1024, memory_bytes // 8)


@dataclass(frozen=True)
class CgroupSupport:
    mechanism: Mechanism  # CGROUP_V2, CGROUP_V1 or NONE
    detail: str


def detect() -> CgroupSupport:
    unified = ROOT / "cgroup.controllers"
    if unified.exists():
        have = set(unified.read_text().split())
        missing = {"memory", "pids", "cpu"} - have
        if missing:
            return CgroupSupport(Mechanism.NONE, f"cgroup v2 lacks controllers {sorted(missing)}")
        if not os.access(ROOT, os.W_OK):
            return CgroupSupport(Mechanism.NONE, "cgroup v2 hierarchy is not writable (run as root)")
        return CgroupSupport(Mechanism.CGROUP_V2, "cgroup v2")
    if all((ROOT / c / "cgroup.procs").exists() for c in _V1_CONTROLLERS):
        if not all(os.access(ROOT / c, os.W_OK) for c in _V1_CONTROLLERS):
            return CgroupSupport(Mechanism.NONE, "cgroup v1 hierarchy is not writable (run as root)")
        return CgroupSupport(Mechanism.CGROUP_V1, "cgroup v1 (memory, pids, cpu)")
    return CgroupSupport(Mechanism.NONE, "no cgroup hierarchy with memory, pids and cpu")


class Cgroup:
    """The cgroup(s) of one sandbox.

    Its creator holds a shared flock on the group's (first) folder until ``remove``: between
    its creation and the sandbox's first process entering it, the group is empty, and the
    garbage collection of another state folder must not take it for a crashed creator's
    (``collect``). The lock is taken under a shared lock on the parent folder, which that
    collection takes exclusively around each removal: no instant is left between the group's
    folder appearing and its lock being held. ``create=False``: an existing group, to inspect
    or remove (no folder made, no lock held).
    """

    def __init__(self, mechanism: Mechanism, name: str, *, create: bool = True) -> None:
        self.mechanism = mechanism
        self._hold: int | None = None
        self._thrash: _thrash.Watch | None = None
        if mechanism is Mechanism.CGROUP_V2:
            parent = ROOT / PARENT
            if create and not parent.exists():
                parent.mkdir(exist_ok=True)
            if create:
                _enable_v2(ROOT)
                _enable_v2(parent)
            self.dirs = [parent / name]
        else:
            self.dirs = [ROOT / c / PARENT / name for c in _V1_CONTROLLERS]
        if create:
            self.dirs[0].parent.mkdir(parents=True, exist_ok=True)
            parent_fd = _locked(self.dirs[0].parent, fcntl.LOCK_SH)
            try:
                for d in self.dirs:
                    d.mkdir(parents=True, exist_ok=True)
                self._hold = _locked(self.dirs[0], fcntl.LOCK_SH)
            finally:
                os.close(parent_fd)
        v2 = mechanism is Mechanism.CGROUP_V2
        self.memory = _thrash.MemoryGroup(self.dirs[0] if v2 else self._v1("memory"), v2=v2)
        # Read before and after every call of the sandbox's: its creator keeps it open and
        # reads it again from the start (a Path and a text file cost 55 us a read, an open,
        # a read and a close 7 us, a pread 1.3 us).
        self._oom_file = str(self.memory.oom_counter)
        self._oom_fd: int | None = None
        if create:
            with contextlib.suppress(OSError):  # read by name then (an older kernel's group)
                self._oom_fd = os.open(self._oom_file, os.O_RDONLY | os.O_CLOEXEC)

    def _v1(self, controller: str) -> Path:
        return ROOT / controller / PARENT / self.dirs[0].name

    def limit(self, *, memory_bytes: int, cpus: float, pids: int) -> None:
        """The group's limits. Under v1, its TCP buffers too (``tcp_buffer_bytes``): v1 charges
        them to no memory limit, and a sandbox held 2 GB of them on its own loopback."""
        period = 100_000
        quota = max(1000, int(cpus * period))
        if self.mechanism is Mechanism.CGROUP_V2:
            d = self.dirs[0]
            (d / "memory.max").write_text(str(memory_bytes))
            swap = d / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
            (d / "pids.max").write_text(str(pids))
            (d / "cpu.max").write_text(f"{quota} {period}")
            return
        mem = self._v1("memory")
        (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
        tcp = mem / "memory.kmem.tcp.limit_in_bytes"
        if tcp.exists():  # before any socket of the group: accounting starts with the limit
            tcp.write_text(str(tcp_buffer_bytes(memory_bytes)))
        memsw = mem / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            memsw.write_text(str(memory_bytes))
        (self._v1("pids") / "pids.max").write_text(str(pids))
        cpu = self._v1("cpu")
        (cpu / "cpu.cfs_period_us").write_text(str(period))
        (cpu / "cpu.cfs_quota_us").write_text(str(quota))

    def watch_thrashing(self) -> None:
        """Kill the group's largest process when it thrashes at its memory limit (``_thrash``),
        counted with its OOM kills, until ``remove``."""
        if self._thrash is None:
            self._thrash = _thrash.watch(self.memory)

    def join_files(self) -> list[str]:
        """The files a process writes "0" to, to move itself into this cgroup."""
        join = _JOIN_FILE[self.mechanism]
        return [str(d / join) for d in self.dirs]

    def entering(self, argv: list[str]) -> list[str]:
        """``argv``, started inside this cgroup by a shell: every process it forks is born in
        it (the process tier's launcher does the same in one exec, where it was built)."""
        files = self.join_files()
        return ["/bin/sh", "-c", _ENTER, "sh", str(len(files)), *files, *argv]

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except FileNotFoundError:
                pass
            except OSError as error:
                # ENODEV: the group is being removed (by its creator, while another process's
                # garbage collection looks at it): a group is removed only once empty.
                if error.errno != errno.ENODEV:
                    raise
        return sorted(out)

    def peak_memory(self) -> int:
        """The most memory the group has held at once, in bytes (0 where unknown)."""
        name = "memory.peak" if self.memory.v2 else "memory.max_usage_in_bytes"
        try:
            return int((self.memory.folder / name).read_text())
        except (OSError, ValueError):
            return 0

    def oom_kills(self) -> int:
        try:
            held = self._oom_fd
            if held is not None:
                data = os.pread(held, 4096, 0)
            else:
                fd = os.open(self._oom_file, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    data = os.read(fd, 4096)
                finally:
                    os.close(fd)
        except OSError:  # removed meanwhile: ENOENT, or ENODEV while the kernel takes it down
            return 0
        watched = self._thrash.thrash_kills if self._thrash is not None else 0
        for line in data.splitlines():
            key, _, value = line.partition(b" ")
            if key == b"oom_kill":
                return int(value) + watched
        return watched

    def lock_kills(self) -> int:
        """The processes the lock watch killed (``_thrash.Watch.hold_locks``)."""
        return self._thrash.lock_kills if self._thrash is not None else 0

    def kill_all(self) -> None:
        """SIGKILL every process in the cgroup until it is empty (forks included)."""
        if self.mechanism is Mechanism.CGROUP_V2:
            kill = self.dirs[0] / "cgroup.kill"
            if kill.exists():
                kill.write_text("1")
        pause = 0.00025  # a killed process takes about a millisecond to go: look often, then less
        for _ in range(500):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(pause)
            pause = min(pause * 2, 0.002)

    def remove_empty(self) -> bool:
        """Remove the group if nothing runs in it (no kill): whether it is gone."""
        for d in self.dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:  # a process came, or a zombie is still being reaped
                return False
        return True

    def remove(self) -> None:
        if self._thrash is not None:
            self._thrash.close()
        held, self._oom_fd = self._oom_fd, None
        if held is not None:
            os.close(held)
        self.kill_all()
        # The held folder last: while any of the group is left, another's gc sees it held.
        for d in reversed(self.dirs):
            for _ in range(500):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # zombies still being reaped
                    time.sleep(0.001)
        if self._hold is not None:  # last: the group is gone, or no longer this creator's care
            os.close(self._hold)
            self._hold = None

    def remove_unclaimed(self) -> bool:
        """Remove the group if no creator holds it and nothing runs in it: whether this removed it."""
        parent_fd = _locked(self.dirs[0].parent, fcntl.LOCK_EX)  # creators hold it for microseconds
        try:
            with contextlib.suppress(FileNotFoundError):  # (v1: the other controllers' may be left)
                fd = os.open(self.dirs[0], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False  # its creator lives: a sandbox starting, or running
                finally:
                    os.close(fd)
            if self.pids():
                return False
            removed = False  # by this call: its creator may have removed it since it was listed
            for d in self.dirs:
                try:
                    d.rmdir()
                    removed = True
                except FileNotFoundError:
                    pass
                except OSError:  # a zombie still being reaped
                    return False
            return removed
        finally:
            os.close(parent_fd)


def _enable_v2(directory: Path) -> None:
    control = directory / "cgroup.subtree_control"
    enabled = set(control.read_text().split())
    for controller in ("memory", "pids", "cpu"):
        if controller not in enabled:
            with contextlib.suppress(OSError):
                control.write_text(f"+{controller}")


def _locked(folder: Path, how: int) -> int:
    """A descriptor of ``folder`` flocked ``how`` (blocking), for the caller to close."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, how)
    except BaseException:
        os.close(fd)
        raise
    return fd


def leftover_groups() -> list[str]:
    """Names of sandbox cgroups present on this host (for ``stockade gc``)."""
    names: set[str] = set()
    for base in [ROOT / PARENT, *(ROOT / c / PARENT for c in _V1_CONTROLLERS)]:
        if base.is_dir():
            names.update(p.name for p in base.iterdir() if p.is_dir())
    return sorted(names)


def collect(prefix: str, owned: Callable[[str], bool], dead: Callable[[str], bool]) -> list[str]:
    """Remove the sandbox cgroups named ``prefix...`` that ``owned(name)`` no longer claims
    (each tier names its groups apart, and collects its own).

    Only those ``dead(name)`` says were this caller's (a run folder of its state folder whose
    creator is gone) have their processes killed; any other unclaimed group may belong to a
    live sandbox of another state folder, another user of the host: it goes only when empty
    and no creator holds it (empty and held: a sandbox of theirs between the group's creation
    and its first process).
    """
    removed: list[str] = []
    support = detect()
    if support.mechanism is Mechanism.NONE:
        return removed
    for name in leftover_groups():
        if not name.startswith(prefix) or owned(name):
            continue
        group = Cgroup(support.mechanism, name, create=False)
        try:
            if dead(name):
                group.remove()
            elif not group.remove_unclaimed():
                continue
        except OSError:  # another process is changing it now: the next collection decides
            continue  # (a collection runs at a sandbox's first start, which it must not fail)
        removed.append(f"cgroup {name}")
    return removed
