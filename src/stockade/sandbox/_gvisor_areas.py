"""The tmpfs a gVisor sandbox has on the host (its workspace, /tmp and /dev/shm), packed for a
memory snapshot and unpacked for its restore.

A ``runsc checkpoint`` image holds the kernel's memory, not these: they are host tmpfs bound
in, packed here while the sandbox is paused (so files and memory are of one instant) as the
same tars a files snapshot keeps, and unpacked with the download extractor into the new
sandbox's tmpfs before it is restored. Apart from the checkpoint: this is file handling (a
walk that never follows a link, a tar written within a reservation, an extraction, a chown),
which its own tests reach without a sandbox.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from stockade import exceptions as exc
from stockade.sandbox import _guest
from stockade.sandbox._archive import Extraction
from stockade.sandbox._archive_members import MAX_DEPTH
from stockade.sandbox._snapshot_files import CHUNK
from stockade.sandbox.snapshots import Reservation

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

AREAS = ("workspace", "tmp", "shm")  # the host tmpfs bound at /workspace, /tmp, /dev/shm
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
