"""Starting QEMU for one sandbox, and the instance made of the guest it runs.

A part of ``MicroVMBackend``: the run folder claimed, the sockets QEMU is handed (the
supervisor's port, the helper's control port, the monitor, the egress port), QEMU forked
under the host cgroup that bounds the whole VM, and all of it undone when the start fails.
A QEMU started on an image gets the sandbox's egress proxy only when its guest becomes the
sandbox. Boot images and restores (``_microvm_snapshots``) and the backend's starts build
on it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from stockade import _exit
from stockade import exceptions as exc
from stockade.sandbox import _cgroups, _guest, _host, _rules
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._lasting import spawn
from stockade.sandbox._microvm_instance import SocketStream, VMBoundary, VMInstance
from stockade.sandbox._microvm_machine import Machine, MicroVMMachine
from stockade.sandbox._microvm_settings import QEMU_PIDS, MiB, host_memory_mb
from stockade.sandbox.base import SandboxSpec
from stockade.types import Enforcement, Mechanism


class MicroVMLaunch(MicroVMMachine):
    """The part of ``MicroVMBackend`` that starts QEMU."""

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


def seal_written(boundary: VMBoundary, spec: SandboxSpec) -> None:
    """Under an allowlist, the guest's written places noexec (``_rules.written_noexec``): once
    the guest is this sandbox's, before its first request."""
    if _rules.written_noexec(spec):
        boundary.noexec()


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
