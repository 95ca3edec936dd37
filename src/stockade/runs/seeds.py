"""A run's starting workspace, packed so that ``stockade replay`` can start from it again.

The pack is a gzipped tar built to be byte-identical for identical folders (sorted names, no
times, owners or umask in it), so its SHA-256 names it: a run store keeps each distinct seed
once, however many runs start from it. Its size is capped before anything is read in full.
Unpacking uses tarfile's ``data`` filter (no absolute paths, no links out of the folder, no
devices), because a pack read back from a database is not trusted more than any input.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Sequence
from pathlib import Path

from stockade import exceptions as exc
from stockade._globs import covers
from stockade._state import CARRIED, STATE_DIR, is_state

__all__ = ["MAX_SEED_BYTES", "Seed", "pack_workspace", "unpack_seed"]

MAX_SEED_BYTES = 64 * 1024 * 1024  # of file content, before compression


class Seed:
    """A packed workspace and the digest it is stored under."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.digest = "sha256:" + hashlib.sha256(data).hexdigest()


def _entries(root: Path, hide: Sequence[str]) -> list[tuple[str, Path]]:
    """What a seed keeps of ``root``: all but stockade's own records (``stockade._state``) and
    what ``hide`` names (a folder with what it holds)."""
    found: list[tuple[str, Path]] = []
    for folder, dirs, files in os.walk(root):
        base = Path(folder)
        dirs[:] = sorted(d for d in dirs if not _left_out(base / d, root, hide))
        for name in [*dirs, *sorted(f for f in files if not _left_out(base / f, root, hide))]:
            path = base / name
            found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def _left_out(path: Path, root: Path, hide: Sequence[str]) -> bool:
    name = path.relative_to(root).as_posix()
    if is_state(name) or covers(hide, name):
        return True
    # a records folder that holds none of the run's own bookkeeping: not even its name
    return path.name == STATE_DIR and not any(os.path.lexists(path / c) for c in CARRIED)


def pack_workspace(root: str | Path, *, max_bytes: int = MAX_SEED_BYTES, hide: Sequence[str] = ()) -> Seed:
    """Pack the folder ``root``, but stockade's own records and what ``hide`` names (workspace
    globs); ``SeedTooLarge`` when its files add up to more than ``max_bytes``."""
    root = Path(root)
    if not root.is_dir():
        raise exc.ConfigurationError(f"the workspace {root} is not a folder")
    entries = _entries(root, hide)
    total = sum(p.lstat().st_size for _, p in entries if stat.S_ISREG(p.lstat().st_mode))
    if total > max_bytes:
        raise exc.SeedTooLarge(
            f"the workspace {root} holds {total:,} bytes of files, over the run store's seed cap of "
            f"{max_bytes:,}: raise it (RunStore(max_seed_bytes=...)), or leave build output and "
            "dependencies out of the workspace; `stockade replay --workspace` can still replay the run"
        )
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in entries:
            info = tar.gettarinfo(str(path), arcname=name)
            if not (info.isfile() or info.isdir() or info.issym()):
                continue  # sockets, FIFOs, devices: not workspace content
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode &= 0o755 if info.isdir() or info.mode & 0o111 else 0o644
            if info.isfile():
                with path.open("rb") as content:
                    tar.addfile(info, content)
            else:
                tar.addfile(info)
    return Seed(gzip.compress(buffer.getvalue(), mtime=0))


def unpack_seed(data: bytes, dest: str | Path) -> None:
    """Unpack a seed into the folder ``dest`` (created if missing)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data)), mode="r:") as tar:
            tar.extractall(dest, filter="data")
    except (OSError, EOFError, tarfile.TarError) as error:
        raise exc.RunStoreError(f"the stored workspace cannot be unpacked: {error}") from error
