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

Snapshots keep memory in both modes (``runsc checkpoint``, ``_gvisor_memory.py``; the tmpfs
in ``_gvisor_areas.py``, Docker's containers in ``_gvisor_docker_memory.py``): under
Docker, stockade checkpoints the container with the engine's own runsc state (a local engine
and root: the workspace and /tmp are host tmpfs). Either mode restores a memory snapshot of
either, with stockade's own runsc.

The direct mode is made of parts, each a base class of the next: its settings and the runsc calls
(``_gvisor_settings``) <- the launch on a bundle (``_gvisor_launch``) <- ``RunscBackend`` here,
which adds the start, the restore of a memory snapshot and the probe; what a bundle holds on
the host, and its release, is ``_gvisor_bundle``.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Literal

from stockade import exceptions as exc
from stockade.sandbox import _guest, _gvisor_areas, _gvisor_docker_memory, _gvisor_memory, _host, _rules
from stockade.sandbox._gvisor_bundle import head, release
from stockade.sandbox._gvisor_launch import RunscLaunch
from stockade.sandbox._gvisor_memory import RunscInstance
from stockade.sandbox._gvisor_settings import DEFAULT_PLATFORM, START_TIMEOUT_S
from stockade.sandbox._supervised import SupervisedInstance, enforcement_from_state
from stockade.sandbox._supervised_config import sandbox_id, supervisor_config
from stockade.sandbox.base import Backend, SandboxSpec
from stockade.sandbox.snapshots import SnapshotStore
from stockade.sandbox.supervisor.protocol import HMAC_SHA256
from stockade.types import SnapshotKind, TierReport

__all__ = ["GVisorBackend", "RunscBackend", "collect_garbage"]

Mode = Literal["auto", "docker", "runsc"]


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


class RunscBackend(RunscLaunch):
    """``runsc run`` on an OCI bundle stockade writes; needs root and the offline rootfs."""

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

        instance.start(config, START_TIMEOUT_S, rules, log=lambda: head(instance.bundle / "runsc.log"))
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
            docker = _gvisor_docker_memory.DockerLayout.from_state(state["docker"])
            masks = docker.masks()  # the image's own files, masked as the container had them
            folder = _guest.supervisor_dir(self.state_dir, docker.image)
            key = _gvisor_docker_memory.docker_machine_key(
                self.runsc, self.platform, docker.image, folder, masks
            )
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
                files={area: store.check_object(manifest.blobs[area]) for area in _gvisor_areas.AREAS},
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
                said = head(instance.bundle / "runsc.log")
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
        release(bundle, [p for p in areas if p.is_mount()])
        removed.append(f"runsc sandbox {sid}")
    return removed
