"""A sandbox's resource limits (``Limits``): the sizes of its places, sized from its memory by
one rule, and the ``Limits`` a client or a store of before that rule wrote out, read as meant.

Apart because the rule (each file's kernel memory, the places within three quarters of
``memory_mb``) is arithmetic of its own, which the other values only name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stockade._checks import MAX_TIMEOUT_S, check_number
from stockade.exceptions import InvalidArgument

MiB = 1024 * 1024
MIN_FILES_PER_PROCESS = 32  # Python and a shell need about 10 each
# The most kernel memory one file can take beyond the bytes a tmpfs counts, its name at the
# longest (255 bytes): its inode, dentry and name. Measured as the growth of the sandbox's
# cgroup over 8,000-20,000 of them: process 1,572 bytes a file, folder or short symlink,
# 1,966 with the user xattrs an inode's share of a tmpfs allows; docker 1,520 and 1,835
# (the host's slab, charged to the sandbox); gVisor 2,149-2,280 a file, 2,360 a folder,
# 2,371 a symlink, 2,512 a symlink past its target's page (its kernel's dentry beside the
# host's inode); the microVM 2,202 a file (the guest's pages, seen from the host). The
# largest, with a fifth more for other kernels' slabs.
FILE_COST_BYTES = 3072
INODES_PER_MIB = 64  # the workspace's files by default: 32,768 at 512 MiB, 96 MiB of that
MIN_SCRATCH_INODES = 256  # /tmp's and /dev/shm's at the least (a build's temporary files)
MAX_INODES = 2**31 - 1  # a tmpfs's nr_inodes on every tier's kernel
MAX_PENDING_APPROVALS = 100  # requests a run keeps pending at most (RunLimits.max_pending_approvals)


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Resource limits of one sandbox. Every tier enforces all of them or says it cannot.

    ``timeout_s`` is the default wall-clock limit of each command or ``run_code`` call; its
    clock stands still while an exec of the call waits for the sandbox's ``approver`` (a
    human's time is not the code's), for at most ``approval_wait_s`` of the call in all
    (the wall time during which at least one of its execs waited): past it, the call's
    deadline runs even while an exec waits, so that code which keeps an approval pending
    at all times still ends within ``timeout_s + approval_wait_s``;
    ``output_bytes`` caps stdout and stderr each, and a ``run_code``'s results and error
    together (bytes of JSON, cut inside with a mark: ``Execution.truncated``).
    ``open_files`` bounds the file descriptors the whole sandbox can hold: each of its (at
    most ``pids``) processes may open
    ``open_files // pids``, and at least 32 (``files_per_process``, ``total_open_files``).
    ``ptys`` bounds the pseudo-terminals it can hold open at once (its devpts instance's
    ``max``: past it, opening /dev/ptmx fails with ENOSPC), out of the host's shared
    ``kernel.pty.max``; a tier with a kernel of its own (gVisor, the microVM) takes none of the
    host's: its ptys, if any, are its kernel's, in its memory (``Enforcement.ptys``).

    The workspace, /tmp and /dev/shm are memory (tmpfs), charged to ``memory_mb``: everything
    the sandbox takes from the host's memory, processes and files together, stays within it,
    but for kernel memory a (v1) cgroup does not charge, bounded apart: TCP buffers (an
    eighth of it, at least 16 MiB) and POSIX file locks (4,096, 768 KiB, counted by the host,
    which kills the processes holding the most past them, as for memory). On gVisor, memory
    its kernel holds outside a process's address space (TCP buffers, a memfd, pipe buffers,
    AF_UNIX queues) has no bound apart: filling it ends the whole sandbox
    (``SandboxCrashed(cause="out_of_memory")``), where a process's own allocations are a
    ``MemoryError``. There and on the microVM, ``RLIMIT_AS = memory_mb`` per process also
    bounds threads (each thread's 8 MiB stack is address space; those tiers set
    ``MALLOC_ARENA_MAX=1``, so that no 64 MiB arena a thread counts too): about
    ``memory_mb / 8 MiB`` a process, whatever ``pids`` (code that needs more sets
    ``threading.stack_size()``).
    The workspace holds ``disk_mb`` MiB (three eighths of ``memory_mb`` unless given) and
    ``inodes`` files and folders (64 per MiB of ``memory_mb`` unless given: 32,768 at the
    default 512, room for a node_modules of that many files); /tmp and /dev/shm hold ``tmp_mb``
    each (a sixteenth of ``memory_mb``, at most 64, unless given) and an eighth of ``inodes``
    (at least 256). A file costs kernel memory no size counts, empty or not (its inode, its
    dentry and its name: up to ``FILE_COST_BYTES``, 3 KiB, on the tier that needs the most),
    so the rule is: everything the places can hold, their bytes and their files at that cost,
    takes at most three quarters of ``memory_mb``, and a ``Limits`` that breaks it is refused
    (``InvalidArgument`` naming the fields). So a full workspace is ``WorkspaceFull`` (ENOSPC
    inside), files past a place's count fail with ENOSPC, not a sandbox killed for memory,
    and a sandbox whose places are full still answers and resets.
    """

    memory_mb: int = 512
    cpus: float = 1.0
    pids: int = 128
    timeout_s: float = 30.0
    disk_mb: int | None = None
    inodes: int | None = None
    tmp_mb: int | None = None
    output_bytes: int = 1 * MiB
    open_files: int = 16384
    ptys: int = 64
    approval_wait_s: float = 900.0

    def __post_init__(self) -> None:
        for name, (integer, low, high, unit) in _LIMIT_RANGES.items():
            value = getattr(self, name)
            if value is None and name in ("disk_mb", "tmp_mb", "inodes"):
                continue  # sized from memory_mb
            check_number(
                value, argument=f"Limits.{name}", integer=integer, low=low, high=high,
                unit=unit, low_inclusive=low > 0 or name == "approval_wait_s",  # 0: never stands still
            )  # fmt: skip
        if 4 * self.files_memory > 3 * self.memory_mb * MiB:
            given = [name for name in ("disk_mb", "tmp_mb", "inodes") if getattr(self, name) is not None]
            needed = _least_memory(self.memory_mb, self.disk_mb, self.tmp_mb, self.inodes)
            raise InvalidArgument(
                f"Limits: the workspace ({self.workspace_mb} MiB, {self.workspace_inodes:,} files) "
                f"and /tmp and /dev/shm ({self.tmp_size_mb} MiB, {self.scratch_inodes:,} files "
                f"each) are memory, each file up to {FILE_COST_BYTES:,} bytes of the kernel's "
                f"even empty: {-(-self.files_memory // MiB)} MiB in all, which would leave less "
                f"than a quarter of memory_mb={self.memory_mb} to the processes",
                argument="Limits." + (given[-1] if given else "memory_mb"),
                fix=f"raise memory_mb to at least {needed}, or lower "
                + (", ".join(given) if given else "disk_mb, tmp_mb or inodes"),
            )

    @property
    def workspace_mb(self) -> int:
        """The workspace's size: ``disk_mb``, or three eighths of ``memory_mb`` when not given."""
        return _workspace_mb(self.memory_mb, self.disk_mb)

    @property
    def workspace_inodes(self) -> int:
        """The files and folders the workspace holds: ``inodes``, or 64 per MiB of
        ``memory_mb`` when not given."""
        return _workspace_inodes(self.memory_mb, self.inodes)

    @property
    def scratch_inodes(self) -> int:
        """The files and folders /tmp and /dev/shm hold, each: an eighth of the workspace's,
        at least 256."""
        return _scratch_inodes(self.workspace_inodes)

    @property
    def files_memory(self) -> int:
        """The most memory, in bytes, the three places can take: their sizes, and each file
        they can hold at its worst-case kernel memory (``FILE_COST_BYTES``)."""
        return _files_memory(self.memory_mb, self.disk_mb, self.tmp_mb, self.inodes)

    @property
    def tmp_size_mb(self) -> int:
        """The size of /tmp and of /dev/shm, each: ``tmp_mb``, or a sixteenth of ``memory_mb``
        (at most 64 MiB) when not given."""
        return _tmp_size_mb(self.memory_mb, self.tmp_mb)

    @property
    def files_per_process(self) -> int:
        """RLIMIT_NOFILE of every process of the sandbox: ``open_files`` shared by ``pids``
        processes, but never fewer than 32 each (a shell or Python needs about ten)."""
        return max(MIN_FILES_PER_PROCESS, self.open_files // self.pids)

    @property
    def total_open_files(self) -> int:
        """What the whole sandbox can hold: ``open_files``, or 32 per process when more."""
        return self.files_per_process * self.pids


def _workspace_mb(memory_mb: int, disk_mb: int | None) -> int:
    return disk_mb if disk_mb is not None else max(1, 3 * memory_mb // 8)


def _tmp_size_mb(memory_mb: int, tmp_mb: int | None) -> int:
    return tmp_mb if tmp_mb is not None else max(1, min(64, memory_mb // 16))


def _workspace_inodes(memory_mb: int, inodes: int | None) -> int:
    return inodes if inodes is not None else min(MAX_INODES, INODES_PER_MIB * memory_mb)


def _scratch_inodes(workspace_inodes: int) -> int:
    return max(MIN_SCRATCH_INODES, workspace_inodes // 8)


def _files_memory(memory_mb: int, disk_mb: int | None, tmp_mb: int | None, inodes: int | None) -> int:
    workspace_inodes = _workspace_inodes(memory_mb, inodes)
    sizes = _workspace_mb(memory_mb, disk_mb) + 2 * _tmp_size_mb(memory_mb, tmp_mb)
    return sizes * MiB + (workspace_inodes + 2 * _scratch_inodes(workspace_inodes)) * FILE_COST_BYTES


def _least_memory(memory_mb: int, disk_mb: int | None, tmp_mb: int | None, inodes: int | None) -> int:
    """The least ``memory_mb`` whose three quarters hold the places, those not given sized from
    it too (each grows by less than it: the search is over a rising margin)."""
    low, high = memory_mb, 1 << 33  # high fits: what is given is at most 2**32 MiB and 2**31 files
    while low < high:
        middle = (low + high) // 2
        if 4 * _files_memory(middle, disk_mb, tmp_mb, inodes) <= 3 * middle * MiB:
            high = middle
        else:
            low = middle + 1
    return low


# Limits.inodes's default before a file's kernel memory counted (2026-12-06), when the places
# were sized apart from it: a client or a store of then wrote it out with every Limits.
OLD_DEFAULT_INODES = 65536


def limits_from_fields(fields: Mapping[str, Any]) -> Limits:
    """A ``Limits`` from its fields as a client or a store wrote them out: one from before
    2026-12-06 names the then default ``inodes=65536`` whatever ``memory_mb``, which today's rule
    refuses below ~954 MiB. Meant as the default, it is taken as today's (a count asked for on
    purpose and refused stays refused)."""
    try:
        return Limits(**fields)
    except InvalidArgument:
        if fields.get("inodes") != OLD_DEFAULT_INODES:
            raise
        return Limits(**{**fields, "inodes": None})


def limits_of_old_places(fields: Mapping[str, Any]) -> Limits:
    """The ``Limits`` a sandbox kept (snapshotted, paused) before 2026-12-06 is restored with:
    its places as they were then, so its files always fit again (the workspace half of
    ``memory_mb``, /tmp and /dev/shm an eighth, at most 64 MiB, unless given, and its
    ``inodes``), and ``memory_mb`` raised to the least that holds them by today's rule. Only
    one whose count is the old default is changed: another was refused or kept as it is."""
    if fields.get("inodes") != OLD_DEFAULT_INODES:
        return limits_from_fields(fields)
    memory_mb = Limits(**{**fields, "inodes": None, "disk_mb": None, "tmp_mb": None}).memory_mb
    disk_mb, tmp_mb = fields.get("disk_mb"), fields.get("tmp_mb")
    old = {
        **fields,
        "disk_mb": memory_mb // 2 if disk_mb is None else disk_mb,
        "tmp_mb": max(1, min(64, memory_mb // 8)) if tmp_mb is None else tmp_mb,
    }
    least = _least_memory(memory_mb, old["disk_mb"], old["tmp_mb"], OLD_DEFAULT_INODES)
    return Limits(**{**old, "memory_mb": least})


# field: (whole number, lowest, highest, unit). The lowest values are what the sandbox machinery
# needs (a few processes, an interpreter's memory); the highest are what every tier's kernel,
# engine and runtime accept (PID_MAX_LIMIT; sizes whose bytes, plus a runtime's overhead, fit
# 64 bits; a tmpfs's inode count), so a value that passes here never fails at start.
_LIMIT_RANGES: dict[str, tuple[bool, float, float, str]] = {
    "memory_mb": (True, 32, 2**32, "MiB"),
    "cpus": (False, 0, 4096, "cores"),
    "pids": (True, 8, 4_194_304, "processes"),
    "timeout_s": (False, 0, MAX_TIMEOUT_S, "seconds"),
    "disk_mb": (True, 1, 2**32, "MiB"),
    "inodes": (True, 1, MAX_INODES, "inodes"),
    "tmp_mb": (True, 1, 2**32, "MiB"),
    "output_bytes": (True, 1, 2**50, "bytes"),
    "open_files": (True, 1, 2**31 - 1, "descriptors"),
    "ptys": (True, 1, 1 << 20, "pseudo-terminals"),  # NR_UNIX98_PTY_MAX
    "approval_wait_s": (False, 0, MAX_TIMEOUT_S, "seconds"),
}
