"""QEMU's command line for one microVM guest, and the machine key a snapshot must match.

A part of ``MicroVMBackend``: the guest's kernel command line (its tmpfs sizes, masks, the
egress port it waits for), QEMU's arguments (the machine, its ports, its monitor, its RAM's
file, the wait for a snapshot), wrapped in QEMU's jail, its parent-death signal and its
descriptor limit. The machine key is what of all this makes one guest's memory fit another
QEMU: boot images, ready images and memory snapshots are named or checked by it. Starting
QEMU (``_microvm_launch``) builds on it.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

from stockade.sandbox._microvm_image import PORT_NAME, clock_args, mask_args
from stockade.sandbox._microvm_instance import GUEST_OVERHEAD_MB
from stockade.sandbox._microvm_jail import ram_shim
from stockade.sandbox._microvm_settings import QEMU_FILES, TB_CACHE_MB, MiB, MicroVMSettings
from stockade.sandbox.base import SandboxSpec

# Part of every boot image's and memory snapshot's machine key: raise it when what the guest
# does around a snapshot changes (the helper, its messages).
SNAPSHOT_VERSION = "1"
CTL_NAME = f"{PORT_NAME}-ctl"


class MicroVMMachine(MicroVMSettings):
    """The QEMU command line part of ``MicroVMBackend``."""

    def _cmdline(self, spec: SandboxSpec, masks: tuple[str, ...]) -> str:
        assert self.kernel is not None
        limits = spec.limits
        ws = f"{limits.workspace_mb * MiB}:{limits.workspace_inodes}"
        tmp = f"{limits.tmp_size_mb * MiB}:{limits.scratch_inodes}"
        clock = clock_args(self.kernel)
        # loglevel=1: the console (a file of the host, QEMU's -serial) gets the kernel's
        # emergencies only; at quiet's level each OOM kill code provoked wrote a line there,
        # ~260 bytes a second of the host's disk for as long as the sandbox lived
        # init_on_free=1: the guest's kernel zeroes every page (and slab object) it frees. A
        # memory snapshot copies all of the guest's RAM, free pages too: without it, the next
        # user's snapshot of a pooled or reset guest carried the last user's files, heap and
        # uploads. (A part of the machine key: images booted without it are never restored.)
        cmdline = (
            f"console=ttyS0 quiet loglevel=1 panic=-1 pci=off init_on_free=1 {clock}"
            f" stockade_ws={ws} stockade_tmp={tmp}"
        )
        if masks:
            assert self.rootfs is not None  # masks are looked up in it
            cmdline += mask_args(self.rootfs, masks)
        if spec.network.egress:  # the guest waits for its egress port (see _argv)
            cmdline += " stockade_egress=1"
        return cmdline

    def _argv(
        self,
        spec: SandboxSpec,
        sid: str,
        *,
        files: tuple[Path, Path],
        fd: int,
        rundir: Path,
        masks: tuple[str, ...] = (),
        machine: Machine | None = None,
        egress_fd: int | None = None,
    ) -> list[str]:
        """QEMU's command line; ``machine`` adds the monitor, the helper's port, the RAM's file
        and the wait for a snapshot to restore (without it: the bare guest, for benchmarks)."""
        assert self.kernel is not None
        image, initrd = files
        memory = spec.limits.memory_mb + GUEST_OVERHEAD_MB
        egress: list[str] = []
        if egress_fd is not None:  # a second port: the only way out, to the egress proxy
            egress = ["-chardev", f"socket,id=egress,fd={egress_fd}",
                      "-device", f"virtserialport,chardev=egress,name={PORT_NAME}-egress"]  # fmt: skip
        console = rundir / "console.log"
        console.touch(mode=0o600)  # the jail binds this file alone of the run folder
        argv = [
            self.qemu, "-name", f"stockade-{sid}",
            "-M", "microvm,pit=on,pic=on,rtc=on", "-accel", _accel(self.accel), "-cpu", "max",
            "-m", str(memory), "-smp", str(max(1, math.ceil(spec.limits.cpus))),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            # QEMU's own seccomp filter: a guest that breaks into the emulator still cannot
            # exec, change ids, or use obsolete system calls on the host.
            "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
            "-kernel", str(self.kernel.vmlinuz), "-initrd", str(initrd),
            "-append", self._cmdline(spec, masks),
            "-serial", f"file:{console}",
            "-drive", f"id=root,file={image},format=raw,if=none,readonly=on",
            "-device", "virtio-blk-device,drive=root",
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=port,fd={fd}",
            "-device", f"virtserialport,chardev=port,name={PORT_NAME}",
            *egress,
        ]  # fmt: skip
        if machine is not None:
            argv += [
                "-chardev", f"socket,id=ctl,fd={machine.ctl_fd}",
                "-device", f"virtserialport,chardev=ctl,name={CTL_NAME}",
                "-chardev", f"socket,id=qmp,fd={machine.qmp_fd}", "-mon", "chardev=qmp,mode=control",
            ]  # fmt: skip
            # Always a backend named "ram": a snapshot's RAM is named by it, and must find its
            # name again in whichever guest restores it (booted, or from a boot image).
            if machine.ram is not None:
                share = "on" if machine.ram_shared else "off"
                ram = f"memory-backend-file,id=ram,size={memory}M,mem-path={machine.ram},share={share}"
            else:
                ram = f"memory-backend-ram,id=ram,size={memory}M"
            argv += ["-object", ram, "-machine", "memory-backend=ram"]
            if machine.incoming:
                argv += ["-incoming", "defer"]
        return [
            # Dies with its creator even when this process is killed outright.
            self.setpriv, "--pdeathsig", "KILL", "--",
            self.prlimit, f"--nofile={QEMU_FILES}", "--",
            *self._jailed(argv, files=(self.kernel.vmlinuz, image, initrd), console=console, machine=machine),
        ]  # fmt: skip

    def _jailed(
        self, argv: list[str], *, files: tuple[Path, ...], console: Path, machine: Machine | None
    ) -> list[str]:
        """QEMU's ``argv`` in its jail (``_microvm_jail``): what it reads, its console's file,
        and its RAM's file: its own, written through, or an image's, mapped copy on write."""
        ram = None if machine is None else machine.ram
        shared = machine is not None and machine.ram_shared
        write: tuple[Path, ...] = (console,)
        if ram is not None and shared:
            ram.touch(mode=0o600)  # to be bound; QEMU sizes a file it finds empty
            write = (console, ram)
        private = ram if ram is not None and not shared else None
        return self.jail.wrap(
            argv, read=files, write=write, private_ram=private, kvm=self.accel == "kvm",
            shim=ram_shim() if private is not None else None,
        )  # fmt: skip

    def _machine_key(self, spec: SandboxSpec, masks: tuple[str, ...]) -> str:
        """Everything that makes one guest's memory fit another QEMU: the kernel, initramfs,
        root image, QEMU itself, the RAM, vCPUs and kernel command line, and under a
        hypervisor the host's CPU. A change of any of them makes snapshots taken before
        unusable here (and boot images rebuilt)."""
        assert self.kernel is not None
        image, initrd = self.prepare()
        parts = [
            SNAPSHOT_VERSION,
            _identity(self.kernel.vmlinuz),
            initrd.name,
            image.name,
            _identity(Path(self.qemu)),
            self.accel,
            str(spec.limits.memory_mb + GUEST_OVERHEAD_MB),
            str(max(1, math.ceil(spec.limits.cpus))),
            self._cmdline(spec, masks),
        ]
        if self.accel != "tcg":
            # `-cpu max` is QEMU's own model under TCG (QEMU is above), the host's CPU under a
            # hypervisor: a guest's memory taken on one CPU may use features another lacks.
            parts.append(_host_cpu())
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()


@dataclass(frozen=True)
class Machine:
    """The parts of QEMU's command line a snapshot needs (see ``MicroVMBackend._argv``)."""

    ctl_fd: int
    qmp_fd: int
    ram: Path | None = None
    ram_shared: bool = False
    incoming: bool = False


def _identity(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return f"{path}:missing"
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


@functools.cache
def _host_cpu() -> str:
    """The host CPU's model and features (the first processor's), as /proc/cpuinfo says."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    first = text.split("\n\n", 1)[0]
    lines = [
        line
        for line in first.splitlines()
        if line.split(":", 1)[0].strip() in ("vendor_id", "model name", "flags")
    ]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _accel(accel: str) -> str:
    return f"tcg,tb-size={TB_CACHE_MB}" if accel == "tcg" else accel
