"""What a reset puts back besides files: the supervisor's own settings and the sysctls of the
sandbox's namespaces, as they were when the sandbox started.

Code in the sandbox runs as the supervisor's uid, so the kernel would let it lower the
supervisor's rlimits (``prlimit``), raise its nice value, narrow its CPU affinity, move it to
``SCHED_IDLE``, give it (and the zygote, whose interpreters inherit it) the idle I/O class
(``ioprio_set``: it throttled the next user's disk, and passed a few bits across a reset);
the seccomp filter every tier installs (``stockade.sandbox._seccomp``) refuses each of those
on any process but the caller, and what is put back here is the backstop. And the sysctls
that belong to its own namespaces (message queue sizes, ``pid_max``, shm limits) were its
to write where their owner is its uid. All of that outlives the code that did it, and an
exec: without this, one user of a pooled sandbox would shape (or break) the next user's.
What cannot be put back (a hard limit lowered, a nice value raised: only privilege undoes
those) is reported, and the host then replaces the sandbox instead of handing it out.

Which sysctls we can write is fixed for the sandbox's life: the kernel decides it from the
sysctl's table (its mode, which nobody can chmod on ``/proc/sys``), the owner of the
namespace it belongs to, and our credentials, and we never change our credentials nor leave
our namespaces. No process of the sandbox holds a capability that adds tables to them (a
network device's, say). So the whole of ``/proc/sys`` is walked once, at the first reset,
to prove that nothing is writable beyond what the start recorded (a tier whose namespaces
expose more fails that reset, and is replaced); every reset after it reads the recorded ones
only (the walk cost 2.5-3 ms of a 8 ms reset; reading 15 recorded ones, 0.1 ms).
Standard library only.
"""

from __future__ import annotations

import os
import resource
import stat

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any

SYSCTL_ROOT = "/proc/sys"
# Where namespaced sysctls live (ipc, pid, uts: kernel/; mqueue: fs/mqueue); read at start,
# because a walk of all of /proc/sys costs milliseconds. The first reset walks all of it.
SYSCTL_DIRS = ("/proc/sys/kernel", "/proc/sys/fs/mqueue")
# Counters, not settings: they move by themselves.
SYSCTL_VOLATILE = ("/proc/sys/kernel/ns_last_pid",)

# /proc/net's socket tables, with the column that holds each socket's inode (0: no file,
# as a TIME_WAIT or an orphaned connection has).
TABLES = (
    ("unix", 6),
    ("tcp", 9),
    ("tcp6", 9),
    ("udp", 9),
    ("udp6", 9),
    ("raw", 9),
    ("raw6", 9),
)


def _rlimits() -> "dict[str, list[int]]":
    out: "dict[str, list[int]]" = {}
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            try:
                out[name] = list(resource.getrlimit(getattr(resource, name)))
            except (OSError, ValueError):
                continue
    return out


def _writable_sysctls(dirs: "tuple[str, ...]", recursive: bool) -> "dict[str, str]":
    found: "dict[str, str]" = {}
    todo = list(dirs)
    while todo:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    if recursive:
                        todo.append(entry.path)
                    continue
            except OSError:
                continue
            if entry.path in SYSCTL_VOLATILE or not os.access(entry.path, os.W_OK):
                continue
            try:  # stat, not the entry's type: a device bound over a sysctl hides it (/dev/null)
                if not stat.S_ISREG(os.stat(entry.path).st_mode):
                    continue
            except OSError:
                continue
            try:
                with open(entry.path) as fh:
                    found[entry.path] = fh.read()
            except OSError:
                continue
    return found


def sockets() -> "dict[str, list[int]]":
    """Each table's socket inodes, as the namespace has them now."""
    found: "dict[str, list[int]]" = {}
    for table, column in TABLES:
        try:
            with open(f"/proc/net/{table}", "rb") as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:  # a table this kernel (or gVisor) does not have
            continue
        inodes = []
        for line in lines:
            fields = line.split()
            if len(fields) > column and fields[column].isdigit():
                inodes.append(int(fields[column]))
        found[table] = inodes
    return found


def socket_inodes() -> "list[int]":
    """The inodes of the sockets at start-up (before any code ran): a tier's own (a guest's
    init's, say) may stay however many users come."""
    return sorted({inode for inodes in sockets().values() for inode in inodes if inode})


# ioprio_set and ioprio_get, by machine; IOPRIO_WHO_PROCESS.
IOPRIO_CALLS = {"x86_64": (251, 252), "aarch64": (30, 31)}
IOPRIO_WHO_PROCESS = 1


def _ioprio(pid: int) -> "int | None":
    """The I/O priority of ``pid`` (0: ourselves); None where the kernel will not tell."""
    calls = IOPRIO_CALLS.get(os.uname().machine)
    if calls is None:
        return None
    from libc import libc

    try:
        return libc("syscall", calls[1], IOPRIO_WHO_PROCESS, pid)
    except OSError:
        return None


def _set_ioprio(value: int) -> bool:
    calls = IOPRIO_CALLS.get(os.uname().machine)
    if calls is None:
        return False
    from libc import libc

    try:
        libc("syscall", calls[0], IOPRIO_WHO_PROCESS, 0, value)
    except OSError:
        return False
    return True


def snapshot() -> "dict[str, Any]":
    """The settings as they are now (at start-up, before any code ran)."""
    return {
        "ioprio": _ioprio(0),
        "rlimits": _rlimits(),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "affinity": sorted(os.sched_getaffinity(0)),
        "policy": os.sched_getscheduler(0),
        "sysctls": _writable_sysctls(SYSCTL_DIRS, recursive=False),
        "sysctls_walked": False,  # set by the first reset's walk of all of /proc/sys
    }


def restore(base: "dict[str, Any]", sysctl_root: str = SYSCTL_ROOT) -> "list[str]":
    """Put every setting back; return what could not be (empty: all is as at start-up).

    The first call walks all of ``sysctl_root`` and marks ``base`` walked when it found
    nothing writable beyond what ``snapshot`` recorded; later calls read those only."""
    problems: "list[str]" = []
    for name, (soft, hard) in base["rlimits"].items():
        res = getattr(resource, name)
        if resource.getrlimit(res) != (soft, hard):
            try:
                resource.setrlimit(res, (soft, hard))
            except (OSError, ValueError):
                problems.append(f"{name} was lowered to {resource.getrlimit(res)}")
    if os.sched_getscheduler(0) != base["policy"]:
        try:
            os.sched_setscheduler(0, base["policy"], os.sched_param(0))
        except OSError:
            problems.append("the scheduling policy was changed")
    if os.getpriority(os.PRIO_PROCESS, 0) != base["nice"]:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, base["nice"])
        except OSError:
            problems.append(f"the nice value was raised to {os.getpriority(os.PRIO_PROCESS, 0)}")
    if sorted(os.sched_getaffinity(0)) != base["affinity"]:
        try:
            os.sched_setaffinity(0, base["affinity"])
        except OSError:
            problems.append("the CPU affinity was narrowed")
    ioprio = base.get("ioprio")
    if ioprio is not None and _ioprio(0) != ioprio and not _set_ioprio(ioprio):
        problems.append("the I/O priority was changed")
    sysctls = base["sysctls"]
    if base.get("sysctls_walked"):
        now = {path: _read_sysctl(path) for path in sysctls}
    else:  # once per sandbox (see the module's docstring)
        now = _writable_sysctls((sysctl_root,), recursive=True)
        unknown = [path for path in now if path not in sysctls]
        problems += [f"{path} is writable and was not recorded at start-up" for path in unknown]
        base["sysctls_walked"] = not unknown
    for path, value in sysctls.items():
        if now.get(path, value) != value:
            try:
                with open(path, "w") as fh:
                    fh.write(value)
            except OSError as exc:
                problems.append(f"{path} cannot be put back: {exc.strerror}")
    return problems


def _read_sysctl(path: str) -> "str | None":
    """A sysctl's value, as ``_writable_sysctls`` reads it; None if it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 1 << 16).decode()
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)


def differences(base: "dict[str, Any]", pid: int) -> "list[str]":
    """How another process's settings (the zygote's) differ from ``base``; empty: none.

    Code runs as its uid too, so it can change them as it can ours (``prlimit``,
    ``setpriority``, ``sched_setaffinity``, ``sched_setscheduler``), and every process it
    forks inherits them. Nothing is put back here: the caller replaces the process."""
    problems: "list[str]" = []
    try:
        for name, limits in base["rlimits"].items():
            now = list(resource.prlimit(pid, getattr(resource, name)))
            if now != limits:
                problems.append(f"its {name} is {tuple(now)}")
        if os.getpriority(os.PRIO_PROCESS, pid) != base["nice"]:
            problems.append("its nice value was changed")
        if sorted(os.sched_getaffinity(pid)) != base["affinity"]:
            problems.append("its CPU affinity was changed")
        if os.sched_getscheduler(pid) != base["policy"]:
            problems.append("its scheduling policy was changed")
        if base.get("ioprio") is not None and _ioprio(pid) != base["ioprio"]:
            problems.append("its I/O priority was changed")
    except (OSError, ValueError) as exc:  # gone, or a kernel that will not tell: not as it was
        problems.append(f"its settings cannot be read: {exc}")
    return problems
