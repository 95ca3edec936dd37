"""A run's starting workspace, packed so that ``stockade replay`` can start from it again.

The pack is a gzipped tar built to be byte-identical for identical folders (sorted names, no
times, owners or umask in it), so its SHA-256 names it: a run store keeps each distinct seed
once, however many runs start from it. Its size is capped before anything is read in full.
Its files are the run's code's, so unpacking on the host does not lean on tarfile's ``data``
filter (its checks resolve paths with ``realpath``, which a chain of links longer than
PATH_MAX got past before Python 3.11.13 / 3.12.11: CVE-2025-4517): ``Extraction`` unpacks it,
as a sandbox's download, all or nothing, reaching every folder with ``O_NOFOLLOW``, no
absolute names, no ``..``, no devices, a hard link only to a file it made. A symlink that
points out of the folder (a virtualenv's ``bin/python`` -> ``/usr/bin/python3``) is kept as
the link it is, because the run's sandbox got it so (the upload sends links as they are):
refused, it made the whole seed unusable and the run unreplayable. Links are made last and
nothing is written through any link: a member under one is refused.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import stat
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

from stockade import exceptions as exc
from stockade._vcs import configured
from stockade.runs.handback import FileState, SeedFiles
from stockade.sandbox._archive import Extraction
from stockade.sandbox._archive_gzip import Inflated
from stockade.sandbox._requests import open_entry, unreadable, upload_entries

__all__ = ["MAX_SEED_BYTES", "Seed", "pack_workspace", "seed_files", "unpack_seed"]

MAX_SEED_BYTES = 64 * 1024 * 1024  # of file content, before compression


class Seed:
    """A packed workspace and the digest it is stored under."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.digest = "sha256:" + hashlib.sha256(data).hexdigest()


def _entries(root: Path, hide: Sequence[str], read: Sequence[str]) -> list[tuple[str, Path, os.stat_result]]:
    """What a seed keeps of ``root``: what the sandbox's upload of it sends (``upload_entries``:
    what ``read`` names, but stockade's own records, what ``hide`` names, and what holds a
    hidden file under another name), so that a seed never holds what the run's policy kept out
    of its sandbox (``paths.deny``, data classes above the role, a repository's history)."""
    kept, hidden_files = upload_entries(root, hide, read)
    entries = [
        (name, path, st)
        for path, name, st in kept
        if not (stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) in hidden_files)
    ]
    return sorted(entries, key=lambda entry: entry[0])


def pack_workspace(
    root: str | Path,
    *,
    max_bytes: int = MAX_SEED_BYTES,
    hide: Sequence[str] = (),
    read: Sequence[str] = ("**",),
) -> Seed:
    """Pack the folder ``root`` as the sandbox's upload of it sees it: what ``read`` names, but
    stockade's own records and what ``hide`` names (workspace globs); ``SeedTooLarge`` when its
    files add up to more than ``max_bytes``."""
    root = Path(root)
    if not root.is_dir():
        raise exc.ConfigurationError(f"the workspace {root} is not a folder")
    entries = _entries(root, hide, read)
    total = sum(st.st_size for _, _, st in entries if stat.S_ISREG(st.st_mode))
    if total > max_bytes:
        raise exc.SeedTooLarge(
            f"the workspace {root} holds {total:,} bytes of files, over the run store's seed cap of "
            f"{max_bytes:,}: raise it (RunStore(max_seed_bytes=...)), or leave build output and "
            "dependencies out of the workspace; `stockade replay --workspace` can still replay the run"
        )
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, path, st in entries:
            try:
                # a file opened first, and described by its descriptor (as the upload's tar)
                content = open_entry(path) if stat.S_ISREG(st.st_mode) else None
                info = tar.gettarinfo(str(path), arcname=name, fileobj=content)
            except (FileNotFoundError, NotADirectoryError):
                continue  # removed since the walk saw it: left out, as the upload leaves it
            except OSError as error:
                raise unreadable(path, error) from None
            with content or contextlib.nullcontext():
                if info is None or not (info.isfile() or info.isdir() or info.issym()):
                    continue  # sockets, FIFOs, devices: not workspace content
                info.mtime = 0
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mode &= 0o755 if info.isdir() or info.mode & 0o111 else 0o644
                try:
                    tar.addfile(info, content if info.isfile() else None)
                except OSError as error:  # it shrank meanwhile: the header promised its size
                    raise unreadable(path, error) from None
    return Seed(gzip.compress(buffer.getvalue(), mtime=0))


def unpack_seed(data: bytes, dest: str | Path) -> None:
    """Unpack a seed into the folder ``dest`` (created if missing); nothing is written outside
    it, whatever the seed holds (``RunStoreError`` and nothing written when it is refused)."""
    try:
        # the pack capped its files; what a database row holds besides bounds the rest
        with Extraction(dest, max_bytes=sys.maxsize, max_entries=sys.maxsize, links_anywhere=True,
                        count_metadata=False) as unpack:  # fmt: skip
            inflated = Inflated(unpack.feed)
            for start in range(0, len(data), Inflated.PIECE):
                inflated.feed(data[start : start + Inflated.PIECE])
            inflated.finish()
            unpack.finish()
    except (exc.WorkspaceError, exc.ProtocolError) as error:
        raise exc.RunStoreError(f"the stored workspace cannot be unpacked: {error}") from error


def seed_files(data: bytes) -> SeedFiles:
    """The content digest and executable bit of each regular file a seed holds, by its path, and
    what its repositories' config names as commands: what an export checks a file against
    before it hands back one of a repository's command files (``stockade._vcs``)."""
    found: dict[str, FileState] = {}
    # a seed the host packed (``pack_workspace``): its files are capped at MAX_SEED_BYTES
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data)), mode="r:") as tar:
        members = {member.name: member for member in tar if member.isfile()}

        def read(name: str) -> bytes | None:
            content = tar.extractfile(members[name]) if name in members else None
            return None if content is None else content.read()

        for name, member in members.items():
            found[name] = FileState.of_mode(hashlib.sha256(read(name) or b"").hexdigest(), member.mode)
        folders = [member.name for member in tar if member.isdir()]
        return SeedFiles(files=found, configured=configured(read, members, folders))
