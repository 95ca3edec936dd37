"""Uploaded archives, checked before anything is written, then unpacked into a folder of ours.

A workspace arrives as a tar, plain or compressed (gzip, bzip2, xz). Every member is judged
first, on the archive alone, as it streams by: a name that is absolute, climbs with ``..``
or is not UTF-8 is refused (``PathEscapeError``, ``InvalidArgument``), as is one more than
``MAX_DEPTH`` folders deep (``TreeTooDeep``: what no archive of a workspace takes), a hard link, a
device, a FIFO or a sparse file (``FileTypeError``), and a symlink whose target leaves the
archive's root when resolved the way the kernel would, through the archive's other symlinks
(``PathEscapeError``; a name that is a symlink and something else too is refused, so that
the links resolve alike whatever the order they are made in). The contents are counted
against ``max_bytes`` and the entries against ``max_entries`` (``FileTooLarge``).

Bombs stop early. The members' sizes are read from their headers, so a 1 TB file is refused
before a byte of it is decompressed; the entries are counted as they come, so a million
empty files stop at the cap; and the decompressed stream is metered: the bytes read may
not exceed what the members seen so far explain (their contents, and a few KiB of headers
each), nor one header exceed ``HEADER_ROOM``, so a gzip of a gigabyte of long-name header
costs a megabyte, not a gigabyte. Only an archive with no refused member is unpacked, into a
fresh folder, by ``Extraction`` (``stockade.sandbox._archive``: the download's extractor,
which follows no link while writing), not by tarfile; a failure there removes the folder.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import posixpath
import sys
import tarfile
import zlib
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from stockade import exceptions as exc
from stockade.sandbox._archive import Extraction
from stockade.sandbox._archive_members import MAX_DEPTH
from stockade.server.scratch import remove_tree

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["ENTRY_ROOM", "HEADER_ROOM", "MAX_ENTRIES", "check_archive", "unpack_archive"]

MAX_ENTRIES = 100_000
ENTRY_ROOM = 8 * 1024  # headers and padding of one entry, on average: a long name and link included
HEADER_ROOM = 1024 * 1024  # the most one member's headers (pax, GNU long names) may take
_SLACK = 4 * tarfile.RECORDSIZE + 64 * 1024  # read-ahead, the end-of-archive blocks and records
_LINK_HOPS = 40  # symlinks followed while resolving one target (the kernel's ELOOP limit)
_BLOCK = tarfile.BLOCKSIZE
_PIECE = 256 * 1024  # of the decompressed archive at a time: under what may follow its end


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def _not_a_tar(why: object) -> exc.InvalidArgument:
    return exc.InvalidArgument(
        f"the upload is not a tar archive ({why})",
        argument="body",
        fix="send a tar, tar.gz, tar.bz2 or tar.xz of the folder (Content-Type: application/x-tar)",
    )


class _Meter(io.RawIOBase):
    """The decompressed archive, read under a bound that grows only with what the members seen
    so far explain: past it, ``FileTooLarge``."""

    def __init__(self, source: io.BufferedIOBase) -> None:
        super().__init__()
        self.source = source
        self.read_bytes = 0
        self.explained = HEADER_ROOM + _SLACK  # and every member's padded data and ENTRY_ROOM, so far
        self.step_end = HEADER_ROOM + _SLACK  # the next member's headers must end before this

    def readable(self) -> bool:
        return True

    def member(self, member: tarfile.TarInfo) -> None:
        """A member was read: its data may follow, and the next member's headers."""
        data = _padded(member.size) if member.isreg() else 0
        self.explained += data + ENTRY_ROOM
        self.step_end = self.read_bytes + data + HEADER_ROOM + _SLACK

    def readinto(self, buffer: WriteableBuffer) -> int:
        limit = min(self.explained, self.step_end)
        if self.read_bytes >= limit:
            raise exc.FileTooLarge(
                f"the archive expands past what its members explain ({self.read_bytes:,} bytes read): "
                "a compression bomb, or an archive with oversized headers"
            )
        view = memoryview(buffer).cast("B")
        want = min(len(view), limit - self.read_bytes)
        try:
            data = self.source.read(want)
        except (OSError, EOFError, lzma.LZMAError, zlib.error) as error:
            raise _not_a_tar(f"its compression is broken: {error}") from None
        view[: len(data)] = data
        self.read_bytes += len(data)
        return len(data)


def _decompressed(data: bytes) -> io.BufferedIOBase:
    """``data`` as a stream of tar bytes: decompressed by us, a bounded piece per read."""
    raw = io.BytesIO(data)
    if data[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if data[:3] == b"BZh":
        return bz2.BZ2File(raw, mode="rb")
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.LZMAFile(raw, mode="rb")
    return raw


def _members(data: bytes) -> Iterator[tuple[tarfile.TarInfo, _Meter]]:
    """The members of the archive in order, each with the meter to tell about it."""
    meter = _Meter(_decompressed(data))
    stream = io.BufferedReader(meter, buffer_size=tarfile.RECORDSIZE)
    try:
        with tarfile.open(fileobj=stream, mode="r|", encoding="utf-8", errors="surrogateescape") as tar:
            for member in tar:
                yield member, meter
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as error:
        raise _not_a_tar(error) from None
    except OSError as error:  # a compressed stream that is not one (a bad gzip header)
        raise _not_a_tar(error) from None


def _escapes(link: str, target: str, links: Mapping[str, str]) -> bool:
    """Whether symlink ``link`` (a normalised member name) leads outside the archive's root
    once its ``target`` is resolved from its folder, through the archive's own ``links`` as
    the kernel would (followed, ``..`` applied where they lead); a loop counts as outside."""
    if target.startswith("/"):
        return True
    pending = deque([*link.split("/")[:-1], *target.split("/")])
    where: list[str] = []
    hops = 0
    while pending:
        part = pending.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            if not where:
                return True
            where.pop()
            continue
        found = links.get("/".join([*where, part]))
        if found is None:
            where.append(part)
            continue
        hops += 1
        if hops > _LINK_HOPS or found.startswith("/"):
            return True
        pending.extendleft(reversed(found.split("/")))
    return False


def _judge(member: tarfile.TarInfo) -> str:
    """The member's normalised name, or the error that refuses it."""
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
    if name.startswith("/") or ".." in name.split("/") or "\x00" in name:
        raise exc.PathEscapeError(f"the archive member {name!r} leads outside the workspace", path=name)
    if member.islnk():
        raise exc.FileTypeError(
            f"the archive member {name!r} is a hard link; uploads take files, folders and symlinks "
            "inside the workspace",
            path=name,
        )
    if member.issparse():
        raise exc.FileTypeError(
            f"the archive member {name!r} is a sparse file; pack it as a plain file (tar without -S)",
            path=name,
        )
    if not (member.isreg() or member.isdir() or member.issym()):
        raise exc.FileTypeError(
            f"the archive member {name!r} is a device, FIFO or other special file; uploads take "
            "files, folders and symlinks",
            path=name,
        )
    normal = posixpath.normpath(name)
    if normal.count("/") >= MAX_DEPTH:  # refused before 64 MiB of it is unpacked to the host's disk
        top = "/".join(normal.split("/")[:MAX_DEPTH])
        raise exc.TreeTooDeep(
            f"the archive member {top[:200]!r}... is {MAX_DEPTH} folders deep: what is in it is past "
            "what an archive of the workspace takes",
            path=name,
        )
    if member.issym() and normal == ".":
        raise exc.PathEscapeError(f"the archive's symlink {name!r} would replace the workspace", path=name)
    return normal


def check_archive(data: bytes, *, max_bytes: int, max_entries: int = MAX_ENTRIES) -> int:
    """Judge every member of a tar (plain, gzip, bzip2 or xz) without writing anything; the
    number of its entries. Raises an error naming the first member that may not be unpacked."""
    count = total = 0
    links: dict[str, str] = {}
    kinds: dict[str, bool] = {}  # every name seen: whether it was a symlink
    for member, meter in _members(data):
        count += 1
        if count > max_entries:
            raise exc.FileTooLarge(f"the archive holds more than {max_entries:,} entries, its cap")
        name = _judge(member)
        if member.isreg():
            total += member.size
            if total > max_bytes:
                raise exc.FileTooLarge(
                    f"the archive's files add up to more than {max_bytes:,} bytes", path=member.name
                )
        symlink = member.issym()
        if name in kinds and (symlink or kinds[name]):
            raise exc.PathEscapeError(
                f"the archive names {member.name!r} twice, once as a symlink: give each link one entry",
                path=member.name,
            )
        kinds[name] = symlink
        if symlink:
            links[name] = member.linkname
        meter.member(member)
    for name, target in links.items():
        if _escapes(name, target, links):
            raise exc.PathEscapeError(
                f"the archive's symlink {name!r} points outside the workspace ({target!r})", path=name
            )
    return count


def unpack_archive(data: bytes, dest: Path, *, max_bytes: int, max_entries: int = MAX_ENTRIES) -> int:
    """Check ``data`` and unpack it into ``dest`` (made here; removed again on failure);
    returns the files unpacked. Nothing is written when the check refuses the archive, and
    nothing outside ``dest`` whatever it holds: ``Extraction`` writes it (no link followed,
    a member below a link refused, each link resolved on the whole tree before it is made),
    not tarfile, whose ``data`` filter a link chain past PATH_MAX got through before Python
    3.11.13 / 3.12.11 (CVE-2025-4517), and which the check alone does not stop: it resolves
    links by the names members give, and a member named through a link is elsewhere."""
    check_archive(data, max_bytes=max_bytes, max_entries=max_entries)
    dest.mkdir(parents=True)
    try:
        # the check bounded what decompressing costs: the whole archive may be read again
        stream = _decompressed(data)
        with Extraction(
            dest, max_bytes=max_bytes, max_entries=sys.maxsize, count_metadata=False, global_comments=True
        ) as unpack:
            while not unpack.ended and (piece := stream.read(_PIECE)):
                unpack.feed(piece)  # past its end, tarfile reads no further: nor does this
            result = unpack.finish()
        if result.skipped_count:  # a link the check took for inside, out by the kernel's rules
            first = result.skipped[0]
            raise exc.PathEscapeError(
                f"the archive's {first.kind} {first.path!r} leads outside the workspace", path=first.path
            )
        return result.files
    except exc.ProtocolError as error:
        remove_tree(dest)
        raise _unpackable(error.why or error) from None
    except (OSError, EOFError, zlib.error, lzma.LZMAError) as error:
        remove_tree(dest)
        raise _unpackable(error) from None
    except BaseException:
        remove_tree(dest)
        raise


def _unpackable(why: object) -> exc.InvalidArgument:
    return exc.InvalidArgument(
        f"the archive could not be unpacked: {why}", argument="body", fix="send a well-formed tar"
    )


def unpack_within(data: bytes, dest: Path, room: int, cap: int) -> int:
    """``unpack_archive`` into at most ``room`` bytes, the part of the upload ``cap`` that its
    tenant's ``bodies_mb`` had left (``held.unpacking``): past a smaller room than the cap, it
    is the share that is full (``QuotaExceeded``), not the archive too large."""
    try:
        return unpack_archive(data, dest, max_bytes=room)
    except exc.FileTooLarge as error:
        if room >= cap:
            raise
        raise exc.QuotaExceeded(
            f"{error}: what the tenant's bodies_mb had left for unpacking it ({room:,} of the upload "
            f"cap's {cap:,} bytes); send it again once its other transfers have ended",
            quota="bodies_mb", limit=float(cap), used=float(cap - room),
        ) from None  # fmt: skip
