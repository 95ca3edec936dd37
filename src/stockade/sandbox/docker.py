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
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import secrets
import shutil
import tarfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from stockade import _exit
from stockade import exceptions as exc
from stockade.sandbox import _builds, _filetable, _guest, _host, _netfull, _rules, _thrash
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._cgroups import tcp_buffer_bytes
from stockade.sandbox._docker_engine import (
    AttachStream,
    docker_py,
    engine_client,
    engine_error,
    engine_failures,
    is_remote,
    mapped_engine_errors,
    no_logs,
    remove_container,
    remove_exited,
    retry_removals,
)
from stockade.sandbox._gvisor_memory import EGRESS_REFUSAL, ContainerMemory
from stockade.sandbox._host import NO_TIME_WAIT, NO_TIMESTAMPED_DATA
from stockade.sandbox._hostinfo import engine_masked_paths
from stockade.sandbox._supervised import (
    TIMEOUT_MARGIN_S,
    UNPRIORITIZED_TIMEOUT_MARGIN_S,
    WORKSPACE,
    Boundary,
    SupervisedInstance,
    sandbox_id,
    supervisor_config,
)
from stockade.sandbox.base import Backend, OpResult, OutputSink, SandboxSpec
from stockade.sandbox.ops import Op
from stockade.sandbox.snapshots import Reservation
from stockade.types import Enforcement, HostShare, Mechanism, TierReport

__all__ = ["DockerBackend", "collect_garbage", "engine_error"]

# cgroup v1 charges a container's TCP buffers to no memory limit: they get one of their own.
_V1_TCP = Path("/sys/fs/cgroup/memory/memory.kmem.tcp.limit_in_bytes")
DEFAULT_IMAGE = "stockade-sandbox:latest"
START_TIMEOUT_S = 30.0
API_TIMEOUT_S = 30.0
COMPILED = "/tmp/stockade-compiled.json"
MAX_COMPILED = 16 * 1024 * 1024
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


def _tar(files: Mapping[str, bytes | str], folder: str = "") -> bytes:
    """A tar of world-readable files (and their folders) for ``put_archive``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        dirs = {str(Path(folder, name).parent) for name in files} - {"."}
        for name in sorted(dirs):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(time.time())
            tar.addfile(info)
        for name, data in files.items():
            raw = data.encode() if isinstance(data, str) else data
            info = tarfile.TarInfo(str(Path(folder, name)))
            info.size, info.mode, info.mtime = len(raw), 0o644, int(time.time())
            tar.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def _fetch_file(api: Any, cid: str, path: str) -> bytes:
    """One small file of a container (running or not), through the engine's archive API."""
    stream, _ = api.get_archive(cid, path)
    data = bytearray()
    for chunk in stream:
        data += chunk
        if len(data) > MAX_COMPILED + 64 * 1024:
            raise ValueError(f"{path} is larger than expected")
    with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tar:
        member = tar.next()
        handle = tar.extractfile(member) if member is not None else None
        if handle is None:
            raise ValueError(f"{path} is not a file")
        return handle.read(MAX_COMPILED)


class _ContainerBoundary(Boundary):
    def __init__(
        self,
        api: Any,
        cid: str,
        rundir: Path | None,
        mounts: list[Path],
        *,
        remote: bool,
        lease: _host.UidLease | None = None,
    ) -> None:
        self.api = api
        self.lease = lease
        self.cid = cid
        self.remote = remote
        self.since = time.time() - 1.0
        self.rundir = rundir
        self.mounts = mounts
        self._oom_file: Path | None = None
        self._oom_resolved = False
        self._oom_seen: int | None = None  # the kernel's count, read last
        self._thrash: _thrash.Watch | None = None

    def alive(self) -> bool:
        return not self._dead

    def oom_kills(self) -> int | None:
        # The engine reports OOM as a boolean on exit only; the container's memory cgroup
        # counts every kill, and is readable when the engine runs on this host (which also
        # watches it for thrashing, from the first look on). A remote engine's own events
        # count them too, one API call per look.
        if self.remote:
            return self._oom_events()
        if not self._oom_resolved:
            self._oom_resolved = True
            unknown: tuple[type[BaseException], ...] = (*engine_failures(), KeyError, TypeError, ValueError)
            try:
                pid = int(self.api.inspect_container(self.cid)["State"]["Pid"] or 0)
            except unknown:
                pid = 0
            group = _thrash.memory_group_of(pid) if pid else None
            if group is not None:
                self._oom_file = group.oom_counter
                self._thrash = _thrash.watch(group)
                if self._dead:  # killed meanwhile: _kill may have looked before the watch began
                    self._thrash.close()
        if self._oom_file is None:
            return None
        kernel = _guest.read_oom_kills(self._oom_file)
        if kernel is None:
            # The group is gone with its container: the watch's kill of its largest process
            # ended it (gVisor's sentry, under load), and the count read last still holds
            # (it read None, and the crash was "stopped from outside", not out of memory).
            kernel = self._oom_seen
        if kernel is None:
            return None
        self._oom_seen = kernel
        return kernel + (self._thrash.thrash_kills if self._thrash else 0)

    def lock_kills(self) -> int:
        return self._thrash.lock_kills if self._thrash else 0

    def _oom_events(self) -> int | None:
        # ``until`` in the past (to the microsecond) makes the engine replay and return at
        # once; a future one would hold the call open until then.
        until = f"{time.time():.6f}"
        try:
            with contextlib.closing(
                self.api.events(
                    since=self.since,
                    until=until,
                    filters={"container": self.cid, "event": "oom"},
                    decode=True,
                )
            ) as events:
                return sum(1 for _ in events)
        except engine_failures():
            return None

    def _kill(self) -> None:
        if self._thrash is not None:
            self._thrash.close()
        remove_exited(self.api, self.cid)  # the channel was closed first: the supervisor is ending
        _release_mounts(self.rundir, self.mounts)
        if self.lease is not None:  # last: no process of the sandbox is left with the uid
            self.lease.release()

    def explain(self, err: exc.SandboxCrashed) -> exc.StockadeError:
        """Why the supervisor's stream ended: the engine went away, or the container died."""
        output = {"stdout": err.stdout, "stderr": err.stderr}
        try:
            state = self.api.inspect_container(self.cid)["State"]
        except engine_failures() as failure:
            mapped = engine_error(failure)
            if isinstance(mapped, exc.BackendUnavailable | exc.SandboxStartError):
                return exc.BackendUnavailable(
                    f"the Docker engine went away under sandbox {self.cid[:12]} ({err}); "
                    "start a new sandbox once it is back",
                    retry_after=1.0,
                )
            gone = f"the container was removed from outside ({err})"
            return exc.SandboxCrashed(gone, cause="killed", **output)
        if state.get("OOMKilled"):
            oom = "the container was killed by its memory limit; its state is lost"
            return exc.SandboxCrashed(oom, cause="out_of_memory", **output)
        if not state.get("Running"):
            code = state.get("ExitCode")
            if isinstance(code, int) and 0 <= code < 128:
                # not a signal's (128 + its number): the supervisor ended by itself, as it does
                # when its channel breaks; on gVisor code can reach that channel (/proc/1/fd)
                return exc.SandboxCrashed(
                    f"the sandbox's supervisor exited by itself (exit code {code}): code in the "
                    f"sandbox may have ended it or broken its channel to the host: {err}",
                    **output,
                )
            return exc.SandboxCrashed(
                f"the container stopped from outside (status {state.get('Status')}, exit code {code}): {err}",
                cause="killed",
                **output,
            )
        return err


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


def _release_mounts(rundir: Path | None, mounts: list[Path]) -> None:
    for mount in mounts:
        _guest.umount(mount)
    if rundir is not None:
        shutil.rmtree(rundir, ignore_errors=True)
        _host.release_folder(rundir)


class _Create:
    """The engine's create, in a thread of its own: when the caller is interrupted while the
    engine answers, the container is made all the same, and this still learns its id."""

    def __init__(self, create: Callable[[], Mapping[str, Any]]) -> None:
        self._id = ""
        self._error: BaseException | None = None
        # Not Thread.join: a join cut short by an interrupt may take the thread for ended.
        self._answered = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(create,), name="stockade-docker-create", daemon=True
        )

    def start(self) -> None:
        """Apart from ``__init__``: the caller holds this object before an interrupt can land
        in ``Thread.start``, which waits for the thread while its create may be sent already."""
        self._thread.start()

    def _run(self, create: Callable[[], Mapping[str, Any]]) -> None:
        try:
            self._id = str(create()["Id"])
        except BaseException as err:  # raised in the caller's thread, by id()
            self._error = err
        finally:
            self._answered.set()

    def id(self, timeout: float | None = None) -> str:
        """The container's id, once the engine answered ("" past ``timeout``)."""
        self._answered.wait(timeout)
        if self._error is not None:
            raise self._error
        return self._id


def _undo_start(
    api: Any,
    lease: _host.UidLease,
    *,
    cid: str,
    created: _Create | None,
    name: str,
    egress: EgressHandle | None,
    rundir: Path | None,
    mounts: list[Path],
) -> None:
    """What a failed start holds, let go; may run twice (again at exit, when interrupted)."""
    if egress is not None:
        egress.close()
    if not cid and created is not None:  # interrupted while the engine made it
        with contextlib.suppress(Exception):
            cid = created.id(START_TIMEOUT_S)
    remove_container(api, cid or name)  # an absent one is no error
    _release_mounts(rundir, mounts)
    lease.release()


class _ContainerInstance(SupervisedInstance):
    """A supervised sandbox whose crash reports say what happened to its container."""

    container: _ContainerBoundary
    memory: ContainerMemory | None = None  # gVisor's checkpoints, when its runsc is on this host

    def memory_snapshots(self) -> str | None:
        if self.tier != "gvisor":
            return super().memory_snapshots()
        if self.spec.network.egress:
            return EGRESS_REFUSAL
        if self.memory is None:
            return (
                "gVisor under Docker keeps memory in a snapshot only with a local engine and root "
                "(its runsc and the sandbox's files are then on this host); this one keeps files only"
            )
        return None

    def save_memory(self, room: Reservation, *, stop: bool) -> tuple[dict[str, str], dict[str, Any]]:
        if self.memory is None:
            return super().save_memory(room, stop=stop)
        return self.memory.save(room, stop=stop)

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        try:
            return super().handle(op, sink)
        except exc.SandboxCrashed as err:
            if self._closed:  # closed here (a reset that failed, a call that timed out): it says why
                raise
            explained = self.container.explain(err)
            self.close()
            raise explained from None


# -- the backend ------------------------------------------------------------------------------


class DockerBackend(Backend):
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

    def __init__(
        self,
        *,
        image: str | None = None,
        runtime: str | None = None,
        base_url: str | None = None,
        tier: str = "docker",
        own_kernel: bool = False,
        state_dir: Path | None = None,
        remote: bool | None = None,
    ) -> None:
        self.image = image or os.environ.get("STOCKADE_IMAGE") or DEFAULT_IMAGE
        self.runtime = runtime
        self.base_url = base_url
        self.tier = tier
        self.own_kernel = own_kernel
        self.remote = is_remote(base_url) if remote is None else remote
        self.host_tmpfs = own_kernel and os.geteuid() == 0 and not self.remote
        self.state_dir = state_dir or _guest.default_state_dir()
        self.creator = _guest.current_creator()
        self._api_client: Any = None
        self._lock = threading.Lock()
        self._collected = False
        self._supervisor_source: tuple[Path, str] | None = None
        self._platform: str | None = None
        self._runtime: dict[str, Any] | None = None
        self._image_id: str | None = None

    def _runtime_entry(self) -> dict[str, Any]:
        """The engine's entry for this runtime: its binary (``path``) and ``runtimeArgs``."""
        if self._runtime is None:
            entry: dict[str, Any] = {}
            unknown: tuple[type[BaseException], ...] = (exc.StockadeError, KeyError, *engine_failures())
            with contextlib.suppress(*unknown):
                entry = dict((self._api().info().get("Runtimes") or {}).get(self.runtime or "") or {})
            self._runtime = entry
        return self._runtime

    def _runtime_platform(self) -> str:
        """The gVisor platform the engine runs this runtime with (its ``--platform`` argument)."""
        if self._platform is None:
            platform = "systrap"  # runsc's own default
            entry = self._runtime_entry()
            for arg in entry.get("runtimeArgs") or entry.get("runtimeargs") or []:
                if str(arg).startswith("--platform="):
                    platform = str(arg).split("=", 1)[1]
            self._platform = platform
        return self._platform

    def _runtime_dcache(self) -> int | None:
        """The runtime's ``--dcache`` (gVisor's cache of closed files), None if it has none."""
        entry = self._runtime_entry()
        for arg in entry.get("runtimeArgs") or entry.get("runtimeargs") or []:
            name, _, value = str(arg).partition("=")
            if name == "--dcache" and value.isdigit():
                return int(value)
        return None

    def _api(self) -> Any:
        with self._lock:
            if self._api_client is None:
                with mapped_engine_errors(self.image, self.runtime):
                    self._api_client = engine_client(self.base_url, API_TIMEOUT_S)
            return self._api_client

    # -- capability ---------------------------------------------------------------------

    def _plan(self, spec: SandboxSpec) -> Enforcement:
        net = spec.network
        if net.egress:
            self._check_egress()
        if net.unrestricted and self.own_kernel:
            raise exc.LimitNotEnforceable(
                f"the {self.tier} tier runs without network on this host",
                setting="network",
                fix="use tier='docker' for network access",
            )
        weakened: list[str] = []
        walled = False
        if net.unrestricted:
            why = _netfull.unwalled(remote=self.remote)
            if why is not None and not spec.allow_weaker:
                raise exc.LimitNotEnforceable(
                    f"the {self.tier} tier walls a full-network sandbox off from this host, the private "
                    f"network and other sandboxes with host firewall rules, and {why}",
                    setting="network",
                    fix="run as root beside the engine with iptables, pass allow_weaker=True to accept it, "
                    "or NetworkPolicy(allow_hosts=...) for an allowlist",
                )
            walled = why is None
            if not walled:
                weakened.append(
                    f"network: no firewall rules ({why}): sandboxes on {_netfull.NETWORK} cannot reach each "
                    "other, but reach the engine host's listeners and private addresses (169.254.169.254 too)"
                )
        if self.own_kernel and not self.host_tmpfs:
            if not spec.allow_weaker:
                raise exc.LimitNotEnforceable(
                    "gVisor's in-sandbox tmpfs cannot limit inodes, and host tmpfs mounts need root",
                    setting="inodes",
                    fix="run as root, or pass allow_weaker=True (inodes then bounded by the memory limit)",
                )
            weakened.append("inodes: bounded by the memory limit (gVisor tmpfs; size still enforced)")
        ptys = self._pty_mechanism()
        if ptys is Mechanism.NONE:
            if not spec.allow_weaker:
                raise exc.LimitNotEnforceable(
                    "the docker tier bounds a sandbox's ptys from this host, as root, with a local engine",
                    setting="ptys",
                    fix="run as root beside the engine, or pass allow_weaker=True (then only the "
                    "engine host's kernel.pty.max, shared, bounds them)",
                )
            weakened.append("ptys: bounded only by the engine host's kernel.pty.max, shared")
        limits = spec.limits
        if self.own_kernel:  # the container's cgroup holds gVisor's kernel and its gofer too
            own = _guest.own_kernel_limits(spec, self._runtime_platform())
            # gVisor's kernel and gofer get their descriptor limit from the host (root, a
            # local engine); otherwise they keep the engine's own, which no one here sets.
            if not self.host_tmpfs:
                weakened.append("open files: gVisor's host descriptors bounded by the engine's limit only")
            host = HostShare(
                memory_mb=own.host_memory // _guest.MiB,
                tasks=own.host_pids,
                open_files=_guest.gvisor_host_files(_guest.gvisor_fd_limit(limits, self._runtime_dcache())),
            )
        else:
            host = HostShare(
                memory_mb=limits.memory_mb,
                tasks=limits.pids,
                open_files=limits.total_open_files,
                mapped_files=_filetable.mapped_files(limits.memory_mb, limits.pids),
            )
        return Enforcement(
            memory=Mechanism.CONTAINER,
            cpus=Mechanism.CONTAINER,
            pids=Mechanism.RLIMIT if self.own_kernel else Mechanism.CONTAINER,
            disk=Mechanism.TMPFS,
            network=Mechanism.PROXY
            if net.egress
            else (Mechanism.FIREWALL if walled else Mechanism.NONE)
            if net.enabled
            else Mechanism.NAMESPACE,
            timeout=Mechanism.SUPERVISOR,
            ptys=ptys,
            host=host,
            weakened=tuple(weakened),
            # gVisor's kernel honours no priority: the supervisor's kill waits its turn
            timeout_margin_s=UNPRIORITIZED_TIMEOUT_MARGIN_S if self.own_kernel else TIMEOUT_MARGIN_S,
        )

    def _pty_mechanism(self) -> Mechanism:
        """runc mounts each container a devpts instance of its own, with no ``max``: the host
        (root, beside the engine) bounds it after the start. gVisor's ptys are its kernel's."""
        if self.own_kernel:
            return Mechanism.OWN_KERNEL
        return Mechanism.DEVPTS if not self.remote and os.geteuid() == 0 else Mechanism.NONE

    def _check_egress(self) -> None:
        """An allowlist needs the proxy's socket bound in: a local engine, and for gVisor a
        runtime that lets the sandbox connect to a host socket it was given."""
        if self.remote:
            raise exc.LimitNotEnforceable(
                f"the {self.tier} tier enforces a network allowlist on a local engine only: the "
                "sandbox reaches its egress proxy through a socket of this host",
                setting="network.allow_hosts",
                fix="run the engine on this host, or NetworkPolicy() for no network",
            )
        if self.own_kernel and not self._runtime_args(("--host-uds=open", "--host-uds=all")):
            raise exc.LimitNotEnforceable(
                f"the Docker runtime {self.runtime!r} does not let gVisor connect to the egress proxy's "
                "socket (its runtimeArgs lack --host-uds=open)",
                setting="network.allow_hosts",
                fix="add --host-uds=open to the runtime's runtimeArgs (scripts/setup-docker.sh), "
                "or use STOCKADE_GVISOR_MODE=runsc",
            )

    def _runtime_args(self, wanted: tuple[str, ...]) -> bool:
        unknown: tuple[type[BaseException], ...] = (exc.StockadeError, KeyError, *engine_failures())
        try:
            entry = (self._api().info().get("Runtimes") or {}).get(self.runtime or "") or {}
        except unknown:
            return False
        args = entry.get("runtimeArgs") or entry.get("runtimeargs") or []
        return any(str(arg) in wanted for arg in args)

    def unwalled_network(self) -> str | None:
        return None if self.own_kernel else _netfull.unwalled(remote=self.remote)  # (gVisor refuses it)

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
                docker.types.Ulimit(
                    name="nofile", soft=limits.files_per_process, hard=limits.files_per_process
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

    def _labels(self, spec: SandboxSpec, sid: str) -> dict[str, str]:
        return {
            **{str(k): str(v) for k, v in spec.labels.items()},
            _guest.LABEL: "1",
            _guest.LABEL_ID: sid,
            _guest.LABEL_PID: str(self.creator.pid),
            _guest.LABEL_CREATOR: self.creator.token,
            _guest.LABEL_HOST: self.creator.host,
        }

    def _host_files(self, spec: SandboxSpec, sid: str, uid: int) -> tuple[Path, list[Path], dict[str, Path]]:
        """The sandbox's files on this host (a local engine only): its passwd and group,
        which name its uid, and the host tmpfs mounts gVisor needs; root's alone (0700)."""
        rundir = self.state_dir / f"ctr-{sid}"
        rundir.parent.mkdir(parents=True, exist_ok=True)
        _host.claim_folder(rundir)  # held until released: gc spares it before "creator" is written
        (rundir / "creator").write_text(f"{self.creator.host}\n{self.creator.token}\n")
        mounts: list[Path] = []
        binds: dict[str, Path] = {}
        try:
            etc = rundir / "etc"
            etc.mkdir(mode=0o755)
            for name, text in _guest.etc_files(uid).items():
                (etc / name).write_text(text)
                os.chmod(etc / name, 0o644)
                binds[f"/etc/{name}"] = etc / name
            if self.host_tmpfs:
                noexec = _rules.written_noexec(spec)
                for target, (size, inodes, mode) in _guest.tmpfs_sizes(spec).items():
                    path = rundir / _guest.host_folder(target)
                    path.mkdir()
                    mounts.append(path)  # before the mount: one cut short is undone too
                    _guest.mount_tmpfs(path, size=size, inodes=inodes, mode=mode, uid=uid, noexec=noexec)
                    binds[target] = path
        except BaseException:
            _release_mounts(rundir, mounts)
            raise
        return rundir, mounts, binds

    # -- the supervisor's files --------------------------------------------------------

    def _supervisor_mount(self, api: Any) -> str:
        """What containers mount at /opt/stockade: the host's supervisor folder, or a volume.

        Once per image, its own python compiles the supervisor (a short-lived helper
        container), so that every start loads bytecode instead of compiling it. Resolved once
        per backend: no engine round trip on the start path (a tag moved meanwhile is seen
        by the next backend).
        """
        if self._supervisor_source is not None and _builds.touch(self._supervisor_source[0]):
            return self._supervisor_source[1]
        with mapped_engine_errors(self.image, self.runtime):
            image_id = str(api.inspect_image(self.image)["Id"])
        self._image_id = image_id
        folder = _guest.supervisor_dir(self.state_dir, image_id)
        if not _guest.has_bytecode(folder, image_id):
            self._compile(api, folder, image_id)
        source = self._fill_volume(api, folder, image_id) if self.remote else str(folder)
        self._supervisor_source = (folder, source)
        return source

    def _helper(self, api: Any, command: list[str], binds: dict[str, dict[str, str]]) -> str:
        """A container that does one chore with the image, labelled like a sandbox for gc."""
        host_config = api.create_host_config(
            network_mode="none",
            binds=binds,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            mem_limit=256 * _guest.MiB,
            pids_limit=64,
            runtime=self.runtime,
            log_config=no_logs(),
        )
        created = api.create_container(
            self.image,
            command=command,
            user=f"{_guest.SANDBOX_UID}:{_guest.SANDBOX_UID}",
            network_disabled=True,
            labels=self._labels(SandboxSpec(), "helper-" + secrets.token_hex(4)),
            host_config=host_config,
        )
        return str(created["Id"])

    def _compile(self, api: Any, folder: Path, image_id: str) -> None:
        """Best effort: without bytecode, the supervisor compiles itself on every start.

        The helper writes its output to a file, fetched from the stopped container: it has
        no log (``no_logs``) to read it from.
        """
        to_file = f"import sys\nsys.stdout = open({COMPILED!r}, 'w')\n"
        argv = ["python3", "-S", "-E", "-s", "-c", to_file + _guest.COMPILE, "/tmp/stockade-src"]
        cid = ""
        try:
            with mapped_engine_errors(self.image, self.runtime):
                cid = self._helper(api, argv, {})
                api.put_archive(cid, "/tmp", _tar(_guest.python_sources(folder), folder="stockade-src"))
                api.start(cid)
                status = api.wait(cid, timeout=START_TIMEOUT_S).get("StatusCode")
                out = _fetch_file(api, cid, COMPILED) if status == 0 else b""
            if status == 0:
                _guest.install_bytecode(folder, image_id, json.loads(out))
        except (exc.StockadeError, ValueError, KeyError, OSError, tarfile.TarError):
            pass
        finally:
            if cid:
                remove_container(api, cid)

    def _fill_volume(self, api: Any, folder: Path, image_id: str) -> str:
        """A volume holding the supervisor folder, for engines that cannot see this host's files.

        Named after the folder (so after its content); filled once per image, through a
        container that is created but never started (the engine writes into its volumes).
        """
        name = f"stockade-{folder.name}"
        marker = f".bytecode-{_guest.bytecode_key(image_id)}"
        cid = ""
        with mapped_engine_errors(self.image, self.runtime):
            api.create_volume(name, labels={_guest.LABEL: "supervisor"})
            try:
                cid = self._helper(api, ["true"], {name: {"bind": _guest.SUPERVISOR_MOUNT, "mode": "rw"}})
                try:
                    api.get_archive(cid, f"{_guest.SUPERVISOR_MOUNT}/{marker}")[0].close()
                    return name
                except docker_py().errors.NotFound:
                    pass
                files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
                files |= {
                    f"__pycache__/{p.name}": p.read_bytes() for p in sorted(folder.glob("__pycache__/*.pyc"))
                }
                files.pop(marker, None)
                files[marker] = b""  # last: a partly filled volume is filled again
                api.put_archive(cid, _guest.SUPERVISOR_MOUNT, _tar(files))
            finally:
                if cid:
                    remove_container(api, cid)
        return name

    def _image_root(self) -> Path | None:
        """The folder the image was made from (the offline build's), to find programs in."""
        if self.image.partition(":")[0] != DEFAULT_IMAGE.partition(":")[0]:
            return None
        from stockade.sandbox._rootfs import find_rootfs

        return find_rootfs()

    def start(self, spec: SandboxSpec) -> SupervisedInstance:
        enforcement = self._plan(spec)
        # gVisor's kernel has neither Landlock nor seccomp user notification.
        rules = _rules.plan(spec, root=self._image_root(), can_mask=True, can_confine=not self.own_kernel)
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
        created: _Create | None = None
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
                rundir, mounts, binds = self._host_files(spec, sid, lease.uid)
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
                created = _Create(
                    lambda: api.create_container(
                        self.image,
                        command=list(_guest.SUPERVISOR_ARGV),
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
                _undo_start,
                api,
                cid=cid,
                created=created,
                name=name,
                egress=egress,
                rundir=rundir,
                mounts=mounts,
            )
            _exit.undo(undo, lease)
            raise
        boundary = _ContainerBoundary(api, cid, rundir, mounts, remote=self.remote, lease=lease)
        boundary.egress = egress
        instance = _ContainerInstance(
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
    return removed + _collect_rundirs(_guest.default_state_dir(), me, live_ids)


def _collect_rundirs(state_dir: Path, me: _guest.Creator, live_ids: set[str]) -> list[str]:
    """The host folders (and mounts) of containers whose creator is gone."""
    removed: list[str] = []
    if not state_dir.is_dir():
        return removed
    _host.collect_uid_leases(state_dir)
    _host.collect_staging(state_dir)
    for rundir in state_dir.glob("ctr-*"):
        if _host.claimed(rundir):
            continue
        try:
            host, token = (rundir / "creator").read_text().split("\n")[:2]
        except (OSError, ValueError):
            age = _host.seconds_since_change(rundir)
            if age is None or age < 60:
                continue  # gone, or a previous version's creator writing it
            host, token = me.host, ""
        if rundir.name.removeprefix("ctr-") in live_ids or me.alive_here(host, token):
            continue
        areas = [rundir / name for name in ("workspace", "tmp", "shm")]
        _release_mounts(rundir, [p for p in areas if p.is_mount()])
        removed.append(f"mounts {rundir}")
    return removed
