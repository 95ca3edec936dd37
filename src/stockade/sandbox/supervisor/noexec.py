"""The written places made ``noexec`` from inside, where the tier cannot (gVisor under Docker).

Under an allowlist no file the code wrote may run (``_rules.written_noexec``). The engine
binds the workspace, /tmp and /dev/shm into gVisor without ``noexec`` (its binds take no such
option), so gVisor ran a static program the code wrote there. The boot (``_guest.BOOT``),
single-threaded and before anything is forked, enters a user and mount namespace of its
own (its uid and gid mapped to themselves: what code sees, and the owner of what it writes,
stay the same), bind-remounts each written place ``noexec`` keeping the flags it had, and
drops the capabilities the new namespace gave it: nothing it starts has any. The filter it
installs next (``_seccomp``) refuses every call that makes, joins or changes a namespace or
a mount (unshare, setns, clone's namespace flags, mount, umount2, pivot_root, the new mount
API), for it and all it starts: code cannot make a view where the flag is cleared.

Standard library only: calls go through ``libc.libc``, buffers are pinned by
``libc.pin``.
"""

from __future__ import annotations

import os
import struct

from libc import libc, pin

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Sequence

SYS_CAPSET, SYS_MOUNT, SYS_UNSHARE = 126, 165, 272
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND = 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs's flags -> mount's: a remount that drops a flag the place had fails (a locked one)
# or clears it
KEPT = (
    (os.ST_RDONLY, MS_RDONLY),
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)
CAP_VERSION_3 = 0x20080522


def own_view() -> None:
    """A user and mount namespace of our own, our ids mapped to themselves. Single-threaded
    only (the kernel refuses a user namespace to a threaded process)."""
    uid, gid = os.getuid(), os.getgid()
    libc("syscall", SYS_UNSHARE, CLONE_NEWUSER | CLONE_NEWNS)
    for name, mapped in (("uid_map", uid), ("gid_map", gid)):
        fd = os.open(f"/proc/self/{name}", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, f"{mapped} {mapped} 1\n".encode())
        finally:
            os.close(fd)


def remount_noexec(place: str) -> None:
    """Bind-remount ``place`` ``noexec``, with the flags it has."""
    had = os.statvfs(place).f_flag
    flags = MS_BIND | MS_REMOUNT | MS_NOEXEC
    for shown, flag in KEPT:
        if had & shown:
            flags |= flag
    _held, target = pin(os.fsencode(place) + b"\0")
    libc("syscall", SYS_MOUNT, 0, target, 0, flags, 0)


def drop_capabilities() -> None:
    """Give up every capability the new user namespace gave us: effective, permitted and
    inheritable, so that no fork (the zygote's interpreters are not exec'd) has any."""
    _held_header, header = pin(struct.pack("=Ii", CAP_VERSION_3, 0))
    _held_data, data = pin(bytes(24))  # two of (effective, permitted, inheritable)
    libc("syscall", SYS_CAPSET, header, data)


def seal_written(places: "Sequence[str]") -> None:
    """Make ``places`` ``noexec`` in a view of our own, for us and all we start; raises
    ``OSError`` where the kernel refuses (the start then fails: the tier promised it)."""
    own_view()
    for place in places:
        remount_noexec(place)
    drop_capabilities()
