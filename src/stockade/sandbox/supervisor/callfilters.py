"""The calls the supervisor refuses to itself and all it starts, whatever the rules: the
kernel's own hardening of a sandbox (memory no cgroup charges, its init shielded, memfds
where no exec listener refuses them, no seccomp filter added after ours), and how a classic
seccomp filter is handed to the kernel (``sock_fprog``), which the exec listener's
(``confine``) goes through too.

Apart from ``confine`` (the policy's rules: Landlock and the exec listener) because a start
on gVisor or under a tier's kernel filters installs these and none of those: it loads this
module alone. Standard library only; calls go through ``libc.libc``, buffers are pinned by
``libc.pin``.
"""

from __future__ import annotations

import struct

from libc import libc, pin

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, List, Sequence, Tuple

SYS_SECCOMP = 317
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
AUDIT_ARCH_X86_64 = 0xC000003E
NR_MEMFD_CREATE = 319


def sock_fprog(code: bytes) -> "Tuple[Any, Any, int]":
    """A BPF program the kernel can read (``struct sock_fprog``): its instructions and the
    header pinned (both must be kept while it reads them), and the header's address."""
    held, address = pin(code)
    prog, prog_address = pin(struct.pack("=HxxxxxxQ", len(code) // 8, address))
    return held, prog, prog_address


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
    pinned = sock_fprog(code)  # bound until the call returns: the kernel copies it
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
    pinned = sock_fprog(b"".join(struct.pack("=HBBI", *insn) for insn in program))
    libc("prctl", 38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: set on every tier already
    libc("syscall", SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, 0, pinned[2])
