"""The jail every microVM's QEMU runs in: a guest that breaks into the emulator finds itself
in bubblewrap's namespaces (its own pid, mount, network, IPC, UTS and cgroup views), with no
capability at all (none effective, none in its bounding set), seeing only what QEMU needs:
the host's /usr read-only, the guest's kernel, initramfs and root image read-only, its
console's file, and the RAM file of the image it starts from.

QEMU runs as uid 0 without capabilities: it can open root's files as their owner, so the
mount view is the boundary for files. Nothing writable is bound but the console's file and
a RAM file written through (a boot or ready image being built: a temporary file of its own).

A RAM file mapped copy on write (a sandbox started from a boot or ready image) is a shared
object of the snapshot store (0400, root's): QEMU 7.2 opens it O_RDWR although it maps it
privately (8.2's ``rom=on`` is the fix), so it is bound read-only and ``qemu_ram.c``,
preloaded, opens exactly that path for reading. Where that library cannot be built (no C
compiler, not x86_64, no writable cache), the file is bound read-write and QEMU keeps
CAP_DAC_OVERRIDE alone: the one weaker case, said in docs/architecture.md.

Apart from ``microvm.py`` because what QEMU may see is its own concern, kept in one place.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stockade.sandbox import _native
from stockade.sandbox._rootfs import cache_root

__all__ = ["RAM_SHIM_FLAGS", "RAM_SHIM_SOURCE", "QemuJail", "ram_shim"]

RAM_SHIM_SOURCE = Path(__file__).parent / "qemu_ram.c"
RAM_SHIM_FLAGS = ("-O2", "-shared", "-fPIC", "-Wall", "-Werror")  # with the C library: it forwards
# The host's top-level folders the dynamic loader may go through (merged /usr: symlinks).
_SYSTEM = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


@functools.cache
def ram_shim(folder: Path | None = None) -> Path | None:
    """``qemu_ram.c`` built (once per host and version) into the cache; None where it cannot be."""
    return _native.build(RAM_SHIM_SOURCE, RAM_SHIM_FLAGS, folder or cache_root() / "native")


@dataclass(frozen=True)
class QemuJail:
    """How to jail QEMU: bubblewrap, and util-linux's setpriv (drops the bounding set)."""

    bwrap: str
    setpriv: str

    def wrap(
        self,
        qemu_argv: Sequence[str],
        *,
        read: Sequence[Path],
        write: Sequence[Path] = (),
        private_ram: Path | None = None,
        kvm: bool = False,
        shim: Path | None = None,
    ) -> list[str]:
        """``qemu_argv`` (QEMU's path first) started in the jail: ``read`` bound read-only,
        ``write`` read-write (files or folders, each at its own path), ``private_ram`` the RAM
        file QEMU maps copy on write (with ``shim``: read-only and no capability; without:
        read-write under CAP_DAC_OVERRIDE)."""
        argv = [self.bwrap, *self._namespaces(), "--ro-bind", "/usr", "/usr", *_system_links()]
        argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
        # The kernel's settings read-only, as Docker keeps them: QEMU is uid 0 here, and a
        # sysctl's write asks for that alone, no capability (an escaped QEMU set
        # kernel.core_pattern, a path the host's kernel runs as root on a crash); pressure
        # files take triggers (kernel memory), sysrq-trigger reboots.
        argv += ["--ro-bind", "/proc/sys", "/proc/sys"]
        for entry in _PROC_READ_ONLY:
            argv += ["--ro-bind-try", entry, entry]
        if kvm and Path("/dev/kvm").exists():
            argv += ["--dev-bind", "/dev/kvm", "/dev/kvm"]
        binary = Path(qemu_argv[0])
        for path in (*([binary] if not _under(binary, "/usr") else []), *read):
            argv += ["--ro-bind", str(path), str(path)]
        for path in write:
            argv += ["--bind", str(path), str(path)]
        keep: tuple[str, ...] = ()
        if private_ram is not None and shim is not None:
            argv += ["--ro-bind", str(private_ram), str(private_ram), "--ro-bind", str(shim), str(shim)]
            argv += ["--setenv", "LD_PRELOAD", str(shim), "--setenv", "STOCKADE_QEMU_RAM", str(private_ram)]
        elif private_ram is not None:
            argv += ["--bind", str(private_ram), str(private_ram)]
            keep = ("dac_override",)
        # bwrap (root, no user namespace) drops the effective set but keeps the bounding set;
        # setpriv, with CAP_SETPCAP for that one step, empties it before QEMU runs.
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETPCAP"]
        argv += [word for cap in keep for word in ("--cap-add", f"CAP_{cap.upper()}")]
        caps = ",".join(["-all", *(f"+{cap}" for cap in keep)])
        argv += ["--", self.setpriv, f"--inh-caps={caps}", f"--ambient-caps={caps}", f"--bounding-set={caps}"]
        return [*argv, "--", *qemu_argv]

    @staticmethod
    def _namespaces() -> list[str]:
        # No network: the guest's channels and egress port are socket descriptors passed in.
        # --die-with-parent: killing bwrap (the boundary's process) kills the pid namespace's
        # init, and with it every process of the namespace.
        return [
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session",
        ]  # fmt: skip


# What of /proc but /proc/sys a jailed QEMU may not write (where the kernel has it).
_PROC_READ_ONLY = ("/proc/sysrq-trigger", "/proc/pressure", "/proc/fs", "/proc/bus", "/proc/irq")


def _system_links() -> list[str]:
    argv: list[str] = []
    for top in _SYSTEM:
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    return argv


def _under(path: Path, folder: str) -> bool:
    return path.resolve().is_relative_to(folder)
