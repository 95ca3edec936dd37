"""Memory snapshots of a gVisor sandbox, run by stockade's own ``runsc`` or by Docker.

gVisor's kernel is a process of the host, so its whole state (every process inside, their
memory, pipes, the interpreter's threads) is what ``runsc checkpoint`` writes to one image,
and ``runsc restore`` starts a new sandbox from it. The sandbox's stdio, the supervisor's
channel to the host, is a host pipe: the restored kernel takes the restoring ``runsc``'s
stdio in its place, so the host talks to the restored supervisor over fresh pipes.

What the image does not hold: the workspace and /tmp, host tmpfs bound in (the host kernel
bounds their size and inodes). They are packed here on the host, while the sandbox is paused
(so files and memory are of one instant), as the same tars a files snapshot keeps, and
unpacked with the download extractor into the new sandbox's tmpfs before it is restored
(``_gvisor_areas``).

Under Docker, stockade checkpoints the container with the engine's own runsc and restores the
image with its own, as a direct-mode sandbox, onto the mounts the container had
(``_gvisor_docker_memory``).

This module keeps what both modes share: the runsc calls, the checkpoint itself, the image's
folder for a restore, the machine key of stockade's own runsc and its running instance.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stockade import exceptions as exc
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._gvisor_areas import AREAS, check_restorable, pack_area
from stockade.sandbox._supervised import SupervisedInstance
from stockade.sandbox.snapshots import Reservation, SnapshotStore

if TYPE_CHECKING:
    from stockade.sandbox._gvisor_docker_memory import DockerLayout
    from stockade.sandbox._gvisor_settings import RunscSettings

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
EGRESS_REFUSAL = "a gVisor sandbox with an egress allowlist keeps files only in a snapshot"

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
