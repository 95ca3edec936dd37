"""The seccomp filter of the process tier: refuse the kernel surface code has no use for.

Built with libseccomp (through ``pyseccomp``), exported as classic BPF and handed to
bubblewrap. The list follows Docker's default profile and Flatpak's: mount and namespace
syscalls, tracing, kernel modules and kexec, BPF, keyrings, raw and packet sockets,
io_uring, perf, userfaultfd, memfd_secret, vsock; and what takes host memory or a host-wide quota no
cgroup charges to the sandbox: AIO contexts, netlink sockets, UDP on a loopback-only
network, NUMA policies (``mbind``); and OFD locks, which can outlive every process
(``_locks``), and leases, and threads of a descriptor table of their own (which that count
would not read); and the calls that
set another process's resource limits or scheduling (``OWN_ONLY``). ``clone3`` answers
ENOSYS so that libc falls back to ``clone``, whose flags can be inspected (the arguments of
``clone3`` live in memory BPF cannot read).
"""

from __future__ import annotations

import errno
import functools
import io
import socket
from typing import Any

from stockade.exceptions import ConfigurationError

DENIED = (
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "unshare",
    "setns",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "init_module",
    "finit_module",
    "delete_module",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    # each secret page is taken out of the kernel's direct map, splitting the host's huge
    # pages for good (until a reboot), charged to no cgroup: 8 MiB took 12 GiB of 1 GiB maps
    "memfd_secret",
    # a NUMA policy on each page of a shared file is kernel memory no cgroup charges: 3 M calls
    # from a 128 MiB sandbox held 1 GB of the host's (Docker's profile refuses them alike)
    "mbind",
    "set_mempolicy",
    "set_mempolicy_home_node",
    "migrate_pages",
    "move_pages",
    "keyctl",
    "add_key",
    "request_key",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "acct",
    "swapon",
    "swapoff",
    "syslog",
    "quotactl",
    "quotactl_fd",
    "nfsservctl",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "stime",
    "iopl",
    "ioperm",
    "lookup_dcookie",
    "open_by_handle_at",
    "name_to_handle_at",
    "vhangup",
    "uselib",
    "personality",
    "fanotify_init",
    "sethostname",
    "setdomainname",
)
# Namespace flags that clone must not carry (CLONE_NEWNS ... CLONE_NEWCGROUP, CLONE_NEWTIME).
NAMESPACE_FLAGS = (
    0x00020000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x02000000 | 0x00000080
)
# A thread (CLONE_THREAD) must share its creator's descriptor table (CLONE_FILES): one with its
# own held 300,000 POSIX locks that no process's fdinfo listed (``_locks`` reads each process's
# table, a thread group's leader's). glibc, musl, Go and the JVM always share it.
CLONE_THREAD, CLONE_FILES = 0x00010000, 0x00000400
F_OFD_LOCKS = (36, 37, 38)  # fcntl's F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW
F_SETLEASE = 1024
# The calls that set a process's resource limits, scheduling or I/O class, named by its pid:
# code runs as the supervisor's uid, which is all the kernel asks of them, so it could
# change the supervisor's (the sandbox's pid 1) as its own: RLIMIT_CPU (1, 1) on it was the
# kernel's own SIGKILL once it had used a second of CPU (at once on a microVM), which no
# filter of signals stops; RLIMIT_AS, its death at its next allocation; RLIMIT_NOFILE, a
# supervisor that can open nothing; SCHED_IDLE or nice 19, its starvation. Each
# is refused (EPERM) unless it names the caller as 0, as glibc's setrlimit, nice, and
# Python's resource.setrlimit, os.nice and os.sched_setaffinity(0, ...) do: a filter cannot
# tell the caller's own pid (nor a thread's) from another's. Getting them stays allowed.
# Those that name it first (prlimit64 and setpriority, ioprio_set: see _own_process_only):
OWN_ONLY = ("sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr")
PRIO_PROCESS = 0  # setpriority's `which`: a process (not its group, not all of a uid's)
IOPRIO_WHO_PROCESS = 1
# Socket options that hold kernel memory no cgroup charges, bounded per socket only by the
# network namespace's optmem_max (128 KiB here) and so by open_files in all: TCP MD5 keys
# (192 bytes each: 3.6 M of them held 670 MB of the host's from a 128 MiB sandbox) and
# classic BPF socket filters (their JIT code, outside the cgroup and counted against the
# host's shared bpf_jit_limit, which every unprivileged filter needs: bubblewrap's seccomp
# filter of each new sandbox among them). (level, option): EPERM.
UNCHARGED_SOCKOPTS = (
    (socket.IPPROTO_TCP, 14),  # TCP_MD5SIG
    (socket.IPPROTO_TCP, 32),  # TCP_MD5SIG_EXT
    (socket.SOL_SOCKET, 26),  # SO_ATTACH_FILTER
    (socket.SOL_SOCKET, 51),  # SO_ATTACH_REUSEPORT_CBPF
    # Timestamps queued on a socket's error queue, never read: ~830 bytes each, charged to no
    # cgroup, up to SO_RCVBUF a socket (888 MiB from a 128 MiB sandbox, data-less ones; the
    # namespace's tstamp_allow_data=0 drops those asked per sendmsg without this option).
    (socket.SOL_SOCKET, 37),  # SO_TIMESTAMPING
    (socket.SOL_SOCKET, 65),  # SO_TIMESTAMPING_NEW
)
TIOCSTI = 0x5412
TIOCLINUX = 0x541C


@functools.cache
def filter_bpf(*, datagrams: bool = False) -> bytes:
    """The filter; ``datagrams``: UDP sockets refused too, for a sandbox whose loopback is its
    only network (see below)."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as err:  # OSError: libseccomp.so.2 is missing
        raise ConfigurationError(
            f"the process tier needs libseccomp ({err}); install it: apt-get install libseccomp2"
        ) from None
    eperm = sc.ERRNO(errno.EPERM)
    f = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        try:
            f.add_rule(eperm, name)
        except (RuntimeError, ValueError, OSError):
            continue  # not a syscall on this architecture
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    # Kernel memory no cgroup (v1) charges to the sandbox, and host-wide quotas: one
    # io_setup(65536) took every AIO context of the host (fs.aio-max-nr: ENOSYS, libaio's
    # users fall back to threads); one netlink socket's receive queue pinned 8 MB of the host
    # (a few hundred of them, gigabytes); a UDP socket's buffers on a loopback-only network
    # likewise, up to the host's shared udp_mem.
    f.add_rule(sc.ERRNO(errno.ENOSYS), "io_setup")
    if datagrams:
        for inet in (socket.AF_INET, socket.AF_INET6):
            f.add_rule(
                sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.EQ, inet),
                sc.Arg(1, sc.MASKED_EQ, 0xF, socket.SOCK_DGRAM),
            )  # fmt: skip
    for flag in _bits(NAMESPACE_FLAGS):
        f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD | CLONE_FILES, CLONE_THREAD))
    # File locks are kernel memory no cgroup charges either; the host counts each process's
    # (``_locks``). An OFD lock belongs to an open file, which can outlive every process (one
    # in flight in a socket's queue): EINVAL, as before Linux 3.15, which its users handle.
    for command in F_OFD_LOCKS:
        f.add_rule(sc.ERRNO(errno.EINVAL), "fcntl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, command))
    # Leases likewise (their own slab, which ``_locks`` does not count: 60,000 held through
    # mappings); and a process holding 40,000 on one file spent 95 s of a host core freeing
    # them after its sandbox was gone. EACCES: the kernel's own answer to a caller it refuses.
    f.add_rule(sc.ERRNO(errno.EACCES), "fcntl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, F_SETLEASE))
    # 15: AF_KEY (IPsec key management); 40: AF_VSOCK, which no network namespace covers:
    # on a VM host it reaches the hypervisor (CID 2) from a sandbox without network; netlink
    # (above: uncharged kernel memory; glibc does without it).
    for family in (socket.AF_PACKET, 15, 40, socket.AF_NETLINK):
        f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.EQ, family))
    f.add_rule(eperm, "socket", sc.Arg(1, sc.MASKED_EQ, 0xF, socket.SOCK_RAW))
    for level, option in UNCHARGED_SOCKOPTS:
        level_is, option_is = (sc.Arg(i, sc.MASKED_EQ, 0xFFFFFFFF, v) for i, v in ((1, level), (2, option)))
        f.add_rule(eperm, "setsockopt", level_is, option_is)
    _own_process_only(f, sc, eperm)
    f.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
    f.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, TIOCLINUX))
    buf = io.BytesIO()
    _export(f, buf)
    return buf.getvalue()


def _own_process_only(f: Any, sc: Any, eperm: Any) -> None:
    """``OWN_ONLY``'s rules: a process may set its own limits and scheduling, not another's.
    Compared on all 64 bits: a pid's high half is garbage the kernel drops, so a call that
    names the caller with garbage there is refused too (none of libc's does)."""
    f.add_rule(eperm, "prlimit64", sc.Arg(0, sc.NE, 0), sc.Arg(2, sc.NE, 0))  # a pid, a new limit
    for name in OWN_ONLY:
        f.add_rule(eperm, name, sc.Arg(0, sc.NE, 0))
    # setpriority(which, who, prio) and ioprio_set(which, who, ioprio): a process group's or
    # a uid's would reach the supervisor too.
    f.add_rule(eperm, "setpriority", sc.Arg(0, sc.NE, PRIO_PROCESS))
    f.add_rule(eperm, "setpriority", sc.Arg(1, sc.NE, 0))
    f.add_rule(eperm, "ioprio_set", sc.Arg(0, sc.NE, IOPRIO_WHO_PROCESS))
    f.add_rule(eperm, "ioprio_set", sc.Arg(1, sc.NE, 0))


def _export(f: object, buf: io.BytesIO) -> None:
    import os
    import tempfile

    with tempfile.TemporaryFile() as fh:
        f.export_bpf(fh)  # type: ignore[attr-defined]
        fh.flush()
        os.lseek(fh.fileno(), 0, os.SEEK_SET)
        buf.write(fh.read())


def _bits(mask: int) -> list[int]:
    return [1 << i for i in range(32) if mask & (1 << i)]
