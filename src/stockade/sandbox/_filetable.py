"""The host's file table: what a sandbox holds in it through mappings, and the host-wide
count (``fs.file-max``) that must not run out before memory does.

A file a process maps stays open after its descriptor is closed (``mmap`` then ``close``):
the mapping holds the open file (a ``struct file``), which ``RLIMIT_NOFILE`` and so
``open_files`` never see. Repeated, one process held 65,462 (``vm.max_map_count`` mappings
each) and one 256 MiB sandbox 570,951. What bounds them is memory: each costs an open file
and a mapping, two 192-byte slab objects (``filp``, ``vm_area_struct``), both charged to the
process's memory cgroup (~450 bytes measured with the cgroup's own overhead): a sandbox holds
at most ``memory_mb`` / 384 bytes of them (``mapped_files``), and no process more than
``vm.max_map_count``.

But the host counts open files against ``fs.file-max``, host-wide, and past it every
process without ``CAP_SYS_ADMIN`` gets ``ENFILE`` (the sandboxes' supervisors, databases):
at a distribution's default (10% of memory / 1 KiB, 2.4 million here) three default sandboxes
reached it. systemd raises it to ``LONG_MAX`` for this reason: open files are then bounded by
the memory charged for them, as each sandbox's is by its ``memory_mb``. The host's setup
(``scripts/setup-host.sh``) does the same; ``stockade doctor`` says when the host's count is
below what its memory could hold (``short_by``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["FILE_BYTES", "UNBOUNDED", "file_max", "mapped_files", "max_map_count", "short_by"]

FILE_BYTES = 384  # a mapped file's open file and mapping: two 192-byte slab objects, charged
UNBOUNDED = 2**63 - 1  # LONG_MAX: the kernel's largest fs.file-max, systemd's setting
_FILE_MAX = Path("/proc/sys/fs/file-max")
_MAX_MAP_COUNT = Path("/proc/sys/vm/max_map_count")
_MEMINFO = Path("/proc/meminfo")


def _sysctl(path: Path, default: int) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def max_map_count() -> int:
    """Mappings one process may have (``vm.max_map_count``; the kernel's default if unread)."""
    return _sysctl(_MAX_MAP_COUNT, 65530)


def file_max() -> int:
    """The host's bound on open files, all processes together (``fs.file-max``)."""
    return _sysctl(_FILE_MAX, 0)


def mapped_files(memory_mb: int, tasks: int, per_task: int | None = None) -> int:
    """The most files a sandbox holds open through mappings alone: what its memory pays for,
    and no more than ``per_task`` mappings (``vm.max_map_count``) in each of its tasks."""
    per_task = max_map_count() if per_task is None else per_task
    return min(memory_mb * (1 << 20) // FILE_BYTES, tasks * per_task)


def host_memory() -> int:
    """The host's memory, in bytes (0 if unread)."""
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def short_by(limit: int, memory: int) -> int:
    """How many fewer open files ``limit`` (``fs.file-max``) allows than sandboxes whose
    memory fills the host's ``memory`` bytes could hold through mappings; 0 when none."""
    return max(0, memory // FILE_BYTES - limit)
