"""Uploaded archives, checked before anything is written, then unpacked into a folder of ours.

A workspace arrives as a tar (optionally gzipped). Every member is judged first, on the
archive alone: a name that is absolute, climbs with ``..``, or is not UTF-8 is refused, as is
a symlink whose target leaves the archive's root, a hard link, a device or a FIFO, and the
contents are counted against ``max_bytes`` and ``max_entries``. Only an archive with no such
member is unpacked, into a fresh temporary folder, with tarfile's ``data`` filter as the
second line (it resolves each destination and refuses one outside the folder).
"""

from __future__ import annotations

import io
import posixpath
import tarfile
from pathlib import Path

from stockade import exceptions as exc

__all__ = ["MAX_ENTRIES", "check_archive", "unpack_archive"]

MAX_ENTRIES = 100_000


def _inside(base: str, target: str) -> bool:
    """Whether ``target`` (relative to the folder of ``base``) stays in the archive's root."""
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(base), target))
    return not (joined == ".." or joined.startswith("../") or joined.startswith("/"))


def check_archive(data: bytes, *, max_bytes: int, max_entries: int = MAX_ENTRIES) -> list[tarfile.TarInfo]:
    """The members of a tar (or tar.gz) that may be unpacked; an error naming the first
    member that may not."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            members = tar.getmembers()
    except (tarfile.TarError, EOFError, OSError) as error:
        raise exc.InvalidArgument(
            f"the upload is not a tar archive ({error})",
            argument="body",
            fix="send a tar or tar.gz of the folder (Content-Type: application/x-tar)",
        ) from None
    if len(members) > max_entries:
        raise exc.FileTooLarge(f"the archive holds {len(members):,} entries, over the cap of {max_entries:,}")
    total = 0
    for member in members:
        name = member.name
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            shown = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            raise exc.InvalidArgument(
                f"the archive member {shown!r} has a name that is not UTF-8",
                argument="body",
                fix="rename the file with a UTF-8 name",
            ) from None
        parts = name.split("/")
        if name.startswith("/") or ".." in parts or "\x00" in name:
            raise exc.PathEscapeError(f"the archive member {name!r} leads outside the workspace", path=name)
        if member.issym():
            if member.linkname.startswith("/") or not _inside(name, member.linkname):
                raise exc.PathEscapeError(
                    f"the archive's symlink {name!r} points outside the workspace ({member.linkname!r})",
                    path=name,
                )
        elif member.islnk():
            raise exc.FileTypeError(
                f"the archive member {name!r} is a hard link; uploads take files, folders and symlinks "
                "inside the workspace",
                path=name,
            )
        elif not (member.isfile() or member.isdir()):
            raise exc.FileTypeError(
                f"the archive member {name!r} is a device, FIFO or other special file; uploads take "
                "files, folders and symlinks",
                path=name,
            )
        total += member.size if member.isfile() else 0
        if total > max_bytes:
            raise exc.FileTooLarge(f"the archive's files add up to more than {max_bytes:,} bytes", path=name)
    return members


def unpack_archive(data: bytes, dest: Path, *, max_bytes: int, max_entries: int = MAX_ENTRIES) -> int:
    """Check ``data`` and unpack it into ``dest`` (an empty folder); returns the files unpacked."""
    members = check_archive(data, max_bytes=max_bytes, max_entries=max_entries)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            tar.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, OSError) as error:
        raise exc.InvalidArgument(
            f"the archive could not be unpacked: {error}", argument="body", fix="send a well-formed tar"
        ) from None
    return sum(1 for m in members if m.isfile())
