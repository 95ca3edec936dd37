"""What of the host a sandbox does not see: the files every tier masks, and why.

The process and container tiers share the host's kernel, so its /proc and /sys describe the
host: its boot (kernel command line, boot id), its kernel build (symbols, modules, build
configuration), its firmware and hardware identity, the keys and timers of other users.
A sandbox needs none of that; programs need /proc/self, /proc/meminfo, /proc/cpuinfo,
/proc/stat, /proc/uptime and /proc/loadavg (ps, free, nproc, top, psutil), which stay, and
uname, which no file hides (it is a system call). Masked files read empty, masked folders
are empty. gVisor and the microVM run their own kernel: what they show is their own.
docs/architecture.md lists what remains visible on each tier.
"""

from __future__ import annotations

import functools
from pathlib import Path

# Files that name or fingerprint the host. Those the running kernel lacks are skipped.
PROC_FILES = (
    "/proc/cmdline",  # the host's boot arguments and boot image
    "/proc/sys/kernel/random/boot_id",  # one id per host boot: links sandboxes to a host
    "/proc/kallsyms",  # the kernel's symbols (its exact build)
    "/proc/modules",  # loaded modules
    "/proc/config.gz",  # the kernel's build configuration
    "/proc/keys",  # keyrings
    "/proc/key-users",  # per host uid key counts, other users' included
    "/proc/timer_list",  # every timer of the host, with the tasks' names
    "/proc/timer_stats",
    "/proc/sched_debug",  # every task of the host
    "/proc/latency_stats",
    "/proc/kcore",  # the kernel's memory
)
# Folders of hardware and firmware details (docker masks the first three by default).
PROC_DIRS = ("/proc/acpi", "/proc/asound", "/proc/scsi", "/proc/bus")
SYS_DIRS = (
    "/sys/firmware",  # ACPI tables, DMI, EFI variables
    "/sys/devices/virtual/dmi",  # the machine's vendor, product, serial and uuid
    "/sys/devices/virtual/powercap",  # energy counters (a side channel, CVE-2020-8694)
    "/sys/hypervisor",  # the VM's uuid on Xen
    "/sys/kernel",  # the kernel's build id (notes), vmcoreinfo, boot parameters
    "/sys/module",  # modules, and parameters set on the host's command line
)


def engine_masked_paths() -> list[str]:
    """``HostConfig.MaskedPaths`` for container engines: it replaces the engine's defaults
    (listed above with ours), and paths a container lacks are skipped by the runtime."""
    return [*PROC_FILES, *PROC_DIRS, *SYS_DIRS]


@functools.cache
def bwrap_masks(proc: Path = Path("/proc")) -> tuple[str, ...]:
    """bubblewrap arguments that mask the host files of a fresh /proc (after ``--proc``).

    The sandbox's /proc is the same kernel's, so what exists in the host's exists there;
    bwrap refuses to mount over a missing path, hence the check. There is no /sys.
    /dev/null is bound as a device, as container runtimes do, so that a masked file reads
    empty (a plain bind is ``nodev``: reading it would fail); writes to it go nowhere.
    Computed once: the kernel does not change under a running process.
    """
    argv: list[str] = []
    for path in PROC_FILES:
        if (proc / path.removeprefix("/proc/")).exists():
            argv += ["--dev-bind", "/dev/null", path]
    for path in PROC_DIRS:
        if (proc / path.removeprefix("/proc/")).is_dir():
            argv += ["--tmpfs", path, "--remount-ro", path]
    return tuple(argv)
