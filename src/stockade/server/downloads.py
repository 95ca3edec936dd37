"""Downloaded folders, packed again on the host into a file on disk and capped whole.

A folder the sandbox sends is checked and unpacked into a scratch folder first
(``files.download_dir``); what the service answers is a tar packed again from there. It is
packed into an unnamed temporary file in that folder, never in memory, and streamed from it:
a tar of tiny files with long names is mostly headers (a 1-byte hard link 4 KB deep costs
~10 KB of pax records), so packing into a ``BytesIO`` held ~14 KB of the service's memory
an entry for a byte of content, 900 MB for 60,000 hard links, kept after the request.

The cap counts the archive's every byte, headers, long-name records and padding included,
not only the files' contents: a tar that would pass it is refused (``FileTooLarge``) as the
byte that crosses it is about to be written. Tarfile's list of members, which keeps every
header written, is emptied as it goes. The unpack before it is bounded by the same cap:
it takes at most as many entries as a tar under the cap holds (``entries_that_fit``), as its
model of the tree costs ~1 KB of memory an entry with long names.
"""

from __future__ import annotations

import os
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from stockade import exceptions as exc

__all__ = ["entries_that_fit", "pack_folder"]


class _CappedFile:
    """What tarfile writes to: ``file``, refused before it grows past ``cap`` bytes."""

    def __init__(self, file: IO[bytes], cap: int, what: str) -> None:
        self._file = file
        self._cap = cap
        self._what = what
        self.size = 0

    def write(self, data: bytes) -> int:
        if self.size + len(data) > self._cap:
            raise exc.FileTooLarge(
                f"the archive of {self._what!r} is over the service's cap of {self._cap:,} bytes "
                "(its headers count: a long name or link costs up to ~10 KB an entry); "
                "download a smaller folder, or fewer entries at a time",
                path=self._what,
            )
        written = self._file.write(data)
        self.size += written
        return written

    def tell(self) -> int:
        return self.size


def entries_that_fit(cap: int) -> int:
    """The most entries a tar of at most ``cap`` bytes holds: a 512-byte header each at least,
    and the two blocks that end it. A download of more is refused before it is all unpacked."""
    return max(cap // tarfile.BLOCKSIZE - 2, 0)


def pack_folder(folder: Path, into: Path, *, cap: int, what: str) -> tuple[IO[bytes], int]:
    """A tar of ``folder``'s children (links, hard links and folders as they are), written to an
    unnamed file in folder ``into`` (gone with its descriptor, and with this process), and its
    size; ``FileTooLarge`` when the tar would be over ``cap`` bytes. ``what`` names the folder
    in errors. The file is read from its start; the caller closes it."""
    file = tempfile.TemporaryFile(dir=into)  # noqa: SIM115 - handed to the caller, open
    try:
        capped = _CappedFile(file, cap, what)
        with tarfile.open(fileobj=capped, mode="w") as tar:  # type: ignore[call-overload]
            for path, name in _walk(folder):
                _add(tar, path, name)
        file.seek(0)
        return file, capped.size
    except BaseException:
        file.close()
        raise


def _walk(folder: Path) -> Iterator[tuple[Path, str]]:
    """``folder``'s entries and their names in the tar, each folder before its contents, read
    as the walk goes (not ``TarFile.add``'s sorted lists, nor its recursion): a folder of a
    million entries costs one open listing, not a million names."""
    listings = [(os.scandir(folder), "")]
    try:
        while listings:
            listing, prefix = listings[-1]
            entry = next(listing, None)
            if entry is None:
                listings.pop()[0].close()
                continue
            name = prefix + entry.name
            yield Path(entry.path), name
            if entry.is_dir(follow_symlinks=False):  # at most MAX_DEPTH open: download_dir's
                listings.append((os.scandir(entry.path), f"{name}/"))
    finally:
        for listing, _ in listings:
            listing.close()


def _add(tar: tarfile.TarFile, path: Path, name: str) -> None:
    info = tar.gettarinfo(path, arcname=name)  # hard links: the second name on is a link
    if info is None:  # a socket: nothing an archive holds
        return
    if info.isreg():
        with path.open("rb") as content:
            tar.addfile(info, content)
    else:
        tar.addfile(info)
    tar.members.clear()  # type: ignore[attr-defined]  # tarfile keeps every header written: ~10 KB an entry
