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
buffers are ``bytearray``s pinned by ``_ctypes`` (``libc.pin``), calls go through
``libc.libc``. The calls refused whatever the rules, and how a filter is handed to the kernel
(``sock_fprog``), are ``callfilters``: a start may need those and none of these.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct

from callfilters import (
    AUDIT_ARCH_X86_64,
    NR_MEMFD_CREATE,
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_ERRNO,
    SECCOMP_SET_MODE_FILTER,
    SYS_SECCOMP,
    sock_fprog,
)
from libc import libc, pin

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import List, Optional, Sequence, Tuple

SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
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

SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
SECCOMP_GET_ACTION_AVAIL = 2
SECCOMP_RET_USER_NOTIF = 0x7FC00000
SECCOMP_RET_KILL_PROCESS = 0x80000000
NR_EXECVE, NR_EXECVEAT = 59, 322
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
    _held, address = pin(struct.pack("=Q", handled))  # the fs rights: the older, smaller struct
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
                _held, address = pin(struct.pack("=Qi", rights, target))  # packed, as the kernel's
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


def notify_available() -> bool:
    if os.uname().machine != "x86_64":
        return False
    _held, address = pin(struct.pack("=I", SECCOMP_RET_USER_NOTIF))
    try:
        libc("syscall", SYS_SECCOMP, SECCOMP_GET_ACTION_AVAIL, 0, address)
    except OSError:
        return False
    return True


def install_exec_listener(no_memfd: bool = False) -> int:
    """Put every exec of this process and its descendants under a listener; return its fd."""
    program = sock_fprog(exec_filter(no_memfd))  # bound until the call returns: the kernel copies it
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
