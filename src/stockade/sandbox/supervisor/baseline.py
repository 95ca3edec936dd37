"""What a reset puts back besides files: the supervisor's own settings and the sysctls of the
sandbox's namespaces, as they were when the sandbox started.

Code in the sandbox runs as the supervisor's uid, so it can lower the supervisor's rlimits
(``prlimit``), raise its nice value, narrow its CPU affinity, move it to ``SCHED_IDLE``, and
write the sysctls that belong to its own namespaces (message queue sizes, ``pid_max``, shm
limits). All of that outlives the code that did it, and an exec: without this, one user of a
pooled sandbox would shape (or break) the next user's. What cannot be put back (a hard limit
lowered, a nice value raised: only privilege undoes those) is reported, and the host then
replaces the sandbox instead of handing it out.
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
# because a walk of all of /proc/sys costs milliseconds. ``verify`` walks all of it at reset.
SYSCTL_DIRS = ("/proc/sys/kernel", "/proc/sys/fs/mqueue")
# Counters, not settings: they move by themselves.
SYSCTL_VOLATILE = ("/proc/sys/kernel/ns_last_pid",)


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


def snapshot() -> "dict[str, Any]":
    """The settings as they are now (at start-up, before any code ran)."""
    return {
        "rlimits": _rlimits(),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "affinity": sorted(os.sched_getaffinity(0)),
        "policy": os.sched_getscheduler(0),
        "sysctls": _writable_sysctls(SYSCTL_DIRS, recursive=False),
    }


def restore(base: "dict[str, Any]") -> "list[str]":
    """Put every setting back; return what could not be (empty: all is as at start-up)."""
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
    sysctls = base["sysctls"]
    for path, value in _writable_sysctls((SYSCTL_ROOT,), recursive=True).items():
        if path not in sysctls:
            problems.append(f"{path} is writable and was not recorded at start-up")
        elif value != sysctls[path]:
            try:
                with open(path, "w") as fh:
                    fh.write(sysctls[path])
            except OSError as exc:
                problems.append(f"{path} cannot be put back: {exc.strerror}")
    return problems


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
    except (OSError, ValueError) as exc:  # gone, or a kernel that will not tell: not as it was
        problems.append(f"its settings cannot be read: {exc}")
    return problems
