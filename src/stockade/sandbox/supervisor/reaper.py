"""Starting the code's processes inside the sandbox: subreaper shims and launchers.

Every command and the interpreter run under a *shim*: a forked child that is a child
subreaper, so whatever the command double-forks is reparented to the shim and dies with it.
On exit or timeout the whole tree is killed (``proctree.py``); libc's calls are
``libc.py``. Here: how a process of the code's is set up (its descriptors, session, signals,
nice value, descriptor limit, OOM score), the launchers, the shim forked in Python and the
compiled one (``shim.c``) loaded into a sealed memfd and spawned.
Standard library only (C modules where it matters for start-up time).
"""

from __future__ import annotations

import _signal as signal
import errno
import fcntl
import os
import resource

from libc import PR_GET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_DUMPABLE, libc, prctl
from proctree import kill_tree

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Callable, Optional


# Signals whose default would end or stop the supervisor; children get the defaults back.
IGNORED_SIGNALS = (
    signal.SIGPIPE,
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
    signal.SIGVTALRM,
    signal.SIGPROF,
    signal.SIGXCPU,
    signal.SIGXFSZ,
)
# The sandbox's code runs at this nice value, the supervisor at 0: within the sandbox's own
# cgroup (or kernel) the supervisor wins the CPU, and nothing changes for the host.
USER_NICE = 19
# The code's RLIMIT_NOFILE where the supervisor keeps more descriptors than the code may
# hold (its egress relay's connections: supervisor.configure); 0 where they are the same.
# Every process of the code's is started with it, soft and hard (``code_files_word``).
_code_files = 0


def set_code_files(files: int) -> None:
    global _code_files
    _code_files = files


def code_files() -> int:
    return _code_files


def code_files_word() -> str:
    """The compiled shim's FILES argument: the code's descriptor limit, or "-" (ours)."""
    return str(_code_files) if _code_files > 0 else "-"


def limit_files() -> None:
    """In a forked child, its descriptors moved low and the rest closed: the code's limit,
    which the child (and all it starts) cannot raise again."""
    if _code_files > 0:
        resource.setrlimit(resource.RLIMIT_NOFILE, (_code_files, _code_files))


def _child_setup(stdin_fd: int, out_fd: int, err_fd: int) -> None:
    os.dup2(stdin_fd, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    try:  # the supervisor, at 0, then always gets the CPU to enforce a deadline in time
        os.nice(USER_NICE - os.nice(0))
    except OSError:
        pass
    for sig in (signal.SIGCHLD, *IGNORED_SIGNALS):
        signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def forked(target: "Callable[[], None]") -> "Callable[[], int]":
    """A launcher that runs Python code (``target``) in a forked child."""

    def launch() -> int:
        pid = os.fork()
        if pid == 0:
            try:
                target()
            finally:
                os._exit(127)
        return pid

    return launch


def spawned(argv: "list[str]", env: "dict[str, str]", cwd: str) -> "Callable[[], int]":
    """A launcher that execs a program with posix_spawn (vfork: no copy of our pages)."""

    def launch() -> int:
        try:
            os.chdir(cwd)
        except OSError as exc:
            os.write(2, f"stockade: cannot enter {cwd}: {exc.strerror}\n".encode())
            os._exit(126)
        os.environ["PATH"] = env.get("PATH", "/usr/local/bin:/usr/bin:/bin")  # posix_spawnp reads ours
        try:
            return os.posix_spawnp(argv[0], argv, env)
        except OSError as exc:
            os.write(2, f"stockade: {argv[0]}: {exc.strerror}\n".encode())
            os._exit(127 if exc.errno == errno.ENOENT else 126)

    return launch


def _enter(
    fds: "tuple[int, int, int]",
    keep: "tuple[int, ...]",
    confine: "Optional[Callable[[bool], bool]]",
    subreaper: bool = False,
) -> None:
    """In a forked child: ``fds`` as 0/1/2, ``keep`` as 3, 4, ..., no other fd, confined,
    leading a session of its own (a kill of its process group takes what it starts), and
    with ``subreaper`` a child subreaper."""
    _child_setup(*fds)
    if confine is not None:
        # The rules' compiled confinement makes us a subreaper in the same call: each
        # first call into C in a fork copies the pages it touches (~45 us).
        if confine(subreaper):
            subreaper = False  # done
    if subreaper:
        prctl(PR_SET_CHILD_SUBREAPER, 1)
    base = 3 + len(keep)
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, base) for fd in keep]
    for i, fd in enumerate(moved):
        os.dup2(fd, 3 + i)
    os.closerange(base, 1 << 20)
    limit_files()
    os.setsid()
    _code_goes_first()


def _code_goes_first() -> None:
    """The OOM killer takes user code before the supervisor: ``oom_score_adj`` 1000. A fork
    of the non-dumpable supervisor or zygote (an interpreter) cannot open its own /proc files;
    it is dumpable for the write, when it holds nothing but its own descriptors (measured
    before: run_code's interpreter stayed at 0, and one that held kernel memory, which its
    size does not show, had the supervisor killed in its place)."""
    dumpable = libc("prctl", PR_GET_DUMPABLE, 0, 0, 0, 0)
    try:
        if not dumpable:
            prctl(PR_SET_DUMPABLE, 1)
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"1000")  # os.write: no text file object to make
        finally:
            os.close(fd)
    except OSError:
        pass
    finally:
        if not dumpable:
            prctl(PR_SET_DUMPABLE, 0)


def spawn_leader(
    target: "Callable[[], None]",
    fds: "tuple[int, int, int]",
    keep: "tuple[int, ...]" = (),
    confine: "Optional[Callable[[bool], bool]]" = None,
) -> int:
    """Fork a child that runs ``target`` itself, set up as a shim's child is (see
    ``spawn_shim``), with no shim: for a parent that is a child subreaper and reaps, so
    that it adopts whatever the child leaves behind (the zygote, for every interpreter)."""
    pid = os.fork()
    if pid:
        return pid
    try:
        _enter(fds, keep, confine)
        target()
    finally:
        os._exit(127)


SHIM = "shim"  # the compiled shim (shim.c) beside these modules, when the host built it
MFD_CLOEXEC, MFD_ALLOW_SEALING, MFD_EXEC = 1, 2, 0x10
F_ADD_SEALS = 1033
SEALS = 0x1 | 0x2 | 0x4 | 0x8  # F_SEAL_SEAL, SHRINK, GROW, WRITE: nobody changes it again


def load_shim(folder: str) -> int:
    """The compiled shim in a sealed memfd (close-on-exec), to start by ``/proc/self/fd``:
    no file of the sandbox's to be swapped or mounted ``noexec``; -1 where there is none
    (the host had no compiler) or no memfd, and commands then go through ``spawn_shim``."""
    try:
        with open(os.path.join(folder, SHIM), "rb") as fh:
            program = fh.read()
    except OSError:
        return -1
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is None or _memfds_noexec():
        return -1
    fd = -1
    try:
        try:  # executable said outright, where the kernel has the flag (Linux 6.3)
            fd = memfd_create("stockade-shim", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_EXEC)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            fd = memfd_create("stockade-shim", MFD_CLOEXEC | MFD_ALLOW_SEALING)
        view = memoryview(program)
        while view:
            view = view[os.write(fd, view) :]
        fcntl.fcntl(fd, F_ADD_SEALS, SEALS)
    except OSError:
        if fd >= 0:
            os.close(fd)
        return -1
    return fd


def runnable_only(shim: int) -> bool:
    """The shim's memfd runnable, not readable, even by us (where execs are judged: judge.c
    starts it by an exec that carries the exec key in its registers). The kernel leaves a
    process that execs a file it cannot read non-dumpable (``would_dump``), so no process of
    the code can read the shim's /proc (``syscall`` shows a sleeping exec's registers) while
    that exec is under way; the shim makes itself dumpable once it runs. Not everywhere:
    gVisor will not exec such a file (and judges no exec). False where it could not be done."""
    try:
        os.fchmod(shim, 0o100)
    except OSError:
        return False
    return True


def _memfds_noexec() -> bool:
    """Whether this kernel runs no memfd at all (``vm.memfd_noexec`` 2, Linux 6.3)."""
    try:
        with open("/proc/sys/vm/memfd_noexec", "rb") as fh:
            return fh.read().strip() == b"2"
    except OSError:  # an older kernel, gVisor's: no such setting
        return False


def spawn_program(
    shim: int,
    argv: "list[str]",
    env: "dict[str, str]",
    cwd: str,
    fds: "tuple[int, int, int]",
    *,
    ruleset: int = -1,
) -> int:
    """Start a command under the compiled shim (``shim.c``): what ``spawn_shim`` and
    ``spawned`` do in a fork of ours, without the fork (posix_spawn: vfork and exec). The
    shim leads a new session, every signal at its default and none blocked; it becomes
    the subreaper, enters the Landlock domain of ``ruleset`` (its fd, or -1), closes every
    other fd, takes the code's descriptor limit, enters ``cwd`` and starts ``argv``. Not
    where execs are judged: the judge would stop the shim's own exec (judge.c's
    ``stockade_spawn`` is for that)."""
    actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(fds)]
    if ruleset >= 0:
        actions.append((os.POSIX_SPAWN_DUP2, ruleset, 3))  # open across the exec, at 3
    return os.posix_spawn(
        f"/proc/self/fd/{shim}",
        [SHIM, "3" if ruleset >= 0 else "-", code_files_word(), cwd, *argv],
        env,
        file_actions=actions,
        setsid=True,
        setsigmask=(),
        setsigdef=(signal.SIGCHLD, *IGNORED_SIGNALS),
    )


def spawn_shim(
    launch: "Callable[[], int]",
    fds: "tuple[int, int, int]",
    keep: "tuple[int, ...]" = (),
    confine: "Optional[Callable[[bool], bool]]" = None,
) -> int:
    """Fork a subreaper shim that starts a child with ``launch`` and mirrors its exit.

    The child gets ``fds`` as 0/1/2 and ``keep`` as 3, 4, ...; every other fd is closed.
    ``confine`` runs in the shim first: what it sets up (a Landlock domain, a seccomp
    filter) holds for the child and everything the child starts.
    """
    pid = os.fork()
    if pid:
        return pid
    try:
        _enter(fds, keep, confine, subreaper=True)
        child = launch()
        os.closerange(0, 1 << 20)  # the shim holds no end of the child's pipes
        status = 0
        while True:
            try:
                pid, st = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            if pid == child:
                status = st
                kill_tree(os.getpid(), include_root=False)
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.kill(os.getpid(), sig)
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
    except BaseException:
        os._exit(126)
