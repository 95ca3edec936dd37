"""Process trees inside the sandbox: subreaper shims, launchers, and killing a whole tree.

Every command and the interpreter run under a *shim*: a forked child that is a child
subreaper, so whatever the command double-forks is reparented to the shim and dies with it.
On exit or timeout the whole tree is killed (scan /proc, SIGKILL, repeat until empty).
Standard library only (C modules where it matters for start-up time).
"""

from __future__ import annotations

import _signal as signal
import errno
import fcntl
import os
import resource
import time

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Callable, Iterator, Optional


PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
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


_libc_funcs: "dict[str, Any]" = {}
_libc_types: "list[Any]" = []


def _types() -> "tuple[Any, Any, Any]":
    """c_long, a cdecl function type and libc's handle: made once (classes cost to make)."""
    if not _libc_types:
        import _ctypes

        class c_long(_ctypes._SimpleCData):
            _type_ = "l"

        class CFunc(_ctypes.CFuncPtr):
            _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
            _restype_ = c_long

        class Lib:
            _handle = _ctypes.dlopen(None)

        _libc_types.extend((c_long, CFunc, Lib()))
    c_long, cfunc, lib = _libc_types
    return c_long, cfunc, lib


# libc's functions called here that return an int, not a long (syscall): their -1 is read
# back as 4294967295 through a long (the register's upper half is not the sign's), and a
# failed prctl raised nothing
_INT_RESULTS = frozenset({"prctl", "mallopt", "madvise"})


def libc(name: str, *args: int) -> int:
    """Call a libc function of integer arguments through _ctypes directly (the ctypes
    package costs more to import); -1 raises OSError. Prototypes are kept, so that a fork
    (a shim) finds those its parent made."""
    import _ctypes

    key = f"{name}/{len(args)}"  # a variadic function (syscall) gets one prototype per arity
    func = _libc_funcs.get(key)
    if func is None:
        c_long, cfunc, lib = _types()
        func = cfunc((name, lib))
        func.argtypes = (c_long,) * len(args)
        _libc_funcs[key] = func
    result = int(func(*args))
    if name in _INT_RESULTS:  # the low 32 bits, signed
        result = ((result & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000
    if result == -1:
        err = _ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_ANONYMOUS, MADV_DONTFORK = 1, 2, 2, 0x20, 10


def private_page(size: int) -> "memoryview":
    """A writable view of ``size`` bytes on a page of their own that forks leave out
    (``MADV_DONTFORK``: a fork that touches it dies), where a secret is read straight into,
    never into a Python object a fork would copy. Made through libc, not the mmap module:
    its import took 5-12 ms of the first ``run_code``'s path on gVisor (the seal's key is
    read after the zygote's fork, right before the first request)."""
    import _ctypes

    page = resource.getpagesize()
    addr = libc("mmap", 0, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    libc("madvise", addr, page, MADV_DONTFORK)

    class Byte(_ctypes._SimpleCData):
        _type_ = "B"

    class Area(_ctypes.Array):
        _type_ = Byte
        _length_ = size

    return memoryview(Area.from_address(addr)).cast("B")


def prctl(option: int, arg: int) -> None:
    libc("prctl", option, arg, 0, 0, 0)


M_ARENA_MAX = -8


def limit_arenas(value: str) -> None:
    """``MALLOC_ARENA_MAX`` for this process and what forks from it (the zygote, the
    interpreters): glibc reads the variable at a process's first allocation, long past for
    them, so run_code's threads would get an arena each (64 MiB of address space, which
    RLIMIT_AS counts) while a command's got what the variable says. Nothing where there is
    no such glibc function."""
    if not value.isdigit() or not 0 < int(value) < 1 << 16:
        return
    try:
        libc("mallopt", M_ARENA_MAX, int(value))
    except (AttributeError, OSError):
        pass


M_PERTURB = -6
FREED_BYTE = 0x5A  # glibc fills what is freed with it (and what it allocates with its complement)


def scrub_freed(on: bool) -> None:
    """glibc's ``M_PERTURB`` for this process: every chunk freed to its heap overwritten. The
    supervisor outlives a reset in place, and its heap has held the last user's uploads and
    output: freed, the bytes stayed until reused, and a memory snapshot (which copies every
    page of the guest) gave them to the next user. What it returns to the kernel, the kernel
    zeroes (the microVM's init_on_free; gVisor's freed pages). The zygote turns it off for
    the interpreters (user code pays nothing). Small chunks (glibc's tcache, Python's own
    allocator for objects under 512 bytes) are kept as they are: see docs/architecture.md."""
    try:
        libc("mallopt", M_PERTURB, FREED_BYTE if on else 0)
    except (AttributeError, OSError):
        pass


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


def own_children() -> "Optional[set[int]]":
    """Our children, every thread's (``/proc/self/task/*/children``: two reads where a pass
    over /proc reads every process's stat), or None where the kernel has no such file."""
    found: "set[int]" = set()
    try:
        for tid in os.listdir("/proc/self/task"):
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
