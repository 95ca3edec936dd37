"""The Docker tier: one container per sandbox through the Docker Engine API (docker-py).

The container runs the same supervisor as every tier, as its only process (pid 1, a child
subreaper), attached over the engine's stdin/stdout stream. Every default is enforced by
the engine: no network, a read-only root, the workspace, /tmp and /dev/shm as size- and
inode-limited tmpfs (not the engine's own shm mount, which counts no inodes), uid 1000
without capabilities, ``no-new-privileges``, the engine's seccomp profile, and memory (swap
included), CPU and pids limits.

A container is removed on close, on exceptions, when its ``Sandbox`` is garbage collected
and at interpreter exit; what a killed process left behind is removed by
``collect_garbage`` (``stockade gc``, and once when a backend starts its first sandbox).
Engine errors are translated to stockade errors in one place, ``engine_error``.

The same class runs gVisor containers (``runtime="runsc"``, see ``gvisor.py``).

Here: the backend's probe and start, and the container's configuration. Its parts: its
settings and engine (``_docker_settings``), its plan (``_docker_plan``), the supervisor's
files (``_docker_supervisor``); a started container (``_docker_container``) and its folder
on this host (``_docker_rundirs``); the engine's client and errors (``_docker_engine``).
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stockade import _exit
from stockade import exceptions as exc
from stockade.sandbox import _guest, _host, _netfull, _rules, _thrash
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._cgroups import tcp_buffer_bytes
from stockade.sandbox._docker_container import ContainerBoundary, ContainerInstance, Create, undo_start
from stockade.sandbox._docker_engine import (
    AttachStream,
    docker_py,
    engine_error,
    engine_failures,
    mapped_engine_errors,
    no_logs,
    remove_container,
    retry_removals,
)
from stockade.sandbox._docker_plan import DockerPlan
from stockade.sandbox._docker_rundirs import collect_rundirs, make_rundir
from stockade.sandbox._docker_settings import DEFAULT_IMAGE, START_TIMEOUT_S
from stockade.sandbox._docker_supervisor import SupervisorFiles
from stockade.sandbox._gvisor_docker_memory import ContainerMemory
from stockade.sandbox._host import NO_TIME_WAIT, NO_TIMESTAMPED_DATA
from stockade.sandbox._hostinfo import engine_masked_paths
from stockade.sandbox._supervised import SupervisedInstance
from stockade.sandbox._supervised_config import WORKSPACE, sandbox_id, supervisor_config, supervisor_files
from stockade.sandbox.base import SandboxSpec
from stockade.types import Mechanism, TierReport

# engine_error: re-exported, the one place engine errors are translated
__all__ = ["DockerBackend", "collect_garbage", "engine_error"]

# cgroup v1 charges a container's TCP buffers to no memory limit: they get one of their own.
_V1_TCP = Path("/sys/fs/cgroup/memory/memory.kmem.tcp.limit_in_bytes")
EGRESS_DIR = "/run/stockade-egress"  # stockade.egress.SANDBOX_DIR (not imported: it is lazy)


def _supervisor_env(egress: EgressHandle | None) -> list[str]:
    """The supervisor's own environment. With egress on gVisor, the connect shortcut is
    preloaded into it too, so that the interpreters it forks for ``run_code`` take it."""
    env = ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"]
    if egress is not None and egress.preload is not None:
        env.append(f"LD_PRELOAD={egress.preload}")
    return env


def _hide_the_host(tmpfs: dict[str, str], binds: dict[str, dict[str, str]], *, own_kernel: bool) -> None:
    """Mounts that keep the engine's names for the container out of it (see ``_hostinfo``).

    The engine's /etc/hostname is a bind of a file named after the container's id: a bind of
    our own replaces it. gVisor names the cgroups it shows after the container's id whatever
    the cgroup namespace, unless no cgroup filesystem is mounted: an empty one is.
    """
    binds["/dev/null"] = {"bind": "/etc/hostname", "mode": "ro"}
    if own_kernel:
        tmpfs["/sys/fs/cgroup"] = "ro,size=4k,nr_inodes=16"


def _limit_tcp(pid: int, cid: str, *, limits_memory: int) -> None:
    """cgroup v1 charges a container's TCP buffers to no memory limit (2 GB sat on a 128 MiB
    sandbox's own loopback), and runc ignores the engine's KernelMemoryTCP: the container's
    own group gets the limit, here, before any code runs (only the supervisor has, which
    holds no socket: accounting starts with the limit)."""
    if not _V1_TCP.exists():  # v2 charges them to the memory limit
        return
    group = _thrash.memory_group_of(pid) if pid else None
    if group is None or group.v2:
        raise exc.SandboxStartError(f"the memory cgroup of container {cid[:12]} was not found")
    (group.folder / "memory.kmem.tcp.limit_in_bytes").write_text(str(tcp_buffer_bytes(limits_memory)))


def _container_pid(api: Any, cid: str) -> int:
    """The container's first process on this host (0 when the engine names none)."""
    return int(api.inspect_container(cid)["State"]["Pid"] or 0)


# -- the backend ------------------------------------------------------------------------------


class DockerBackend(DockerPlan, SupervisorFiles):
    """Containers on a Docker engine. ``runtime="runsc"`` runs them under gVisor.

    ``own_kernel`` says the runtime brings its own kernel (gVisor): processes are then
    counted by that kernel (RLIMIT_NPROC), and the workspace, /tmp and /dev/shm are tmpfs
    mounted on this host and bound in (needs root and a local engine), as gVisor's tmpfs
    cannot limit inodes.

    ``remote`` says the engine does not run on this host (default: any ``DOCKER_HOST`` or
    ``base_url`` that is not a unix socket; ``STOCKADE_DOCKER_REMOTE=1``/``0`` overrides).
    The supervisor then reaches containers in a Docker volume filled over the API instead
    of a bind mount of a host folder, and OOM kills are counted from the engine's events.
    """

    tier = "docker"

    def probe(self) -> TierReport:
        fixes = ("bash scripts/setup-docker.sh", "stockade image build --offline")
        try:
            api = self._api()
            with mapped_engine_errors(self.image, self.runtime):
                info = api.info()
                api.inspect_image(self.image)
            if self.runtime is not None and self.runtime not in (info.get("Runtimes") or {}):
                return TierReport(
                    tier=self.tier,
                    available=False,
                    fixes=fixes[:1],
                    detail=f"the Docker engine has no {self.runtime!r} runtime",
                )
            enforcement = self._plan(SandboxSpec(allow_weaker=True))
            self.start(SandboxSpec(allow_weaker=True)).close()
        except exc.StockadeError as err:
            return TierReport(tier=self.tier, available=False, detail=str(err), fixes=fixes)
        runtime = self.runtime or info.get("DefaultRuntime", "runc")
        return TierReport(
            tier=self.tier,
            available=True,
            enforcement=enforcement,
            detail=f"Docker {info.get('ServerVersion', '?')}, runtime {runtime}, image {self.image}, "
            f"cgroup v{info.get('CgroupVersion', '?')}",
        )

    # -- start --------------------------------------------------------------------------

    def _host_config(
        self,
        api: Any,
        spec: SandboxSpec,
        folder: str,
        binds: dict[str, Path],
        *,
        uid: int,
        masks: Sequence[str],
        mask_binds: Sequence[tuple[str, str]],
    ) -> Any:
        docker = docker_py()
        limits = spec.limits
        tmpfs: dict[str, str] = {}
        volume_binds = {folder: {"bind": _guest.SUPERVISOR_MOUNT, "mode": "ro"}}
        for target, path in binds.items():
            if target.startswith(("/etc/", EGRESS_DIR)):
                volume_binds[str(path)] = {"bind": target, "mode": "ro"}
        for target, (size, inodes, mode) in _guest.tmpfs_sizes(spec).items():
            if target in binds:
                volume_binds[str(binds[target])] = {"bind": target, "mode": "rw"}
            else:
                # Docker adds noexec unless told otherwise; every tier lets the workspace run code
                # but under an allowlist (_rules.written_noexec).
                run = "noexec" if _rules.written_noexec(spec) else "exec"
                tmpfs[target] = (
                    f"rw,{run},nosuid,nodev,size={size},nr_inodes={inodes},mode={mode:o},uid={uid},gid={uid}"
                )
        memory = limits.memory_mb * _guest.MiB
        pids = limits.pids
        if self.own_kernel:
            own = _guest.own_kernel_limits(spec, self._runtime_platform())
            memory, pids = own.host_memory, own.host_pids
        _hide_the_host(tmpfs, volume_binds, own_kernel=self.own_kernel)
        bind_list = [f"{src}:{v['bind']}:{v['mode']}" for src, v in volume_binds.items()]
        bind_list += [f"{source}:{path}:ro" for source, path in mask_binds]
        host_config = api.create_host_config(
            network_mode=_netfull.NETWORK if spec.network.unrestricted else "none",
            # No TIME_WAIT kept in the container's namespace: a connection code closed first
            # would outlive a pool's reset for 60 s (addresses, ports, taken binds; the
            # reset's check, supervisor/netstate.py, would then replace the member).
            sysctls=NO_TIME_WAIT if self.own_kernel else {**NO_TIME_WAIT, **NO_TIMESTAMPED_DATA},
            read_only=True,
            tmpfs=tmpfs,
            binds=bind_list,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            mem_limit=memory,
            memswap_limit=memory,
            nano_cpus=int(limits.cpus * 1e9),
            pids_limit=pids,
            ulimits=[
                docker.types.Ulimit(name="core", soft=0, hard=0),
                # The supervisor's (its relay's besides): it gives what it starts the code's.
                docker.types.Ulimit(
                    name="nofile", soft=supervisor_files(limits), hard=supervisor_files(limits)
                ),
            ],
            init=False,
            auto_remove=False,
            runtime=self.runtime,
            ipc_mode="private",  # its own IPC namespace; /dev/shm is the tmpfs above, not the engine's
            log_config=no_logs(),
            cgroupns="private",  # the container's cgroup paths name its id
        )
        # docker-py has no parameter for it; the programs the rules deny are masked alike
        host_config["MaskedPaths"] = [*engine_masked_paths(), *masks]
        return host_config

    def _image_root(self) -> Path | None:
        """The folder the image was made from (the offline build's), to find programs in."""
        if self.image.partition(":")[0] != DEFAULT_IMAGE.partition(":")[0]:
            return None
        from stockade.sandbox._rootfs import find_rootfs

        return find_rootfs()

    def start(self, spec: SandboxSpec) -> SupervisedInstance:
        enforcement = self._plan(spec)
        # gVisor's kernel has neither Landlock nor seccomp user notification. It sees the
        # engine's binds (host tmpfs, as root) without noexec (Engine API 1.41 takes no such
        # option): the supervisor's boot remounts them so (``sealed``); the engine's tmpfs with
        # it, but with no host noexec under its mappings.
        rules = _rules.plan(
            spec,
            root=self._image_root(),
            can_mask=True,
            can_confine=not self.own_kernel,
            maps_noexec=not self.own_kernel or self.host_tmpfs,
        )
        sealed = (
            (_guest.NOEXEC_FLAG, ":".join(sorted(_guest.tmpfs_sizes(spec))))
            if self.own_kernel and self.host_tmpfs and _rules.written_noexec(spec)
            else ()
        )
        api = self._api()
        if not self._collected:
            self._collected = True
            collect_garbage(api)
        retry_removals(api)
        folder = self._supervisor_mount(api)
        sid = sandbox_id(spec)
        rundir: Path | None = None
        mounts: list[Path] = []
        binds: dict[str, Path] = {}
        # A uid of its own: the kernel counts processes, inotify instances, pipe buffers...
        # per user, and uid 1000 may be a real account of this host.
        lease = _host.lease_uid(self.state_dir)
        cid = ""
        created: Create | None = None
        stream: AttachStream | None = None
        # Docker's embedded DNS answers every container of stockade-net with its name (a
        # reverse lookup of an address too), and no option of the engine keeps a container
        # out of it: a full-network sandbox's name tells the others nothing of its id.
        name = f"stockade-net-{secrets.token_hex(8)}" if spec.network.unrestricted else f"stockade-{sid}"
        egress = None
        try:
            if spec.network.unrestricted:
                with mapped_engine_errors(self.image, self.runtime):
                    _netfull.ensure_network(api)
                if enforcement.network is Mechanism.FIREWALL:
                    _netfull.ensure_rules()
            if not self.remote:
                rundir, mounts, binds = make_rundir(
                    spec,
                    sid,
                    lease.uid,
                    state_dir=self.state_dir,
                    creator=self.creator,
                    host_tmpfs=self.host_tmpfs,
                )
            if spec.network.egress and rundir is not None:
                from stockade.egress import attach

                # On gVisor the connect shortcut too (stockade.egress._preload).
                egress = attach(
                    spec, rundir / "egress", uid=lease.uid, root=self._image_root(), preload=self.own_kernel
                )
                binds[EGRESS_DIR] = egress.folder
            # gVisor ignores MaskedPaths; masked copies are of the image's files on this host
            mask_binds = (
                _guest.mask_binds(
                    rules.masks,
                    root=self._image_root() if rundir is not None else None,
                    state_dir=self.state_dir,
                    rundir=rundir,
                )
                if self.own_kernel
                else []
            )
            with mapped_engine_errors(self.image, self.runtime):
                created = Create(
                    lambda: api.create_container(
                        self.image,
                        command=[*_guest.SUPERVISOR_ARGV, *sealed],
                        user=f"{lease.uid}:{lease.uid}",
                        working_dir=WORKSPACE,
                        environment=_supervisor_env(egress),
                        hostname="sandbox",
                        labels=self._labels(spec, sid),
                        stdin_open=True,
                        tty=False,
                        # Nothing inside needs a graceful stop; an engine shutdown must not wait.
                        stop_signal="SIGKILL",
                        network_disabled=not spec.network.unrestricted,
                        host_config=self._host_config(
                            api, spec, folder, binds, uid=lease.uid, masks=rules.masks, mask_binds=mask_binds
                        ),
                        name=name,
                    )
                )
                created.start()
                cid = created.id()
                sock = api.attach_socket(cid, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
                raw = getattr(sock, "_sock", sock)
                stream = AttachStream(raw, sock)
                api.start(cid)
                if self.own_kernel and self.host_tmpfs:  # before any code runs
                    limit = _guest.gvisor_fd_limit(spec.limits, self._runtime_dcache())
                    _guest.limit_gvisor_files(_container_pid(api, cid), limit)
                if not self.own_kernel and not self.remote:  # gVisor's TCP is its own, in its memory
                    pid = _container_pid(api, cid)
                    _limit_tcp(pid, cid, limits_memory=spec.limits.memory_mb * _guest.MiB)
                    if enforcement.ptys is Mechanism.DEVPTS:  # before any code runs, as the TCP limit
                        _host.bound_ptys(pid, spec.limits.ptys)
        except BaseException:
            # By name when the id is not known: an interrupt while the engine answers the
            # create leaves a container made. Run again at exit if this too is interrupted.
            undo = functools.partial(
                undo_start,
                api,
                cid=cid,
                created=created,
                name=name,
                stream=stream,
                egress=egress,
                rundir=rundir,
                mounts=mounts,
            )
            _exit.undo(undo, lease)
            raise
        boundary = ContainerBoundary(api, cid, rundir, mounts, remote=self.remote, lease=lease)
        boundary.egress = egress
        instance = ContainerInstance(
            id=sid, tier=self.tier, stream=stream, boundary=boundary, spec=spec, enforcement=enforcement
        )
        instance.container = boundary
        instance.memory = None
        if self.own_kernel and self.host_tmpfs and rundir is not None and self._image_id is not None:
            instance.memory = ContainerMemory(
                api,
                cid,
                rundir,
                runtime=self._runtime_entry(),
                platform=self._runtime_platform(),
                image=self._image_id,
                folder=Path(folder),
                masks=rules.masks,
                mask_binds=tuple(mask_binds),
                uid=lease.uid,
                state_dir=self.state_dir,
            )
        # Removed when the caller forgets to close, and at interpreter exit at the latest.
        _exit.finalize(instance, _guest.abandon, stream, boundary)

        def config() -> dict[str, Any]:
            own = _guest.own_kernel_limits(spec, self._runtime_platform()) if self.own_kernel else None
            # a kernel of its own is gVisor's, whose /proc lets code open our pipes: sealed
            rlimits = own.rlimits if own is not None else None
            return supervisor_config(
                spec,
                rlimits,
                egress,
                seal=self.own_kernel,
                refuse_kernel=True,
                refuse_filters=not self.own_kernel,
                refuse_memfds=self.own_kernel and _rules.written_noexec(spec),
            )

        def log() -> str:
            return stream.stderr.decode("utf-8", "replace").strip()

        instance.start(config, START_TIMEOUT_S, rules, log=log)
        return instance


def collect_garbage(api: Any = None) -> list[str]:
    """Remove containers (and host mounts) of stockade processes that no longer run."""
    me = _guest.current_creator()
    removed: list[str] = []
    if api is None:
        try:
            api = DockerBackend()._api()
        except exc.StockadeError:
            api = None
    live_ids: set[str] = set()
    if api is not None:
        try:
            containers = api.containers(all=True, filters={"label": f"{_guest.LABEL}=1"})
        except engine_failures():
            containers = []
        for found in containers:
            labels = found.get("Labels") or {}
            sid = labels.get(_guest.LABEL_ID, "")
            if me.alive_here(labels.get(_guest.LABEL_HOST, ""), labels.get(_guest.LABEL_CREATOR, "")):
                live_ids.add(sid)
                continue
            if remove_container(api, found["Id"]):
                removed.append(f"container {found['Id'][:12]} ({sid})")
    return removed + collect_rundirs(_guest.default_state_dir(), me, live_ids)
