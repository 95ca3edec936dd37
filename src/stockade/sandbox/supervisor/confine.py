"""The policy's rules, enforced on the code by the kernel: what every shim does before it
starts the code, and how the supervisor hears of each exec.

* **Writes**: a Landlock ruleset lets the code write only beneath the workspace paths the
  rules allow, and in /tmp, /dev/shm and the devices: the rest of the workspace is
  read-only to every process the code starts, whatever language or route it takes.
* **Execs**: a seccomp filter sends every ``execve``/``execveat`` to a user-space listener:
  the calling thread waits in the kernel until the supervisor answers (run it, or fail it).
  The supervisor installs the filter on itself, so that every process of the sandbox
  inherits it, and holds the listener; it execs only at a reset, and answers that itself.

Both need no privilege (``no_new_privs`` is set on every tier), and neither can be undone
by the code: Landlock domains and seccomp filters only ever add up. Standard library only;
neither ctypes nor array (each costs milliseconds to import: array loads collections):
buffers are ``bytearray``s pinned by ``_ctypes`` (``_pinned``), calls go through
``libc.libc``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct

from libc import libc

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, List, Optional, Sequence, Tuple

SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
SYS_SECCOMP = 317
SYS_GETPID = 39
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
# Landlock's filesystem rights (ABI 1, then REFER in 2, TRUNCATE in 3).
FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE = sum(1 << bit for bit in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
FS_REFER = 1 << 13
FS_TRUNCATE = 1 << 14
FILE_RIGHTS = FS_WRITE_FILE | FS_TRUNCATE  # the rights that apply to a file, not a folder

SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
SECCOMP_GET_ACTION_AVAIL = 2
SECCOMP_RET_USER_NOTIF = 0x7FC00000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_KILL_PROCESS = 0x80000000
AUDIT_ARCH_X86_64 = 0xC000003E
NR_EXECVE, NR_EXECVEAT, NR_MEMFD_CREATE = 59, 322, 319
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
# ioctl numbers: _IOWR('!', 0, struct seccomp_notif), _IOWR('!', 1, seccomp_notif_resp),
# _IOW('!', 2, __u64).
NOTIF_RECV = 0xC0502100
NOTIF_SEND = 0xC0182101
NOTIF_ID_VALID = 0x40082102
NOTIF_SET_FLAGS = 0x40082104  # _IOW('!', 4, __u64), Linux 6.6
USER_NOTIF_FD_SYNC_WAKE_UP = 1
NOTIF = struct.Struct("=QIIiIQ6Q")  # id, pid, flags, nr, arch, ip, args[6]
RESP = struct.Struct("=QqiI")  # id, val, error, flags

# An exec's argv is read whole, every word of it judged: a rule's flag may be anywhere (with
# the first 4,096 words read, `rm -f <5,000 words> -r x` hid its -r). Past what the kernel
# takes (argv and environment at most 6 MiB: fs/exec.c; each word at most 128 KiB), the
# exec fails with E2BIG, as the kernel would fail it, and the judge never holds more.
MAX_ARGS = 1 << 18
MAX_ARG_BYTES = 256 * 1024  # one word
MAX_ARGV_BYTES = 8 << 20  # all of them


_BYTE: "List[Any]" = []  # the one-byte C type, made once (a class costs to make)


def _pinned(data: bytes) -> "Tuple[Any, int]":
    """A C-visible copy of ``data`` and its address: the first must be kept while the
    kernel may read the second (the buffer cannot move or be freed under it)."""
    import _ctypes

    if not _BYTE:

        class c_char(_ctypes._SimpleCData):
            _type_ = "c"

        _BYTE.append(c_char)
    buf = bytearray(data)
    view = _BYTE[0].from_buffer(buf)  # holds buf, and locks its size
    return view, _ctypes.addressof(view)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where it has none."""
    try:
        return libc("syscall", SYS_LANDLOCK_CREATE_RULESET, 0, 0, LANDLOCK_CREATE_RULESET_VERSION)
    except OSError:
        return 0


def write_rights(abi: int) -> int:
    rights = FS_WRITE_FILE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE
    if abi >= 2:
        rights |= FS_REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    return rights


def open_written(path: str, root: str) -> int:
    """An ``O_PATH`` descriptor of the written ``path``. Beneath ``root`` (the workspace) it is
    reached name by name and no name may be a symbolic link (``OSError``): code and the seed
    can make links there, and a rule given the link's target would make that writable (a seeded
    ``build -> .`` under ``build/**``: the whole workspace). Above it, and for the places every
    run writes (/tmp, /dev), the path is the image's and the tier's: opened as it is. A walk
    rather than openat2's ``RESOLVE_NO_SYMLINKS``: it needs no kernel or seccomp profile that
    has openat2, and the paths are few."""
    top = root.rstrip("/")
    if not path.startswith(top + "/"):
        return os.open(path, os.O_PATH | os.O_CLOEXEC)
    fd = os.open(top or "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in path[len(top) :].split("/"):
            if name in ("", "."):
                continue
            if name == "..":  # out of the workspace, or back in by another way: no rule
                raise OSError(errno.EXDEV, "a written path climbs out of the workspace", path)
            # A link opened so is the link itself: a next name beneath it fails (ENOTDIR).
            step = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = step
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            raise OSError(errno.ELOOP, "a written path is a symbolic link", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def ruleset(
    abi: int, writable: "Optional[Sequence[str]]", executable: "Optional[Sequence[str]]", root: str
) -> int:
    """A Landlock ruleset: writes only beneath ``writable`` (folders or files), execution of the
    files ``executable`` lists only (None: no such rule). A path that does not exist gets no
    rule: nothing beneath it is writable, it cannot be run; nor does a path beneath ``root``
    that is, or is reached through, a symbolic link (``open_written``). Built once, applied by
    every shim (``restrict``): a rule holds the inode it was given, so the caller rebuilds it
    when one of the paths is replaced."""
    handled = write_rights(abi) if writable is not None else 0
    if executable is not None:
        handled |= FS_EXECUTE
    # Each pinned buffer stays bound (``_held``) until the call that reads it returns.
    _held, address = _pinned(struct.pack("=Q", handled))  # the fs rights: the older, smaller struct
    fd = libc("syscall", SYS_LANDLOCK_CREATE_RULESET, address, 8, 0)
    try:
        grants = [(p, handled & ~FS_EXECUTE) for p in writable or ()]
        grants += [(p, FS_EXECUTE) for p in executable or ()]
        for path, rights in grants:
            try:
                if rights & FS_EXECUTE:  # the allowlist's files: the image's, by their real paths
                    target = os.open(path, os.O_PATH | os.O_CLOEXEC)
                else:
                    target = open_written(path, root)
            except OSError:
                continue
            try:
                st = os.fstat(target)
                if not stat.S_ISDIR(st.st_mode):
                    if (
                        st.st_nlink != 1
                        and not rights & FS_EXECUTE
                        and path.startswith(root.rstrip("/") + "/")
                    ):
                        # a file with another name: a rule holds the inode, so every name would
                        # be written (a file at ``out``, for out/**, linked to a read-only one)
                        continue
                    rights &= FILE_RIGHTS | FS_EXECUTE  # what applies to a file, not a folder
                _held, address = _pinned(struct.pack("=Qi", rights, target))  # packed, as the kernel's
                libc("syscall", SYS_LANDLOCK_ADD_RULE, fd, LANDLOCK_RULE_PATH_BENEATH, address, 0)
            finally:
                os.close(target)
    except BaseException:
        os.close(fd)
        raise
    return fd


def restrict(ruleset_fd: int) -> None:
    """Put this process, and all it starts, under the ruleset: for good."""
    libc("syscall", SYS_LANDLOCK_RESTRICT_SELF, ruleset_fd, 0)


def warm() -> None:
    """Make the call prototypes a shim's confinement in Python needs, so that forks find them
    made (a prototype made in a fork is made again in every fork)."""
    for arity in (2, 3, 4, 5):
        libc("syscall", SYS_GETPID, *([0] * (arity - 1)))  # harmless: only the prototype matters


def _program(code: bytes) -> "Tuple[Any, Any, int]":
    """A BPF program the kernel can read (``struct sock_fprog``): its instructions and the
    header pinned (both must be kept while it reads them), and the header's address."""
    held, address = _pinned(code)
    prog, prog_address = _pinned(struct.pack("=HxxxxxxQ", len(code) // 8, address))
    return held, prog, prog_address


def exec_filter(no_memfd: bool = False) -> bytes:
    """The BPF program: execve and execveat go to the listener, other architectures die.
    ``no_memfd``: memfd_create fails (EPERM), so that no file outside Landlock's view (a memfd
    has no path) can be run under an allowlist."""
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    program = [
        (ld, 0, 0, 4),  # the architecture
        (jeq, 0, 6, AUDIT_ARCH_X86_64),
        (ld, 0, 0, 0),  # the system call number
        (jge, 4, 0, 0x40000000),  # the x32 ABI
        (jeq, 4, 0, NR_EXECVE),
        (jeq, 3, 0, NR_EXECVEAT),
        (jeq, 3, 0, NR_MEMFD_CREATE if no_memfd else NR_EXECVE),
        (ret, 0, 0, SECCOMP_RET_ALLOW),
        (ret, 0, 0, SECCOMP_RET_KILL_PROCESS),
        (ret, 0, 0, SECCOMP_RET_USER_NOTIF),
        (ret, 0, 0, SECCOMP_RET_ERRNO | 1),
    ]
    return b"".join(struct.pack("=HBBI", *insn) for insn in program)


ENOSYS_ = 38


NR_SOCKET, NR_IO_SETUP, NR_FCNTL, NR_SETSOCKOPT = 41, 206, 72, 54
# Socket options holding kernel memory no cgroup charges (``_seccomp.UNCHARGED_SOCKOPTS``):
# TCP MD5 keys, classic BPF socket filters and timestamps on the error queue, by level.
SOL_SOCKET, IPPROTO_TCP = 1, 6
UNCHARGED_TCP, UNCHARGED_SOCKET = (14, 32), (26, 51, 37, 65)  # and SO_TIMESTAMPING(_NEW)
NR_MEMFD_SECRET = 447  # its pages leave the host's direct map for good (``_seccomp``)
# The calls that signal (or attach to) a process named by its pid: the target's place
# among the call's arguments, the first or either of the first two (a thread group, a
# thread). ptrace's target is its second.
SIGNAL_FIRST = (62, 200, 129, 434)  # kill, tkill, rt_sigqueueinfo, pidfd_open
SIGNAL_EITHER = (234, 297)  # tgkill, rt_tgsigqueueinfo
NR_PTRACE = 101
EPERM_ = 1
AF_INET, AF_INET6, AF_NETLINK, SOCK_DGRAM = 2, 10, 16, 2
EAFNOSUPPORT_, EINVAL_ = 97, 22
F_OFD_GETLK, F_OFD_SETLKW = 36, 38  # and F_OFD_SETLK between them
F_SETLEASE, EACCES_ = 1024, 13
NR_CLONE, NR_CLONE3 = 56, 435
CLONE_THREAD, CLONE_FILES = 0x00010000, 0x00000400  # a thread must share its descriptor table


def deny_calls(
    calls: "Sequence[int]",
    *,
    netlink: bool = False,
    datagrams: bool = False,
    locks: bool = False,
    guard_init: bool = False,
    no_memfd: bool = False,
) -> None:
    """A filter on this process and all it starts: ``calls`` fail with ENOSYS (so do other
    architectures' and the x32 ABI's calls: nothing here uses them). What a reset cannot
    find is not made at all (``fileops.unlisted_ipc``).

    ``netlink``: netlink sockets fail with EAFNOSUPPORT (glibc then does without): their
    receive queues are kernel memory no cgroup charges to the sandbox, and one socket pinned
    8 MB of the host's. ``datagrams``: so do UDP sockets, in a sandbox whose loopback is its
    only network (cgroup v1 charges their buffers to no one either); TCP MD5 keys and classic
    BPF socket filters (``setsockopt``) fail with EPERM, kernel memory no cgroup charges either
    (``_seccomp.UNCHARGED_SOCKOPTS``). ``locks``: OFD locks
    (``fcntl`` ``F_OFD_*``) fail with EINVAL, as on kernels before 3.15: the host counts
    each process's locks (``_locks``), and an OFD lock belongs to an open file, which can
    outlive every process (one in flight in a socket's queue); leases (``F_SETLEASE``) with
    EACCES: their own slab, uncounted, and freeing many took a host core long after the
    sandbox ended (``_seccomp``); and a thread (``CLONE_THREAD``) with a descriptor table of its
    own (no ``CLONE_FILES``) with EPERM: the host reads each process's table, its leader's, and
    one such thread held 300,000 locks unseen (``clone3``, whose flags BPF cannot read, fails
    with ENOSYS: libc falls back to ``clone``). ``guard_init``: no signal
    (kill, tkill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo, pidfd_open) and no ptrace may
    name pid 1, which fail with EPERM: where the supervisor is the sandbox's init and the
    kernel does not shield an init as Linux does (gVisor's does not: code stopped it with
    ``kill -STOP 1``, and ran on with no deadline enforced). A broadcast (``kill(-1)``)
    skips init on every kernel, and no process of the code's is in init's group.
    ``no_memfd``: memfd_create and memfd_secret fail with EPERM, as the exec listener's
    ``no_memfd`` has them where there is none (gVisor): a memfd is on no mount, so no
    ``noexec`` keeps a program the code wrote into one from running (``fexecve``,
    ``/proc/self/fd``); under an allowlist none may (``_rules.written_noexec``)."""
    ld, jeq, jge, ret, and_ = 0x20, 0x15, 0x35, 0x06, 0x54  # (and: BPF_ALU | BPF_AND | BPF_K)
    lines: "List[Tuple[str, Tuple[int, Any, Any, int]]]" = []  # (label, (code, true, false, k))

    def emit(code: int, k: int, true: "Any" = 0, false: "Any" = 0, label: str = "") -> None:
        lines.append((label, (code, true, false, k)))

    emit(ld, 4)  # the architecture
    emit(jeq, AUDIT_ARCH_X86_64, 0, "enosys")
    emit(ld, 0)  # the call's number
    emit(jge, 0x40000000, "enosys", 0)
    if no_memfd:  # before ``calls``: memfd_secret may be among them
        emit(jeq, NR_MEMFD_CREATE, "no_memfd", 0)
        emit(jeq, NR_MEMFD_SECRET, "no_memfd", 0)
    for nr in calls:
        emit(jeq, nr, "enosys", 0)
    if guard_init:
        for nr in SIGNAL_FIRST:
            emit(jeq, nr, "target_first", 0)
        for nr in SIGNAL_EITHER:
            emit(jeq, nr, "target_either", 0)
        emit(jeq, NR_PTRACE, "target_second", 0)
    if locks:
        emit(jeq, NR_FCNTL, "fcntl", 0)
        emit(jeq, NR_CLONE3, "enosys", 0)
        emit(jeq, NR_CLONE, "clone", 0)
    if netlink:
        emit(jeq, NR_SETSOCKOPT, "setsockopt", 0)
    if netlink or datagrams:
        emit(jeq, NR_SOCKET, 0, "allow")
        emit(ld, 16)  # args[0]: the family (its low half)
        if netlink:
            emit(jeq, AF_NETLINK, "eafnosupport", 0)
        if datagrams:
            emit(jeq, AF_INET, "datagram", 0)
            emit(jeq, AF_INET6, "datagram", 0)
        emit(ret, SECCOMP_RET_ALLOW)
        if datagrams:
            emit(ld, 24, label="datagram")  # args[1]: the type, flags above its low bits
            emit(and_, 0xF)
            emit(jeq, SOCK_DGRAM, "eafnosupport", "allow")
    emit(ret, SECCOMP_RET_ALLOW, label="allow")
    emit(ret, SECCOMP_RET_ERRNO | ENOSYS_, label="enosys")
    if no_memfd:
        emit(ret, SECCOMP_RET_ERRNO | EPERM_, label="no_memfd")
    emit(ret, SECCOMP_RET_ERRNO | EAFNOSUPPORT_, label="eafnosupport")
    if netlink:  # (BPF jumps only forward: this block ends in returns of its own)
        emit(ld, 24, label="setsockopt")  # args[1]: the level (an int: its low half)
        emit(jeq, IPPROTO_TCP, "tcp_option", 0)
        emit(jeq, SOL_SOCKET, "socket_option", "option_allowed")
        emit(ld, 32, label="tcp_option")  # args[2]: the option
        for option in UNCHARGED_TCP:
            emit(jeq, option, "option_refused", 0)
        emit(ret, SECCOMP_RET_ALLOW)
        emit(ld, 32, label="socket_option")
        for option in UNCHARGED_SOCKET:
            emit(jeq, option, "option_refused", 0)
        emit(ret, SECCOMP_RET_ALLOW, label="option_allowed")
        emit(ret, SECCOMP_RET_ERRNO | EPERM_, label="option_refused")
    if locks:
        emit(ld, 24, label="fcntl")  # args[1]: the command (an unsigned int: its low half)
        emit(jeq, F_SETLEASE, "eacces", 0)
        emit(jge, F_OFD_GETLK, 0, "allowed")
        emit(jge, F_OFD_SETLKW + 1, "allowed", "einval")
        emit(ret, SECCOMP_RET_ALLOW, label="allowed")
        emit(ret, SECCOMP_RET_ERRNO | EINVAL_, label="einval")
        emit(ret, SECCOMP_RET_ERRNO | EACCES_, label="eacces")
        emit(ld, 16, label="clone")  # args[0]: the flags (their low half)
        emit(and_, CLONE_THREAD | CLONE_FILES)
        emit(jeq, CLONE_THREAD, 0, "clone_allowed")
        emit(ret, SECCOMP_RET_ERRNO | EPERM_)
        emit(ret, SECCOMP_RET_ALLOW, label="clone_allowed")
    if guard_init:  # a pid is an int: its low half is what the kernel reads
        emit(ld, 24, label="target_second")  # args[1]
        emit(jeq, 1, "eperm", "pid_allowed")
        emit(ld, 24, label="target_either")  # args[1], then args[0]
        emit(jeq, 1, "eperm", 0)
        emit(ld, 16, label="target_first")  # args[0]
        emit(jeq, 1, "eperm", "pid_allowed")
        emit(ret, SECCOMP_RET_ALLOW, label="pid_allowed")
        emit(ret, SECCOMP_RET_ERRNO | EPERM_, label="eperm")
    at = {label: i for i, (label, _) in enumerate(lines) if label}

    def offset(here: int, target: "Any") -> int:
        return target if isinstance(target, int) else at[target] - here - 1

    code = b"".join(
        struct.pack("=HBBI", op, offset(i, t), offset(i, f), k) for i, (_, (op, t, f, k)) in enumerate(lines)
    )
    pinned = _program(code)  # bound until the call returns: the kernel copies it
    libc("prctl", 38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: set on every tier already
    libc("syscall", SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, 0, pinned[2])


AUDIT_ARCH_I386 = 0x40000003
NR_SECCOMP_I386, NR_PRCTL_I386 = 354, 172
NR_PRCTL, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 157, 22, 2


def refuse_filters() -> None:
    """A last filter on this process and all it starts: no seccomp filter may be added after it
    (``seccomp(SECCOMP_SET_MODE_FILTER)``, ``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)``:
    EPERM, in every ABI). Where the code's kernel is the host's, each filter is JIT code no
    cgroup charges, counted against the host's shared ``bpf_jit_limit``: used up, every
    unprivileged filter load on the host fails (bubblewrap's of each new sandbox among them).
    Ours are in place before it; strict mode and the other operations (which load nothing) stay."""
    ld, jeq, ret, and_ = 0x20, 0x15, 0x06, 0x54
    program = [
        (ld, 0, 0, 4),  # 0: the architecture
        (jeq, 0, 4, AUDIT_ARCH_X86_64),
        (ld, 0, 0, 0),  # 2: the call's number, the x32 ABI's bit cleared (same numbers)
        (and_, 0, 0, 0xBFFFFFFF),
        (jeq, 6, 0, SYS_SECCOMP),  # -> 11
        (jeq, 7, 4, NR_PRCTL),  # -> 13, else allow
        (jeq, 0, 3, AUDIT_ARCH_I386),  # 6: else allow
        (ld, 0, 0, 0),
        (jeq, 2, 0, NR_SECCOMP_I386),  # -> 11
        (jeq, 3, 0, NR_PRCTL_I386),  # -> 13
        (ret, 0, 0, SECCOMP_RET_ALLOW),  # 10
        (ld, 0, 0, 16),  # 11: seccomp's operation (args[0], an unsigned int: its low half)
        (jeq, 5, 4, SECCOMP_SET_MODE_FILTER),  # -> 18, else allow
        (ld, 0, 0, 16),  # 13: prctl's option
        (jeq, 0, 2, PR_SET_SECCOMP),  # else allow
        (ld, 0, 0, 24),  # 15: its mode (args[1])
        (jeq, 1, 0, SECCOMP_MODE_FILTER),  # -> 18
        (ret, 0, 0, SECCOMP_RET_ALLOW),  # 17
        (ret, 0, 0, SECCOMP_RET_ERRNO | EPERM_),  # 18
    ]
    pinned = _program(b"".join(struct.pack("=HBBI", *insn) for insn in program))
    libc("prctl", 38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: set on every tier already
    libc("syscall", SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, 0, pinned[2])


def notify_available() -> bool:
    if os.uname().machine != "x86_64":
        return False
    _held, address = _pinned(struct.pack("=I", SECCOMP_RET_USER_NOTIF))
    try:
        libc("syscall", SYS_SECCOMP, SECCOMP_GET_ACTION_AVAIL, 0, address)
    except OSError:
        return False
    return True


def install_exec_listener(no_memfd: bool = False) -> int:
    """Put every exec of this process and its descendants under a listener; return its fd."""
    program = _program(exec_filter(no_memfd))  # bound until the call returns: the kernel copies it
    flags = SECCOMP_FILTER_FLAG_NEW_LISTENER
    return libc("syscall", SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, flags, program[2])


def wake_on_this_cpu(listener: int) -> None:
    """Have the kernel hand each exec to the listener's reader on the caller's CPU, and the
    answer back on the reader's: the caller waits for nothing else meanwhile, so the switch
    costs no wake-up of another CPU (an idle one in a VM: an exit to the hypervisor). Linux
    6.6 and later; elsewhere each wake-up is the scheduler's ordinary one."""
    try:
        fcntl.ioctl(listener, NOTIF_SET_FLAGS, USER_NOTIF_FD_SYNC_WAKE_UP)
    except OSError:
        pass


# -- the supervisor's side: one notification ------------------------------------------------


def receive(listener: int) -> "Optional[Tuple[int, int, int, Tuple[int, ...]]]":
    """The next exec waiting: (notification id, pid, syscall number, args), or None if the
    listener has nothing (the target died meanwhile, or every process of it is gone)."""
    buf = bytearray(NOTIF.size)  # zeroed each time: the kernel refuses one that is not
    try:
        fcntl.ioctl(listener, NOTIF_RECV, buf, True)
    except OSError:
        return None
    nid, pid, _, nr, _, _, *args = NOTIF.unpack(buf)
    return nid, pid, nr, tuple(args)


def still_waiting(listener: int, nid: int) -> bool:
    try:
        fcntl.ioctl(listener, NOTIF_ID_VALID, struct.pack("=Q", nid))
    except OSError:
        return False
    return True


def answer(listener: int, nid: int, allow: bool, errno_: int = 1) -> None:
    """Let the exec go on, or fail it with ``errno_`` (EPERM by default)."""
    if allow:
        resp = RESP.pack(nid, 0, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE)
    else:
        resp = RESP.pack(nid, 0, -errno_, 0)
    try:
        fcntl.ioctl(listener, NOTIF_SEND, resp)  # read by the kernel only: bytes will do
    except OSError:
        pass  # the caller died meanwhile


def open_memory(listener: int, nid: int, pid: int) -> int:
    """The caller's memory, opened while it still waits: a pid that died and came back as
    another process between the notification and the open fails the check after the open
    (``OSError``), so that what is read afterwards is the caller's own."""
    mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    if not still_waiting(listener, nid):
        os.close(mem)
        raise OSError(errno.ESRCH, "the exec is no longer waiting")
    return mem


def _read_string(mem: int, address: int, budget: int = MAX_ARG_BYTES) -> str:
    out = b""
    while len(out) < min(budget, MAX_ARG_BYTES):
        chunk = os.pread(mem, 4096 - address % 4096 if not out else 4096, address + len(out))
        if not chunk:
            break
        end = chunk.find(b"\0")
        if end >= 0:
            return (out + chunk[:end]).decode("utf-8", "surrogateescape")
        out += chunk
    raise OSError(errno.E2BIG, "an argument too long to judge")


def read_path(mem: int, pid: int, nr: int, args: "Tuple[int, ...]") -> str:
    """The path an exec asked for, made absolute (a relative one is relative to the caller's
    working folder, or to execveat's folder), without its empty and "." parts. Its ".."
    parts are kept: each is the parent of where the links before it lead, which only a walk
    of the caller's folders tells (``execpaths.exec_path``), not of the name written before
    it."""
    if nr == NR_EXECVE:
        path_at, base = args[0], f"/proc/{pid}/cwd"
    else:
        dirfd = args[0] if args[0] < (1 << 31) else args[0] - (1 << 64)
        path_at = args[1]
        base = f"/proc/{pid}/cwd" if dirfd == -100 else f"/proc/{pid}/fd/{dirfd}"  # AT_FDCWD
    path = _read_string(mem, path_at) if path_at else ""
    if not path:  # the file a descriptor holds (fexecve): by its link, which no rename moves
        return base
    if not path.startswith("/"):
        path = os.path.join(os.readlink(base), path)
    return "/" + "/".join(part for part in path.split("/") if part not in ("", "."))


def read_argv(mem: int, nr: int, args: "Tuple[int, ...]") -> "List[str]":
    """The argv an exec asked for, from the caller's memory, every word of it; ``OSError``
    (E2BIG) past ``MAX_ARGS`` words or ``MAX_ARGV_BYTES`` (the kernel would refuse it)."""
    argv_at = args[1] if nr == NR_EXECVE else args[2]
    pointers: "List[int]" = []
    ended = not argv_at
    step = 512  # the pointer array, 64 at a time at first: most argvs are short
    while not ended:
        chunk = os.pread(mem, step, argv_at + 8 * len(pointers))
        batch = struct.unpack(f"={len(chunk) // 8}Q", chunk[: len(chunk) // 8 * 8])
        if not batch:
            break
        if 0 in batch:
            batch, ended = batch[: batch.index(0)], True
        pointers.extend(batch)
        if len(pointers) > MAX_ARGS:
            raise OSError(errno.E2BIG, "more arguments than an exec can take")
        step = min(step * 2, 1 << 16)
    argv: "List[str]" = []
    budget = MAX_ARGV_BYTES
    for pointer in pointers:
        word = _read_string(mem, pointer, budget)
        budget -= len(word.encode("utf-8", "surrogateescape")) + 1
        argv.append(word)
    return argv
