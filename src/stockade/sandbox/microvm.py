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

Here: the backend's probe and starts (cold, from a boot image, from a ready image) and the
supervisor's configuration. ``MicroVMBackend`` is made of parts, each a base class of the
next: its settings, checks and plan (``_microvm_settings``), QEMU's command line and the
machine key (``_microvm_machine``), QEMU started for a sandbox (``_microvm_launch``), boot
images and restores from a memory snapshot (``_microvm_snapshots``). What a killed process
left behind is collected without a backend (``_microvm_rundirs``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade.sandbox import _guest, _rules
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._microvm_ahead import GuestOrder, Waiting
from stockade.sandbox._microvm_instance import SocketStream, VMBoundary, VMInstance
from stockade.sandbox._microvm_launch import Launch, seal_written
from stockade.sandbox._microvm_ready import ReadyBuild, ReadyImage, image_config, resume_args
from stockade.sandbox._microvm_rundirs import collect_garbage
from stockade.sandbox._microvm_settings import START_TIMEOUT_S
from stockade.sandbox._microvm_snapshots import MicroVMSnapshots
from stockade.sandbox._supervised import SupervisedInstance
from stockade.sandbox._supervised_config import sandbox_id, supervisor_config
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.spare import on_background_thread
from stockade.types import Enforcement, SnapshotKind, TierReport

# collect_garbage: re-exported, the tier's entry for ``stockade gc``
__all__ = ["MicroVMBackend", "collect_garbage"]


# What the guest runs of its image at boot (start.sh), the supervisor's python3 among them:
# left in the view whatever an allowlist lists.
GUEST_RUNS = ("python3", "sh", "unshare", "env", "setpriv", "nice")


class MicroVMBackend(MicroVMSnapshots):
    """QEMU ``microvm`` guests; needs root (reads /boot), the offline rootfs, QEMU and busybox."""

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
                seal_written(boundary, spec)
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
                seal_written(boundary, spec)
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
            seal_written(waiting.boundary, spec)
            instance.reseed(resume_args(self._config(spec, waiting.boundary.egress), image))
        except BaseException:
            instance.close()
            raise
        return instance
