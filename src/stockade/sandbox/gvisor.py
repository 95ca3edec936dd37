"""The gVisor tier: the sandbox runs on gVisor's user-space kernel (``runsc``).

Two ways to get there, chosen by ``mode``:

* ``"docker"``: a Docker container with ``runtime="runsc"`` (the Docker tier's code);
* ``"runsc"``: no engine at all; stockade writes an OCI bundle (the offline rootfs, the same
  limits in ``config.json``) and runs ``runsc run`` on it, stdin/stdout to the supervisor;
* ``"auto"`` (default): Docker when the engine answers, ``runsc`` otherwise.

The workspace, /tmp and /dev/shm are tmpfs mounted on the host (size and inode limits the host kernel
enforces) and bound in: gVisor's own tmpfs cannot limit inodes. ``platform`` is runsc's
platform for the direct mode; with Docker it is the one registered for the runtime
(scripts/setup-docker.sh). ``systrap`` by default: it holds a bounded number of host tasks
(about 2.5 per process inside, given back when they exit), so the host's task limit can sit
just above ``pids``; ``ptrace`` starts commands faster on some hosts (twice as fast on nested
ones) but keeps every stub it ever made, so only a loose backstop holds it. KVM hangs on
nested hosts.

Snapshots keep memory in both modes (``runsc checkpoint``, ``_gvisor_memory.py``): under
Docker, stockade checkpoints the container with the engine's own runsc state (a local engine
and root: the workspace and /tmp are host tmpfs). Either mode restores a memory snapshot of
either, with stockade's own runsc.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, Literal

from stockade import _exit
from stockade import exceptions as exc
from stockade.sandbox import _guest, _gvisor_memory, _host, _rules, _trusted
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._gvisor_memory import RunscInstance
from stockade.sandbox._host import PipeStream
from stockade.sandbox._rootfs import find_rootfs
from stockade.sandbox._supervised import Boundary, SupervisedInstance, enforcement_from_state
from stockade.sandbox._supervised_calls import UNPRIORITIZED_TIMEOUT_MARGIN_S
from stockade.sandbox._supervised_config import WORKSPACE, sandbox_id, supervisor_config
from stockade.sandbox.base import Backend, SandboxSpec
from stockade.sandbox.snapshots import SnapshotStore
from stockade.sandbox.supervisor.protocol import HMAC_SHA256
from stockade.types import Enforcement, HostShare, Mechanism, SnapshotKind, TierReport

__all__ = ["GVisorBackend", "RunscBackend", "collect_garbage"]

Mode = Literal["auto", "docker", "runsc"]
START_TIMEOUT_S = 30.0
DEFAULT_PLATFORM = "systrap"
# Not the process tier's "stockade": its garbage collector owns every cgroup under that one.
CGROUP_PARENT = "stockade-gvisor"


class GVisorBackend(Backend):
    tier = "gvisor"

    def __init__(
        self,
        *,
        mode: Mode | None = None,
        platform: str | None = None,
        runtime: str = "runsc",
        image: str | None = None,
        rootfs: Path | None = None,
        runsc: str | None = None,
    ) -> None:
        chosen = mode or os.environ.get("STOCKADE_GVISOR_MODE") or "auto"
        if chosen not in ("auto", "docker", "runsc"):
            raise exc.ConfigurationError(f"gVisor mode must be auto, docker or runsc, not {chosen!r}")
        self.mode: Mode = chosen  # type: ignore[assignment]  # checked just above
        self.platform = platform or os.environ.get("STOCKADE_GVISOR_PLATFORM") or DEFAULT_PLATFORM
        self._docker_args = (runtime, image)
        self._runsc_args = (rootfs, runsc)
        self._inner: Backend | None = None
        self._restorer: RunscBackend | None = None
        self._lock = threading.Lock()

    def _docker(self) -> Backend:
        from stockade.sandbox.docker import DockerBackend

        runtime, image = self._docker_args
        return DockerBackend(runtime=runtime, image=image, tier=self.tier, own_kernel=True)

    def _runsc(self) -> RunscBackend:
        rootfs, runsc = self._runsc_args
        return RunscBackend(platform=self.platform, rootfs=rootfs, runsc=runsc)

    def backend(self) -> Backend:
        """The mechanism in use; ``auto`` decides once, on first use."""
        with self._lock:
            if self._inner is None:
                if self.mode == "docker":
                    self._inner = self._docker()
                elif self.mode == "runsc":
                    self._inner = self._runsc()
                else:
                    self._inner = self._docker() if _engine_answers() else self._runsc()
            return self._inner

    def unwalled_network(self) -> str | None:
        return None  # its runsc or Docker backend refuses a whole network itself

    def probe(self) -> TierReport:
        try:
            inner = self.backend()
        except exc.StockadeError as err:
            return TierReport(tier=self.tier, available=False, detail=str(err))
        report = inner.probe()
        if isinstance(inner, RunscBackend):
            how = f"runsc --platform={self.platform}"
            kept = "snapshots keep memory (runsc checkpoint)"
        elif getattr(inner, "host_tmpfs", False):
            how = "Docker runtime"
            kept = "snapshots keep memory (runsc checkpoint of the container, restored by runsc)"
        else:
            how = "Docker runtime"
            kept = (
                "snapshots keep files only (memory needs a local engine and root, "
                "or STOCKADE_GVISOR_MODE=runsc)"
            )
        return TierReport(
            tier=self.tier,
            available=report.available,
            enforcement=report.enforcement,
            detail=f"{how}: {report.detail}; {kept}",
            fixes=report.fixes,
        )

    def start(self, spec: SandboxSpec) -> SupervisedInstance:
        inner = self.backend()
        if (
            spec.snapshot is not None
            and spec.snapshot.kind is SnapshotKind.MEMORY
            and spec.snapshot.tier == self.tier
            and not isinstance(inner, RunscBackend)
        ):
            # A memory image is restored by stockade's own runsc, whoever ran its sandbox.
            with self._lock:
                if self._restorer is None:
                    self._restorer = self._runsc()
            inner = self._restorer
        started = inner.start(spec)
        assert isinstance(started, SupervisedInstance)
        return started


def _engine_answers() -> bool:
    try:
        from stockade.sandbox.docker import DockerBackend

        DockerBackend()._api().ping()
    except Exception:  # any failure means: no usable engine, use runsc directly
        return False
    return True


# -- runsc without Docker -------------------------------------------------------------------


class _RunscBoundary(Boundary):
    def __init__(
        self, backend: RunscBackend, sid: str, proc: subprocess.Popen[bytes], bundle: Path, mounts: list[Path]
    ) -> None:
        self.backend = backend
        self.sid = sid
        self.proc = proc
        self.bundle = bundle
        self.mounts = mounts

    def alive(self) -> bool:
        return not self._dead and self.proc.poll() is None

    def oom_kills(self) -> int | None:
        for counter in (
            Path("/sys/fs/cgroup/memory", CGROUP_PARENT, self.sid, "memory.oom_control"),
            Path("/sys/fs/cgroup", CGROUP_PARENT, self.sid, "memory.events"),
        ):
            found = _guest.read_oom_kills(counter)
            if found is not None:
                return found
        return None

    def _kill(self) -> None:
        # The channel closed the supervisor's stdin first, so a healthy sandbox is already
        # exiting; a stuck one is killed. Deleting a running sandbox would wait seconds.
        try:
            self.proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            self.backend.signal(self.sid, "KILL")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        self.backend.destroy(self.sid)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        _release(self.bundle, self.mounts)


def _preload_supervisor(config: dict[str, Any], egress: EgressHandle | None) -> None:
    """The egress connect shortcut in the supervisor's environment too (where there is one):
    the interpreters it forks for ``run_code`` take it."""
    if egress is not None and egress.preload is not None:
        config["process"]["env"].append(f"LD_PRELOAD={egress.preload}")


def _memory_group(sid: str) -> Path:
    return Path("/sys/fs/cgroup/memory", CGROUP_PARENT, sid)


def _hold_memory_group(sid: str, limit: int) -> None:
    """Make the sandbox's v1 memory cgroup, with its ``limit``, before runsc does: runsc
    removes only the groups it made (and limits only those), and this one's OOM count must
    outlive the sandbox, which its memory limit may kill whole (gVisor's kernel and its TCP
    buffers are charged to it): the caller is then told it ran out of memory. Removed with
    the bundle (``_release``)."""
    if not Path("/sys/fs/cgroup/memory/memory.oom_control").exists():
        return  # cgroup v2: the group's memory.events goes with it
    group = _memory_group(sid)
    try:
        group.mkdir(parents=True, exist_ok=True)
        for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
            if (group / name).exists():  # memsw: only with swap accounting
                (group / name).write_text(str(limit))
    except OSError as err:
        raise exc.SandboxStartError(f"cannot limit the sandbox's memory at {group}: {err}") from err


def _release(bundle: Path, mounts: list[Path], egress: EgressHandle | None = None) -> None:
    if egress is not None:
        egress.close()
    for mount in mounts:
        _guest.umount(mount)
    with contextlib.suppress(OSError):  # absent, or (gc) a live sandbox's processes in it
        _memory_group(bundle.name.removeprefix("gv-")).rmdir()
    shutil.rmtree(bundle, ignore_errors=True)
    _host.release_folder(bundle)


class RunscBackend(Backend):
    """``runsc run`` on an OCI bundle stockade writes; needs root and the offline rootfs."""

    tier = "gvisor"

    def __init__(
        self,
        *,
        platform: str = DEFAULT_PLATFORM,
        rootfs: Path | None = None,
        runsc: str | None = None,
        state_dir: Path | None = None,
    ) -> None:
        self.platform = platform
        self.rootfs = Path(rootfs) if rootfs else find_rootfs()
        self.runsc = runsc or shutil.which("runsc") or ""
        self.state_dir = state_dir or _guest.default_state_dir()
        self.root = self.state_dir / "runsc"
        self.creator = _guest.current_creator()
        self._collected = False
        self._compile_failed = False

    def _argv(self, *args: str, egress: bool = False) -> list[str]:
        # --host-uds=open: the sandbox may connect to a host socket bound into it (the egress
        # proxy's, the only one there is).
        uds = ["--host-uds=open"] if egress else []
        return [
            self.runsc,
            "--root",
            str(self.root),
            f"--platform={self.platform}",
            "--network=none",
            *uds,
            *args,
        ]

    def _check(self, *, rootfs: bool = True) -> None:
        """What runsc needs here (``rootfs``: the offline root filesystem too; the restore of a
        container's image has its image's own)."""
        if not self.runsc:
            raise exc.TierUnavailable(
                "runsc is not installed: apt-get install runsc (or bash scripts/setup-docker.sh)"
            )
        if os.geteuid() != 0:
            raise exc.TierUnavailable(
                "runsc without Docker needs root here (rootless runsc cannot set limits)"
            )
        if rootfs and (self.rootfs is None or not (self.rootfs / "usr/bin/python3").exists()):
            raise exc.ImageNotFound(
                "no offline root filesystem with python3 for runsc; build it with "
                "`stockade image build --offline`, or set STOCKADE_ROOTFS"
            )

    def _plan(self, spec: SandboxSpec) -> Enforcement:
        if spec.network.unrestricted:
            raise exc.LimitNotEnforceable(
                "the gvisor tier gives no network but through an allowlist proxy",
                setting="network",
                fix="list the hosts (NetworkPolicy(allow_hosts=...)), or use tier='docker'",
            )
        own = _guest.own_kernel_limits(spec, self.platform)
        return Enforcement(
            memory=Mechanism.CONTAINER,
            cpus=Mechanism.CONTAINER,
            pids=Mechanism.RLIMIT,
            disk=Mechanism.TMPFS,
            network=Mechanism.PROXY if spec.network.egress else Mechanism.NAMESPACE,
            timeout=Mechanism.SUPERVISOR,
            ptys=Mechanism.OWN_KERNEL,  # its kernel's own ptys, none of the host's
            host=HostShare(
                memory_mb=own.host_memory // _guest.MiB,
                tasks=own.host_pids,
                open_files=_guest.gvisor_host_files(_guest.gvisor_fd_limit(spec.limits)),
            ),
            timeout_margin_s=UNPRIORITIZED_TIMEOUT_MARGIN_S,  # its kernel honours no priority
        )

    def unwalled_network(self) -> str | None:
        return None  # it refuses a whole network itself (``_plan``)

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
                fixes=("bash scripts/setup-docker.sh", "stockade image build --offline"),
            )
        return TierReport(
            tier=self.tier,
            available=True,
            enforcement=enforcement,
            detail=f"{self.runsc} on rootfs {self.rootfs}",
        )

    def _compile(self, folder: Path) -> None:
        """Once per rootfs: its python compiles the supervisor, inside gVisor (``runsc do``).

        Best effort: without bytecode the supervisor compiles itself on every start.
        """
        assert self.rootfs is not None
        argv = [self.runsc, f"--platform={self.platform}", "--network=none", "do", "--root", str(self.rootfs)]
        try:
            done = subprocess.run(
                [*argv, "python3", "-S", "-E", "-s", "-c", _guest.COMPILE],
                input=json.dumps(_guest.python_sources(folder)).encode(),
                capture_output=True,
                env={"PATH": "/usr/bin:/bin"},
                timeout=START_TIMEOUT_S,
                check=True,
            )
            _guest.install_bytecode(folder, str(self.rootfs), json.loads(done.stdout))
        except (OSError, ValueError, KeyError, subprocess.SubprocessError):
            self._compile_failed = True

    def _undo_launch(
        self,
        sid: str,
        proc: subprocess.Popen[bytes] | None,
        bundle: Path,
        mounts: list[Path],
        egress: EgressHandle | None,
    ) -> None:
        """What a launch that failed holds, let go; may run twice (again at exit)."""
        if proc is not None:  # runsc was started: its sandbox may be running
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            self.destroy(sid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        _release(bundle, mounts, egress)

    def signal(self, sid: str, name: str) -> None:
        subprocess.run(
            self._argv("kill", "--all", sid, name),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
            check=False,
        )

    def destroy(self, sid: str) -> None:
        subprocess.run(
            self._argv("delete", "--force", sid),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
            check=False,
        )

    def runsc_call(self, *args: str, check: bool = True) -> None:
        """``runsc pause``, ``resume`` or ``checkpoint`` on a sandbox (``SnapshotError``)."""
        _gvisor_memory.call_runsc(self._argv(*args), check=check)

    def start(self, spec: SandboxSpec) -> SupervisedInstance:
        if (
            spec.snapshot is not None
            and spec.snapshot.kind is SnapshotKind.MEMORY
            and spec.snapshot.tier == self.tier
        ):
            self._check(rootfs=False)
            return self._restore(spec)
        self._check()
        assert self.rootfs is not None
        enforcement = self._plan(spec)
        # gVisor's kernel has neither Landlock nor seccomp user notification: masks only.
        rules = _rules.plan(spec, root=self.rootfs, can_mask=True, can_confine=False)
        instance = self._launch(spec, sandbox_id(spec), enforcement, masks=rules.masks, command=("run",))

        def config() -> dict[str, Any]:
            rlimits = _guest.own_kernel_limits(spec, self.platform).rlimits
            # gVisor's /proc lets code open our pipes, whatever our dumpable flag: sealed
            return supervisor_config(
                spec,
                rlimits,
                instance.egress,
                seal=True,
                refuse_kernel=True,
                refuse_memfds=_rules.written_noexec(spec),
            )

        instance.start(config, START_TIMEOUT_S, rules, log=lambda: _head(instance.bundle / "runsc.log"))
        return instance

    def _restore(self, spec: SandboxSpec) -> RunscInstance:
        """A sandbox from a memory snapshot: its files unpacked into new tmpfs, its kernel
        restored on them, the interpreter's generators reseeded before anything runs."""
        assert spec.snapshot is not None
        store = SnapshotStore(Path(spec.snapshot.store))
        manifest = store.verify(spec.snapshot)
        state = manifest.tier_state
        docker = None
        if "docker" in state:  # taken in a container of Docker: its image, mounts and uid
            docker = _gvisor_memory.DockerLayout.from_state(state["docker"])
            masks = docker.masks()  # the image's own files, masked as the container had them
            folder = _guest.supervisor_dir(self.state_dir, docker.image)
            key = _gvisor_memory.docker_machine_key(self.runsc, self.platform, docker.image, folder, masks)
        else:
            self._check()
            assert self.rootfs is not None
            masks = _rules.plan(spec, root=self.rootfs, can_mask=True, can_confine=False).masks
            folder = _guest.supervisor_dir(self.state_dir, str(self.rootfs))
            key = _gvisor_memory.machine_key(self, folder, masks)
        if state.get("machine") != key:
            raise exc.SnapshotIncompatible(
                f"snapshot {spec.snapshot.id} was taken with another runsc, platform, root filesystem "
                "or stockade than this host has now: its memory cannot be restored"
            )
        names = {str(k): str(v) for k, v in dict(state.get("image") or {}).items()}
        image = _gvisor_memory.image_dir(store, manifest.blobs, names)
        try:
            enforcement = enforcement_from_state(dict(state.get("enforcement") or {}))
            instance = self._launch(
                spec,
                sandbox_id(spec),
                enforcement,
                masks=masks,
                command=("restore", "--image-path", str(image)),
                files={area: store.check_object(manifest.blobs[area]) for area in _gvisor_memory.AREAS},
                docker=docker,
            )
            sealed = state.get("seal")
            if isinstance(sealed, dict):  # the restored supervisor seals as the saved one did
                instance.channel.seal(
                    bytes.fromhex(str(sealed["key"])), sent=int(sealed["sent"]),
                    received=int(sealed["received"]), send_key=False,
                    mac=str(sealed.get("mac", HMAC_SHA256)),
                )  # fmt: skip
            try:
                instance.reseed()
            except exc.StockadeError as err:
                said = _head(instance.bundle / "runsc.log")
                instance.close()
                raise exc.SandboxStartError(
                    f"the restored sandbox does not answer: {err}{': ' + said if said else ''}"
                ) from None
            except BaseException:
                instance.close()
                raise
        finally:
            shutil.rmtree(image, ignore_errors=True)
        return instance

    def _launch(
        self,
        spec: SandboxSpec,
        sid: str,
        enforcement: Enforcement,
        *,
        masks: tuple[str, ...],
        command: tuple[str, ...],
        files: dict[str, Path] | None = None,
        docker: _gvisor_memory.DockerLayout | None = None,
    ) -> RunscInstance:
        """Write the bundle (tmpfs, with ``files`` unpacked in them; the egress proxy;
        config.json) and start ``runsc run`` or ``restore`` on it, stdio to the supervisor.
        ``docker``: the restore of a container's image, on its image's root and its mounts."""
        if not self._collected:
            self._collected = True
            collect_garbage()
        if docker is not None:
            folder = _guest.supervisor_dir(self.state_dir, docker.image)
        else:
            assert self.rootfs is not None
            _trusted.check(self.rootfs)  # its python compiles the supervisor, chrooted, as us
            folder = _guest.supervisor_dir(self.state_dir, str(self.rootfs))
            if not _guest.has_bytecode(folder, str(self.rootfs)) and not self._compile_failed:
                self._compile(folder)
        uid = docker.uid if docker is not None else _guest.SANDBOX_UID
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        bundle = self.state_dir / f"gv-{sid}"
        # The host side of the sandbox's files, nobody else's to see (0700), held until
        # released: gc spares it before its config.json says who created it (a restore's
        # memory unpacked into its tmpfs first can take a while).
        _host.claim_folder(bundle)
        mounts: list[Path] = []
        proc: subprocess.Popen[bytes] | None = None
        egress = None
        try:
            binds: dict[str, Path] = {}
            # noexec on the host too, as under Docker: gVisor's kernel does not refuse an
            # executable mapping of a noexec mount's file (a library in LD_PRELOAD, dlopen),
            # the host kernel refuses it under gVisor's own mapping, and that code faults.
            noexec = _rules.written_noexec(spec)
            for target, (size, inodes, mode) in _guest.tmpfs_sizes(spec).items():
                path = bundle / _guest.host_folder(target)
                path.mkdir()
                mounts.append(path)  # before the mount: one cut short is undone too
                _guest.mount_tmpfs(path, size=size, inodes=inodes, mode=mode, uid=uid, noexec=noexec)
                binds[target] = path
                if files is not None:
                    _gvisor_memory.unpack_area(
                        files[path.name], path, max_bytes=size, max_entries=inodes, uid=uid
                    )
            if spec.network.egress:  # in the bundle (root's, 0700): only the sandbox reaches it
                from stockade.egress import attach

                egress = attach(spec, bundle / "egress", root=self.rootfs, shared=True, preload=True)
                binds[_guest.EGRESS_DIR] = egress.folder
            # a container's image restores on the image's own files; others on the offline rootfs
            root = self.rootfs
            if docker is not None:
                root = _gvisor_memory.image_root(docker.image, bundle / "rootfs", mounts)
            assert root is not None
            annotations = {
                _guest.LABEL: "1",
                _guest.LABEL_ID: sid,
                _guest.LABEL_CREATOR: self.creator.token,
                _guest.LABEL_HOST: self.creator.host,
            }
            config = _guest.oci_config(
                spec,
                rootfs=root,
                folder=folder,
                binds=binds,
                cgroup=f"/{CGROUP_PARENT}/{sid}",
                host=_guest.own_kernel_limits(spec, self.platform),
                annotations=annotations,
                mask_binds=_guest.mask_binds(masks, root=root, state_dir=self.state_dir, rundir=bundle)
                if docker is None
                else (),
            )
            _preload_supervisor(config, egress)
            if docker is not None:
                config["process"]["user"] = {"uid": uid, "gid": uid, "additionalGids": [uid]}
                config["mounts"] = docker.oci_mounts(self._docker_sources(bundle, binds, folder, uid))
            (bundle / "config.json").write_text(json.dumps(config))
            _hold_memory_group(sid, _guest.own_kernel_limits(spec, self.platform).host_memory)
            # The host descriptors its kernel and gofer may hold: set here, not inherited
            # from whoever runs stockade (a service's LimitNOFILE would be the bound).
            fdlimit = _guest.gvisor_fd_limit(spec.limits)
            fd_flags = (f"--fdlimit={fdlimit}", f"--dcache={_guest.GVISOR_DCACHE}")
            proc = subprocess.Popen(
                self._argv(*fd_flags, *command, "--bundle", str(bundle), sid, egress=egress is not None),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={"PATH": "/usr/bin:/bin"},
                close_fds=True,
                start_new_session=True,
            )
            _keep_head(proc, bundle / "runsc.log")
        except BaseException as err:  # an interrupt (a Ctrl-C) too; once more at exit if cut short again
            _exit.undo(self._undo_launch, sid, proc, bundle, mounts, egress)
            if isinstance(err, OSError):
                raise exc.SandboxStartError(f"cannot start runsc: {err}") from err
            raise
        boundary = _RunscBoundary(self, sid, proc, bundle, mounts)
        boundary.egress = egress
        stream = PipeStream(proc)
        instance = RunscInstance(
            id=sid,
            tier=self.tier,
            stream=stream,
            boundary=boundary,
            spec=spec,
            enforcement=enforcement,
        )
        instance.backend = self
        instance.bundle = bundle
        instance.egress = egress
        instance.docker = docker
        if docker is not None:
            instance.machine_key = _gvisor_memory.docker_machine_key(
                self.runsc, self.platform, docker.image, folder, masks
            )
        else:
            instance.machine_key = _gvisor_memory.machine_key(self, folder, masks)
        _exit.finalize(instance, _guest.abandon, stream, boundary)
        return instance

    def _docker_sources(
        self, bundle: Path, binds: dict[str, Path], folder: Path, uid: int
    ) -> dict[str, Path]:
        """What each role of a container's binds is in this bundle (its accounts name ``uid``)."""
        etc = bundle / "etc"
        etc.mkdir(mode=0o755)
        for name, text in _guest.etc_files(uid).items():
            (etc / name).write_text(text)
            os.chmod(etc / name, 0o644)
        return {
            "workspace": binds[WORKSPACE],
            "tmp": binds["/tmp"],
            "shm": binds[_guest.SHM],
            "supervisor": folder,
            "passwd": etc / "passwd",
            "group": etc / "group",
            "null": Path("/dev/null"),
            "unreadable": _guest.unreadable_file(self.state_dir),
        }


# What of runsc's stderr the host keeps (what ``_head`` reads when a start fails): the
# supervisor's stderr is runsc's, and gVisor's /proc lets code open /proc/1/fd/2 whatever our
# dumpable flag: written to a file, it took 1 GB of host disk in 0.74 s, counted nowhere
# (found from outside). The rest is read and dropped, so that nothing writing there blocks.
LOG_BYTES = 256 * 1024


def _keep_head(proc: subprocess.Popen[bytes], path: Path) -> None:
    """Keep the first ``LOG_BYTES`` of ``proc``'s stderr in ``path``, in a thread that drains
    the rest until every holder of the pipe is gone."""
    assert proc.stderr is not None
    pipe = proc.stderr
    ended = _LOGS_ENDED[path] = threading.Event()

    def drain() -> None:
        kept = 0
        try:
            with pipe, open(path, "wb", buffering=0) as log:
                while data := os.read(pipe.fileno(), 1 << 20):
                    if kept < LOG_BYTES:
                        log.write(data[: LOG_BYTES - kept])
                        kept += min(len(data), LOG_BYTES - kept)
        finally:
            ended.set()
            _LOGS_ENDED.pop(path, None)

    threading.Thread(target=drain, name=f"runsc-log-{path.parent.name}", daemon=True).start()


_LOGS_ENDED: dict[Path, threading.Event] = {}  # the logs still being drained


def _head(path: Path, limit: int = 2048) -> str:
    """The start of runsc's log; a runsc that is ending has its last words drained first."""
    ended = _LOGS_ENDED.get(path)
    if ended is not None:
        ended.wait(0.5)
    try:
        return path.read_bytes()[:limit].decode("utf-8", "replace").strip()
    except OSError:
        return ""


def collect_garbage() -> list[str]:
    """Remove runsc sandboxes and bundles of stockade processes that no longer run.

    (gVisor containers under Docker are collected with the Docker tier's containers.)
    """
    me = _guest.current_creator()
    removed: list[str] = []
    state_dir = _guest.default_state_dir()
    if not state_dir.is_dir():
        return removed
    backend = RunscBackend(state_dir=state_dir)
    _host.collect_staging(state_dir)
    for bundle in state_dir.glob("gv-sbx-*"):
        if _host.claimed(bundle):
            continue
        try:
            notes = json.loads((bundle / "config.json").read_text()).get("annotations", {})
        except (OSError, ValueError):
            notes = {}
        if not notes:
            age = _host.seconds_since_change(bundle)
            if age is None or age < 60:
                continue  # gone, or a previous version's creator writing it
        if me.alive_here(
            str(notes.get(_guest.LABEL_HOST, me.host)), str(notes.get(_guest.LABEL_CREATOR, ""))
        ):
            continue
        sid = bundle.name.removeprefix("gv-")
        if backend.runsc:
            backend.destroy(sid)
        areas = (bundle / "workspace", bundle / "tmp", bundle / "shm", bundle / "rootfs")
        _release(bundle, [p for p in areas if p.is_mount()])
        removed.append(f"runsc sandbox {sid}")
    return removed
