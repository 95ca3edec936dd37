"""Memory snapshots of a gVisor sandbox run by stockade's own ``runsc`` (no Docker).

gVisor's kernel is a process of the host, so its whole state (every process inside, their
memory, pipes, the interpreter's threads) is what ``runsc checkpoint`` writes to one image,
and ``runsc restore`` starts a new sandbox from it. The sandbox's stdio, the supervisor's
channel to the host, is a host pipe: the restored kernel takes the restoring ``runsc``'s
stdio in its place, so the host talks to the restored supervisor over fresh pipes.

What the image does not hold: the workspace and /tmp, host tmpfs bound in (the host kernel
bounds their size and inodes). They are packed here on the host, while the sandbox is paused
(so files and memory are of one instant), as the same tars a files snapshot keeps, and
unpacked with the download extractor into the new sandbox's tmpfs before it is restored.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stockade import exceptions as exc
from stockade.sandbox import _guest
from stockade.sandbox._archive import Extraction
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._supervised import SupervisedInstance
from stockade.sandbox.snapshots import CHUNK, SnapshotStore

if TYPE_CHECKING:
    from stockade.sandbox.gvisor import RunscBackend

AREAS = ("workspace", "tmp")
# Part of every gVisor memory snapshot's machine key: raise it when what the host does
# around a checkpoint or a restore changes.
SNAPSHOT_VERSION = "1"
RUNSC_TIMEOUT_S = 300.0
IMAGE_ROLE = "memory"  # the role of checkpoint.img; any other file of the image: memory-<name>
MAIN_IMAGE = "checkpoint.img"
# Uncompressed: a checkpoint takes a quarter of the time (0.2 s against 0.7 s for an idle
# interpreter) for four times the bytes (21 MB against 5.6 MB), less than a microVM's RAM.
COMPRESSION = "--compression=none"


class RunscInstance(SupervisedInstance):
    """A gVisor sandbox that stockade's ``runsc`` runs: its memory can be kept."""

    backend: RunscBackend
    bundle: Path
    machine_key: str
    egress: EgressHandle | None  # the sandbox's egress proxy (``stockade.egress``)

    def memory_snapshots(self) -> str | None:
        if self.spec.network.egress:
            # its relay's connections end in this process's proxy, which a restore cannot bring back
            return "a gVisor sandbox with an egress allowlist keeps files only in a snapshot"
        return None

    def save_memory(self, store: SnapshotStore, *, stop: bool) -> tuple[dict[str, str], dict[str, Any]]:
        """Pause the sandbox, pack its files, checkpoint it, resume it (with ``stop``, the
        checkpoint is without ``--leave-running``: the sandbox ends as it resumes)."""
        self.backend.runsc_call("pause", self.id)
        image = store.temp_path("gvisor")
        image.mkdir(mode=0o700)
        try:
            blobs = {area: pack_area(self.bundle / area, store) for area in AREAS}
            leave = () if stop else ("--leave-running",)
            self.backend.runsc_call("checkpoint", COMPRESSION, "--image-path", str(image), *leave, self.id)
            names: dict[str, str] = {}
            for entry in sorted(image.iterdir()):
                if not entry.is_file() or entry.is_symlink():
                    raise exc.SnapshotError(f"runsc checkpoint wrote {entry.name!r}, which is no file")
                role = IMAGE_ROLE if entry.name == MAIN_IMAGE else f"{IMAGE_ROLE}-{entry.name}"
                names[entry.name] = role
                blobs[role] = store.add_file(entry)
            if MAIN_IMAGE not in names:
                raise exc.SnapshotError(f"runsc checkpoint wrote no {MAIN_IMAGE}")
        finally:
            shutil.rmtree(image, ignore_errors=True)
            # Also after a checkpoint that stopped it: a paused kernel cannot end, and would
            # hold its runsc (and ``runsc delete``, seconds) until it is resumed.
            self.backend.runsc_call("resume", self.id, check=False)
        return blobs, {"machine": self.machine_key, "image": names}


def machine_key(backend: RunscBackend, folder: Path, masks: tuple[str, ...]) -> str:
    """What a memory image needs of the sandbox restoring it: the same runsc binary and
    platform, root filesystem, supervisor and masks. Limits are the snapshot's own."""
    parts: list[str] = [SNAPSHOT_VERSION, backend.platform, folder.name, *masks]
    for path in (Path(backend.runsc), backend.rootfs):
        if path is not None:
            real = path.resolve()
            st = real.stat()
            parts += [str(real), str(st.st_size), str(st.st_mtime_ns)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def pack_area(folder: Path, store: SnapshotStore) -> str:
    """A tar of a paused sandbox's tmpfs (nothing in it changes meanwhile), as an object of
    ``store``: its folders, files, links, with their modes and times; what a tar cannot
    hold (sockets) is left out, as the supervisor's archives leave it out."""
    path = store.temp_path(folder.name)
    try:
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
            for full, name in _walk(folder):
                info = tar.gettarinfo(str(full), arcname=name)
                if info is None:  # a socket
                    continue
                info.uname = info.gname = ""
                if info.isreg():
                    with open(full, "rb", buffering=CHUNK) as fh:
                        tar.addfile(info, fh)
                else:
                    tar.addfile(info)
        os.chmod(path, 0o600)
        return store.add_file(path)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


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


def unpack_area(source: Path, dest: Path, *, max_bytes: int, max_entries: int) -> None:
    """Unpack a packed area into a new sandbox's (empty) tmpfs, as the sandbox's user owns it.

    The extractor made for sandboxes' downloads does it: nothing is written outside ``dest``
    whatever the tar holds (it was checked against its hash, but came from a sandbox's files).
    Its links are the sandbox's, to anywhere (a virtualenv's python links to /usr/bin): only
    the sandbox follows them, in its own root (this host never does, here or in ``pack_area``)."""
    with Extraction(dest, max_bytes=max_bytes, max_entries=max_entries, links_anywhere=True) as unpack:
        with open(source, "rb") as fh:
            while chunk := fh.read(CHUNK):
                unpack.feed(chunk)
        unpack.finish()
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _chown_tree(fd)
    finally:
        os.close(fd)


def _chown_tree(dir_fd: int) -> None:
    """Everything below ``dir_fd`` to the sandbox's user, never following a link."""
    for name in os.listdir(dir_fd):
        os.chown(name, _guest.SANDBOX_UID, _guest.SANDBOX_UID, dir_fd=dir_fd, follow_symlinks=False)
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            try:
                _chown_tree(fd)
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
