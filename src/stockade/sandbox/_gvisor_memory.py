"""Memory snapshots of a gVisor sandbox, run by stockade's own ``runsc`` or by Docker.

gVisor's kernel is a process of the host, so its whole state (every process inside, their
memory, pipes, the interpreter's threads) is what ``runsc checkpoint`` writes to one image,
and ``runsc restore`` starts a new sandbox from it. The sandbox's stdio, the supervisor's
channel to the host, is a host pipe: the restored kernel takes the restoring ``runsc``'s
stdio in its place, so the host talks to the restored supervisor over fresh pipes.

What the image does not hold: the workspace and /tmp, host tmpfs bound in (the host kernel
bounds their size and inodes). They are packed here on the host, while the sandbox is paused
(so files and memory are of one instant), as the same tars a files snapshot keeps, and
unpacked with the download extractor into the new sandbox's tmpfs before it is restored.

Under Docker, the engine's runsc keeps its state on this host (the containerd shim runs
``runsc --root ROOT`` with the runtime's registered arguments): stockade checkpoints the
container with that runsc, root and arguments itself (``docker checkpoint`` needs an engine in
experimental mode), and restores the image with its own runsc, as a direct-mode sandbox. runsc
restores a kernel only onto the mounts it had, in their order: the container's mounts (Docker's
and stockade's) are kept in the snapshot, each bind's source as a role (the workspace, the
supervisor, ...) bound again to the new sandbox's own; the root is the image's own layers.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stockade import exceptions as exc
from stockade.sandbox import _guest, _host
from stockade.sandbox._archive import Extraction
from stockade.sandbox._archive_members import MAX_DEPTH
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._snapshot_files import CHUNK
from stockade.sandbox._supervised import SupervisedInstance
from stockade.sandbox.snapshots import Reservation, SnapshotStore

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from stockade.sandbox._gvisor_settings import RunscSettings

AREAS = ("workspace", "tmp", "shm")  # the host tmpfs bound at /workspace, /tmp, /dev/shm
# Part of every gVisor memory snapshot's machine key: raise it when what the host does
# around a checkpoint or a restore changes.
# 2: /dev/shm a host tmpfs too (an area), no longer gVisor's. 3: under a commands allowlist
# the written places noexec in gVisor's view; a checkpoint keeps its mounts' flags whatever
# config.json says at restore, so an older one under an allowlist would run written files.
# 4: under an allowlist the supervisor's filter refuses memfds; a checkpoint keeps its
# processes' filters, and an older one's have none (a program written to a memfd ran).
# 5: under Docker and an allowlist, the supervisor's own view has its written places noexec
# (supervisor/noexec.py); an older checkpoint's processes see them without it.
SNAPSHOT_VERSION = "5"
RUNSC_TIMEOUT_S = 300.0
IMAGE_ROLE = "memory"  # the role of checkpoint.img; any other file of the image: memory-<name>
MAIN_IMAGE = "checkpoint.img"
# Uncompressed: a checkpoint takes a quarter of the time (0.2 s against 0.7 s for an idle
# interpreter) for four times the bytes (21 MB against 5.6 MB), less than a microVM's RAM.
COMPRESSION = "--compression=none"
# What a container's mount may be to be restored: a kernel's own filesystem (its content is
# in the image), or a bind of one of these (never a host path read from a snapshot).
KERNEL_MOUNTS = frozenset({"proc", "tmpfs", "devpts", "sysfs", "mqueue", "cgroup"})
BIND_ROLES = ("workspace", "tmp", "shm", "supervisor", "passwd", "group", "null", "unreadable")
EGRESS_REFUSAL = "a gVisor sandbox with an egress allowlist keeps files only in a snapshot"
# memory=None is the call that keeps memory where the tier can: only False asks for files.
FILES_ONLY_FIX = "pass memory=False to keep the files only"

RunscCall = Callable[..., None]


def call_runsc(argv: list[str], *, check: bool = True) -> None:
    """One ``runsc pause``, ``resume`` or ``checkpoint`` (``SnapshotError`` with its reason)."""
    what = next((a for a in argv[1:] if not a.startswith("-") and "/" not in a), "call")
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin"},
            timeout=RUNSC_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        if check:
            raise exc.SnapshotError(f"runsc {what} failed: {err}") from None
        return
    if check and done.returncode != 0:
        said = done.stderr.decode("utf-8", "replace").strip().splitlines() or ["no reason given"]
        raise exc.SnapshotError(f"runsc {what} failed: {said[-1][:500]}")


def checkpoint(
    runsc: RunscCall, sid: str, areas: Path, room: Reservation, *, stop: bool
) -> tuple[dict[str, str], dict[str, str]]:
    """Pause the sandbox, pack its files (``areas``/workspace, /tmp and /dev/shm), checkpoint it, resume
    it (with ``stop``, the checkpoint is without ``--leave-running``: the sandbox ends as it
    resumes), all within ``room``. The objects (role -> digest) and the image's files (name -> role)."""
    store = room.store
    runsc("pause", sid)
    image = store.temp_path("gvisor")
    image.mkdir(mode=0o700)
    packed: dict[str, Path] = {}
    try:
        for area in AREAS:  # all of them, before anything is written
            check_restorable(areas / area)
        for area in AREAS:
            packed[area] = pack_area(areas / area, room)
        leave = () if stop else ("--leave-running",)
        runsc("checkpoint", COMPRESSION, "--image-path", str(image), *leave, sid)
        room.charge(image)
        blobs = {area: store.add_file(path) for area, path in packed.items()}
        names: dict[str, str] = {}
        for entry in sorted(image.iterdir()):
            if not entry.is_file() or entry.is_symlink():
                raise exc.SnapshotError(f"runsc checkpoint wrote {entry.name!r}, which is no file")
            role = IMAGE_ROLE if entry.name == MAIN_IMAGE else f"{IMAGE_ROLE}-{entry.name}"
            names[entry.name] = role
            blobs[role] = store.add_file(entry)
        if MAIN_IMAGE not in names:
            raise exc.SnapshotError(f"runsc checkpoint wrote no {MAIN_IMAGE}")
    except BaseException:
        for path in packed.values():  # not objects yet: nothing of a refused snapshot stays
            path.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(image, ignore_errors=True)
        # Also after a checkpoint that stopped it: a paused kernel cannot end, and would
        # hold its runsc (and ``runsc delete``, seconds) until it is resumed.
        runsc("resume", sid, check=False)
    return blobs, names


class RunscInstance(SupervisedInstance):
    """A gVisor sandbox that stockade's ``runsc`` runs: its memory can be kept."""

    backend: RunscSettings
    bundle: Path
    machine_key: str
    egress: EgressHandle | None  # the sandbox's egress proxy (``stockade.egress``)
    docker: DockerLayout | None = None  # restored from a container of Docker: its layout, kept on

    def memory_snapshots(self) -> str | None:
        if self.spec.network.egress:
            # its relay's connections end in this process's proxy, which a restore cannot bring back
            return EGRESS_REFUSAL
        return None

    def save_memory(self, room: Reservation, *, stop: bool) -> tuple[dict[str, str], dict[str, Any]]:
        blobs, names = checkpoint(self.backend.runsc_call, self.id, self.bundle, room, stop=stop)
        origin = {"docker": self.docker.state()} if self.docker is not None else {}
        return blobs, {"machine": self.machine_key, "image": names, **origin}


def machine_key(backend: RunscSettings, folder: Path, masks: tuple[str, ...]) -> str:
    """What a memory image needs of the sandbox restoring it: the same runsc binary and
    platform, root filesystem, supervisor and masks. Limits are the snapshot's own."""
    parts: list[str] = [SNAPSHOT_VERSION, backend.platform, folder.name, *masks]
    for path in (Path(backend.runsc), backend.rootfs):
        if path is not None:
            real = path.resolve()
            st = real.stat()
            parts += [str(real), str(st.st_size), str(st.st_mtime_ns)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


# The Limits setting that sizes each area's tmpfs (``_guest.tmpfs_sizes``).
AREA_SETTINGS = {"workspace": "disk_mb", "tmp": "tmp_mb", "shm": "tmp_mb"}


def check_restorable(folder: Path) -> None:
    """Refuse (``SnapshotIncompatible``) an area whose files, by apparent size, pass its own
    tmpfs's size: its restore writes them whole (a sparse file's holes as bytes) into a tmpfs
    of that size, and would fail every time. A paused sandbox's tmpfs (nothing in it changes
    meanwhile), mounted by this host: its size is the host kernel's word."""
    st = os.statvfs(folder)
    limit = st.f_blocks * st.f_frsize
    total, largest, seen = 0, ("", -1), set()
    for full, name in _walk(folder):
        info = full.lstat()
        if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) in seen:
            continue
        seen.add((info.st_dev, info.st_ino))  # a hard-linked file is kept once
        total += info.st_size
        largest = max(largest, (name, info.st_size), key=lambda item: item[1])
    if total > limit:
        area = folder.name
        setting = f"{AREA_SETTINGS.get(area, 'size_mb')}={limit >> 20}"
        raise exc.SnapshotIncompatible(
            f"cannot snapshot the sandbox's {area}: its files come to {total} bytes, more than the "
            f"{limit} bytes the {area} holds ({setting}), so no restore could put them back; "
            f"{largest[0]!r} is {largest[1]} bytes (a sparse file counts whole: "
            "a snapshot keeps its holes as bytes): remove or shrink it and snapshot again"
        )


def pack_area(folder: Path, room: Reservation) -> Path:
    """A tar of a paused sandbox's tmpfs (nothing in it changes meanwhile), written within
    ``room`` to a file of the store's ``tmp`` (``store.add_file`` makes it an object): its
    folders, files, links, with their modes and times; what a tar cannot hold (sockets) is
    left out, as the supervisor's archives leave it out. A sparse file is written whole
    (``check_restorable`` refused the area first if that would not fit its tmpfs)."""
    with room.open(folder.name) as (path, write):
        with tarfile.open(fileobj=_Sink(write), mode="w", format=tarfile.PAX_FORMAT) as tar:
            for full, name in _walk(folder):
                if name.count("/") >= MAX_DEPTH:  # its restore would refuse it: refused now
                    top = "/".join(name.split("/")[:MAX_DEPTH])
                    raise exc.TreeTooDeep(
                        f"cannot snapshot the sandbox's {folder.name}: {top[:200]!r}... is {MAX_DEPTH} "
                        "folders deep: what is in it is past what an archive takes",
                        path=name,
                    )
                info = tar.gettarinfo(str(full), arcname=name)
                if info is None:  # a socket
                    continue
                info.uname = info.gname = ""
                if info.isreg():
                    with open(full, "rb", buffering=CHUNK) as fh:
                        tar.addfile(info, fh)
                else:
                    tar.addfile(info)
        return path


class _Sink(io.BufferedIOBase):
    """What tarfile writes to: a reservation's ``write``."""

    def __init__(self, write: Callable[[bytes], None]) -> None:
        super().__init__()
        self._write = write
        self._at = 0

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer, /) -> int:
        chunk = bytes(data)
        self._write(chunk)
        self._at += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self._at


def _walk(root: Path) -> Iterator[tuple[Path, str]]:
    """Every entry under ``root``, parents first, never through a link."""
    stack = [(root, "")]
    while stack:
        folder, prefix = stack.pop()
        with os.scandir(folder) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                name = f"{prefix}{entry.name}"
                yield Path(entry.path), name
                if entry.is_dir(follow_symlinks=False):
                    stack.append((Path(entry.path), name + "/"))


def unpack_area(
    source: Path, dest: Path, *, max_bytes: int, max_entries: int, uid: int = _guest.SANDBOX_UID
) -> None:
    """Unpack a packed area into a new sandbox's (empty) tmpfs, as the sandbox's user owns it.

    The extractor made for sandboxes' downloads does it: nothing is written outside ``dest``
    whatever the tar holds (it was checked against its hash, but came from a sandbox's files).
    Its links are the sandbox's, to anywhere (a virtualenv's python links to /usr/bin): only
    the sandbox follows them, in its own root (this host never does, here or in ``pack_area``).
    ``max_bytes`` is the tmpfs's size, which its files' contents fill; its entries take RAM
    bounded by its inode cap, not that size, so they are not counted against it."""
    try:
        with Extraction(
            dest, max_bytes=max_bytes, max_entries=max_entries, links_anywhere=True, count_metadata=False
        ) as unpack:
            with open(source, "rb") as fh:
                while chunk := fh.read(CHUNK):
                    unpack.feed(chunk)
            unpack.finish()
    except exc.FileTooLarge as error:
        # The extractor's words are a download's ("pass a larger max_bytes to
        # files.download_dir"): a restore has no such argument, only what it found is said.
        found = str(error).split("; pass a larger")[0].replace(f"the download into {str(dest)!r}", "it")
        area = dest.name
        raise exc.SnapshotIncompatible(
            f"the snapshot's {area} does not fit this sandbox's ({max_bytes} bytes, "
            f"{AREA_SETTINGS.get(area, 'its size')}; {max_entries} entries): {found}; a snapshot "
            "whose files pass the sandbox it was taken in cannot be restored"
        ) from None
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _chown_tree(fd, uid)
    finally:
        os.close(fd)


def _chown_tree(dir_fd: int, uid: int) -> None:
    """Everything below ``dir_fd`` to the sandbox's user, never following a link."""
    for name in os.listdir(dir_fd):
        os.chown(name, uid, uid, dir_fd=dir_fd, follow_symlinks=False)
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            try:
                _chown_tree(fd, uid)
            finally:
                os.close(fd)


def image_dir(store: SnapshotStore, blobs: dict[str, str], names: dict[str, str]) -> Path:
    """A folder as ``runsc restore`` wants the image: links to the store's checked objects
    (a link leaves the object's change time alone, so its hash need not be taken again)."""
    folder = store.temp_path("restore")
    folder.mkdir(mode=0o700)
    for name, role in names.items():
        if "/" in name or name.startswith(".") or role not in blobs:
            shutil.rmtree(folder, ignore_errors=True)
            raise exc.SnapshotCorrupt(f"the snapshot's image lists {name!r}, which it does not keep")
        os.symlink(store.check_object(blobs[role]), folder / name)
    return folder


# -- gVisor containers of Docker ------------------------------------------------------------


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
