"""Memory snapshots of a gVisor container that Docker runs: its checkpoint by the engine's own
runsc, and what its restore needs of this host.

The engine's runsc keeps its state on this host (the containerd shim runs ``runsc --root
ROOT`` with the runtime's registered arguments): stockade checkpoints the container with that
runsc, root and arguments itself (``docker checkpoint`` needs an engine in experimental mode),
and restores the image with its own runsc, as a direct-mode sandbox. runsc restores a kernel
only onto the mounts it had, in their order: the container's mounts (Docker's and stockade's)
are kept in the snapshot (``DockerLayout``), each bind's source as a role (the workspace, the
supervisor, ...) bound again to the new sandbox's own; the root is the image's own layers
(``image_root``). Apart from ``_gvisor_memory``: finding the engine's runsc and its state,
reading a container's mounts and the engine's layers are Docker's alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade.sandbox import _guest, _host
from stockade.sandbox._gvisor_memory import RUNSC_TIMEOUT_S, SNAPSHOT_VERSION, call_runsc, checkpoint
from stockade.sandbox.snapshots import Reservation

# What a container's mount may be to be restored: a kernel's own filesystem (its content is
# in the image), or a bind of one of these (never a host path read from a snapshot).
KERNEL_MOUNTS = frozenset({"proc", "tmpfs", "devpts", "sysfs", "mqueue", "cgroup"})
BIND_ROLES = ("workspace", "tmp", "shm", "supervisor", "passwd", "group", "null", "unreadable")
# memory=None is the call that keeps memory where the tier can: only False asks for files.
FILES_ONLY_FIX = "pass memory=False to keep the files only"


@dataclass(frozen=True)
class DockerLayout:
    """What a memory image of a gVisor container of Docker needs of the sandbox restoring it:
    the image's files for its root, the uid its processes run as (a host uid of its own under
    Docker), and the container's mounts, in order, each bind's source a role of ``BIND_ROLES``."""

    image: str
    uid: int
    mounts: tuple[tuple[str, str, str, tuple[str, ...]], ...]  # destination, type, source, options

    def state(self) -> dict[str, Any]:
        mounts = [[dest, kind, source, list(options)] for dest, kind, source, options in self.mounts]
        return {"image": self.image, "uid": self.uid, "mounts": mounts}

    @classmethod
    def from_state(cls, state: Any) -> DockerLayout:
        """Read back from a snapshot (checked against its hash, but checked again: no mount
        that is not one of the kinds a container has, no bind of a source that is not a role)."""
        try:
            mounts = tuple(
                (str(d), str(t), str(src), tuple(str(o) for o in opts)) for d, t, src, opts in state["mounts"]
            )
            layout = cls(image=str(state["image"]), uid=int(state["uid"]), mounts=mounts)
        except (KeyError, TypeError, ValueError) as err:
            raise exc.SnapshotCorrupt(f"the snapshot's container layout cannot be read: {err}") from None
        for dest, kind, source, _ in layout.mounts:
            if not dest.startswith("/") or (kind == "bind" and source not in BIND_ROLES):
                raise exc.SnapshotCorrupt(f"the snapshot's container mounts {source!r} at {dest!r}")
            if kind != "bind" and kind not in KERNEL_MOUNTS:
                raise exc.SnapshotCorrupt(f"the snapshot's container has a {kind!r} mount at {dest!r}")
        if not 0 < layout.uid < 2**32 - 1:
            raise exc.SnapshotCorrupt(f"the snapshot's container ran as uid {layout.uid}")
        return layout

    def masks(self) -> tuple[str, ...]:
        """The paths the container had masked (an unreadable empty file bound over each)."""
        return tuple(sorted(dest for dest, _, source, _ in self.mounts if source == "unreadable"))

    def oci_mounts(self, sources: dict[str, Path]) -> list[dict[str, Any]]:
        """The container's mounts for a restore's ``config.json``, on the new sandbox's sources."""
        return [
            {
                "destination": dest,
                "type": kind,
                "source": str(sources[source]) if kind == "bind" else source,
                "options": list(options),
            }
            for dest, kind, source, options in self.mounts
        ]


def container_mounts(config: dict[str, Any], sources: dict[str, Path]) -> DockerLayout:
    """The layout of a container from its bundle's ``config.json`` (``sources``: role -> the
    host path the container has for it). A mount of anything else cannot be restored:
    ``LimitNotEnforceable``, before anything is checkpointed."""
    roles = {str(path.resolve()): role for role, path in sources.items()}
    mounts: list[tuple[str, str, str, tuple[str, ...]]] = []
    for mount in config.get("mounts") or []:
        dest, kind = str(mount.get("destination", "")), str(mount.get("type", ""))
        source = str(mount.get("source", ""))
        options = tuple(str(o) for o in mount.get("options") or ())
        if kind == "bind" or "bind" in options or "rbind" in options:
            role = roles.get(str(Path(source).resolve()))
            if role is None:
                raise exc.LimitNotEnforceable(
                    f"the container binds {source} at {dest}, which a restore cannot bind again",
                    setting="snapshot memory",
                    fix=FILES_ONLY_FIX,
                )
            mounts.append((dest, "bind", role, options))
        elif kind in KERNEL_MOUNTS:
            mounts.append((dest, kind, source, options))
        else:
            raise exc.LimitNotEnforceable(
                f"the container has a {kind!r} mount at {dest}, which a restore cannot make again",
                setting="snapshot memory",
                fix=FILES_ONLY_FIX,
            )
    return DockerLayout(image="", uid=0, mounts=tuple(mounts))


def docker_machine_key(runsc: str, platform: str, image: str, folder: Path, masks: tuple[str, ...]) -> str:
    """``machine_key`` of a container's image: the same runsc binary and platform, the image
    (by id) and supervisor, and masks."""
    parts: list[str] = [SNAPSHOT_VERSION, "docker", platform, image, folder.name, *sorted(masks)]
    real = Path(runsc).resolve()
    st = real.stat()
    parts += [str(real), str(st.st_size), str(st.st_mtime_ns)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


class ContainerMemory:
    """Checkpoints of one gVisor container that Docker runs on this host, by its own runsc."""

    def __init__(
        self,
        api: Any,
        cid: str,
        rundir: Path,
        *,
        runtime: dict[str, Any],
        platform: str,
        image: str,
        folder: Path,
        masks: tuple[str, ...],
        mask_binds: tuple[tuple[str, str], ...],
        uid: int,
        state_dir: Path,
    ) -> None:
        self.api = api
        self.state_dir = state_dir
        self.cid = cid
        self.rundir = rundir
        self.runtime = runtime  # the engine's entry for the runtime: its path and runtimeArgs
        self.platform = platform
        self.image = image
        self.folder = folder
        self.masks = masks
        self.mask_binds = mask_binds  # (host source, inside path): what the masks are bound as
        self.uid = uid

    def _argv(self) -> tuple[list[str], int]:
        """The runsc the shim runs for this container: the runtime's binary and arguments, and
        the state root the sandbox's kernel was started with (read from its command line), and
        the kernel's pid. The kernel is the sandbox's side of the boundary (its command line is
        in its own memory): the root is used only if it is root's alone and runsc's state
        there names this container with this pid (``_config``)."""
        binary = str(self.runtime.get("path") or "runsc")
        binary = shutil.which(binary) or binary
        args = [str(a) for a in self.runtime.get("runtimeArgs") or self.runtime.get("runtimeargs") or []]
        try:
            pid = int(self.api.inspect_container(self.cid)["State"]["Pid"] or 0)
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0") if pid else []
        except (OSError, KeyError, TypeError, ValueError, UnicodeDecodeError) as err:
            raise exc.SnapshotError(f"cannot find the container's runsc: {err}") from None
        except Exception as err:  # the engine's own errors (docker-py): the container is gone
            raise exc.SnapshotError(f"cannot find the container's runsc: {err}") from None
        root = ""
        for i, arg in enumerate(argv):
            if arg.startswith("--root="):
                root = arg.split("=", 1)[1]
            elif arg == "--root" and i + 1 < len(argv):
                root = argv[i + 1]
        if not root:
            raise exc.SnapshotError(f"the container's kernel (pid {pid}) names no runsc state root")
        try:
            st = os.stat(root)
        except OSError as err:
            raise exc.SnapshotError(f"the container's runsc state root {root!r}: {err}") from None
        if not os.path.isabs(root) or not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            raise exc.SnapshotError(
                f"the container's runsc state root {root!r} is not a folder only root writes"
            )
        return [binary, "--root", root, *args], pid

    def _config(self, argv: list[str], pid: int) -> dict[str, Any]:
        """The container's OCI ``config.json``, from the bundle runsc keeps for it (its state
        must name the container's kernel, ``pid``)."""
        try:
            done = subprocess.run(
                [*argv, "state", self.cid],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                env={"PATH": "/usr/bin:/bin"},
                timeout=RUNSC_TIMEOUT_S,
                check=True,
            )
            state = json.loads(done.stdout)
            bundle = Path(state["bundle"])
            config: dict[str, Any] = json.loads((bundle / "config.json").read_text())
        except (OSError, ValueError, KeyError, TypeError, subprocess.SubprocessError) as err:
            raise exc.SnapshotError(f"cannot read the container's runsc state: {err}") from None
        if state.get("id") != self.cid or state.get("pid") != pid:
            raise exc.SnapshotError("the container's runsc state names another sandbox than the engine's")
        return config

    def _sources(self) -> dict[str, Path]:
        """What each role of ``BIND_ROLES`` is on this host, for this container."""
        return {
            "workspace": self.rundir / "workspace",
            "tmp": self.rundir / "tmp",
            "shm": self.rundir / "shm",
            "supervisor": self.folder,
            "passwd": self.rundir / "etc" / "passwd",
            "group": self.rundir / "etc" / "group",
            "null": Path("/dev/null"),
            "unreadable": _guest.unreadable_file(self.state_dir),
        }

    def refusal(self) -> str | None:
        """Why this container's memory cannot be kept, known from its start (None: it can).
        A commands allowlist masks whole folders of programs by binding masked copies of them
        (``_rules_binds.mask_binds``): a restore binds again only the roles of ``BIND_ROLES``.
        Said before a snapshot reserves room, so that ``memory=None`` keeps the files."""
        roles = {str(path.resolve()) for path in self._sources().values()}
        for source, dest in self.mask_binds:
            if str(Path(source).resolve()) not in roles:
                return (
                    f"a gVisor container whose command rules bind a masked copy of {dest} keeps "
                    "files only in a snapshot (a restore cannot bind that copy again)"
                )
        return None

    def save(self, room: Reservation, *, stop: bool) -> tuple[dict[str, str], dict[str, Any]]:
        argv, pid = self._argv()
        mounts = container_mounts(self._config(argv, pid), self._sources()).mounts
        layout = DockerLayout(image=self.image, uid=self.uid, mounts=mounts)

        def runsc(*args: str, check: bool = True) -> None:
            call_runsc([*argv, *args], check=check)

        blobs, names = checkpoint(runsc, self.cid, self.rundir, room, stop=stop)
        key = docker_machine_key(argv[0], self.platform, self.image, self.folder, self.masks)
        return blobs, {"machine": key, "image": names, "docker": layout.state()}


# An image id names its content: its layers' folders are looked up once per process.
_layers: dict[str, list[Path]] = {}


def image_layers(image: str) -> list[Path]:
    """The folders of ``image``'s layers as the engine stores them on this host, top first
    (``SnapshotIncompatible`` without that engine or image, or with another storage driver)."""
    known = _layers.get(image)
    if known is not None and all(p.is_dir() for p in known):
        return known
    from stockade.sandbox._docker_engine import engine_client

    try:
        client = engine_client(None, 30)
        try:
            driver = client.inspect_image(image)["GraphDriver"]
        finally:
            client.close()
    except Exception as err:  # docker-py's and the engine's errors alike: no image, no engine
        raise exc.SnapshotIncompatible(
            f"the snapshot was taken in a Docker container of image {image[:19]}: its restore "
            f"needs that image in this host's engine ({err})"
        ) from None
    data = driver.get("Data") or {}
    if driver.get("Name") != "overlay2" or not data.get("UpperDir"):
        raise exc.SnapshotIncompatible(
            f"the engine stores image {image[:19]} with the {driver.get('Name')} driver; a restore "
            "reads its files from overlay2 layers only"
        )
    layers = [Path(data["UpperDir"]), *(Path(p) for p in str(data.get("LowerDir") or "").split(":") if p)]
    _layers[image] = layers
    return layers


def image_root(image: str, target: Path, mounts: list[Path]) -> Path:
    """The root a container of ``image`` had, for a restore: the image's one layer, or a
    read-only overlay of its layers at ``target`` (added to ``mounts``)."""
    layers = image_layers(image)
    if len(layers) == 1:
        return layers[0]
    target.mkdir(mode=0o755)
    _host.mount_layers(layers, target)
    mounts.append(target)
    return target
