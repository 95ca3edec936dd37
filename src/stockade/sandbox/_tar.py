"""An incremental reader of tar streams that come from a sandbox (untrusted, maybe endless).

``TarReader`` takes bytes as they arrive and hands out members and their data; it holds one
header (or one extended header, at most ``MAX_EXTENDED``) at a time, so a stream of any size
passes through bounded memory. It reads what the supervisor writes (POSIX pax, with GNU long
names and plain ustar too) and refuses what it never writes: global pax headers and sparse
members. Anything malformed is a ``ProtocolError``. Checking what the members *mean* is the
extractor's job (``_archive.py``).
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from dataclasses import dataclass

from stockade import exceptions as exc

__all__ = ["BLOCK", "NO_DATA", "Member", "TarReader", "malformed"]

BLOCK = 512
MAX_EXTENDED = 16 * 1024  # pax and GNU long-name data before one member: two 4 KiB paths and more
MAX_TRAILER = 1024 * 1024  # what may follow the end-of-archive blocks (tar pads to records)
NO_DATA = (
    tarfile.DIRTYPE,
    tarfile.SYMTYPE,
    tarfile.LNKTYPE,
    tarfile.FIFOTYPE,
    tarfile.CHRTYPE,
    tarfile.BLKTYPE,
)
_EXTENDED = (tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_REFUSED = (tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_SPARSE)


def malformed(why: str) -> exc.ProtocolError:
    error = exc.ProtocolError(f"the sandbox sent a malformed archive: {why}")
    error.why = why
    return error


@dataclass(frozen=True, slots=True)
class Member:
    """One member's header, extended headers applied."""

    name: str
    type: bytes
    size: int
    linkname: str
    mode: int
    mtime: float


class TarReader:
    """An incremental tar parser: ``feed`` bytes as they come, ``close`` at the end.

    Each member goes to ``on_member``, which says whether it wants the data; the data then
    goes to ``on_data`` piece by piece and ``on_end`` closes it. Holds at most one header,
    or one extended header, in memory.
    """

    _HEADER, _EXTENDED, _DATA, _SKIP, _END = range(5)

    def __init__(
        self,
        on_member: Callable[[Member], bool],
        on_data: Callable[[memoryview], None],
        on_end: Callable[[], None],
        *,
        global_comments: bool = False,
    ) -> None:
        """``global_comments``: skip a global pax header that holds only a ``comment`` (what
        ``git archive`` writes: the commit's id), which changes no member; any other is
        refused, as are all without it."""
        self._global_comments = global_comments
        self._on_member = on_member
        self._on_data = on_data
        self._on_end = on_end
        self._state = self._HEADER
        self._need = BLOCK
        self._buf = bytearray()
        self._ext_type = b""
        self._ext_size = 0
        self._ext_total = 0
        self._pax: dict[str, str] = {}
        self._long_name: str | None = None
        self._long_link: str | None = None
        self._pad = 0
        self._trailer = 0

    @property
    def ended(self) -> bool:
        return self._state == self._END

    def feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        pos = 0
        while pos < len(view):
            if self._state == self._END:
                self._trailer += len(view) - pos
                if self._trailer > MAX_TRAILER:
                    raise malformed("it goes on after its end")
                return
            take = min(self._need, len(view) - pos)
            piece = view[pos : pos + take]
            pos += take
            self._need -= take
            if self._state in (self._HEADER, self._EXTENDED):
                self._buf += piece
            elif self._state == self._DATA:
                self._on_data(piece)
            if self._need == 0:
                self._advance()

    def close(self) -> None:
        if self._state != self._END:
            raise malformed("it ends in the middle (no end-of-archive blocks)")

    def _advance(self) -> None:
        while self._need == 0 and self._state != self._END:
            if self._state == self._HEADER:
                block = bytes(self._buf)
                self._buf.clear()
                self._header(block)
            elif self._state == self._EXTENDED:
                data = bytes(self._buf[: self._ext_size])
                self._buf.clear()
                self._extended(data)
                self._enter(self._HEADER, BLOCK)
            elif self._state == self._DATA:
                self._on_end()
                self._enter(self._SKIP, self._pad)
            else:
                self._enter(self._HEADER, BLOCK)

    def _enter(self, state: int, need: int) -> None:
        self._state = state
        self._need = need

    def _header(self, block: bytes) -> None:
        if not any(block):  # a zero block: the end of the archive
            if self._pax or self._long_name is not None or self._long_link is not None:
                raise malformed("an extended header with no member after it")
            self._enter(self._END, 0)
            return
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as err:
            raise malformed(str(err)) from None
        kind = info.type
        if info.size < 0:
            raise malformed(f"a negative size ({info.size})")
        skipped = kind == tarfile.XGLTYPE and self._global_comments
        if kind in _REFUSED and not skipped:
            raise malformed(f"an unsupported member type {kind!r}")
        if kind in _EXTENDED or skipped:
            self._ext_total += BLOCK + info.size
            if self._ext_total > MAX_EXTENDED:
                raise malformed(f"extended headers over {MAX_EXTENDED} bytes for one member")
            self._ext_type = kind
            self._ext_size = info.size
            self._enter(self._EXTENDED, _padded(info.size))
            return
        name = self._pax.get("path", info.name if self._long_name is None else self._long_name)
        link = self._pax.get("linkpath", info.linkname if self._long_link is None else self._long_link)
        size = _pax_size(self._pax, info.size)
        mtime = _pax_mtime(self._pax, info.mtime)
        self._pax = {}
        self._long_name = self._long_link = None
        self._ext_total = 0
        if kind in NO_DATA and size:
            raise malformed(f"{name!r} has data but is of type {kind!r}")
        wanted = self._on_member(
            Member(name=name, type=kind, size=size, linkname=link, mode=info.mode, mtime=mtime)
        )
        if kind in NO_DATA:
            self._enter(self._HEADER, BLOCK)
        elif wanted:
            self._pad = _padded(size) - size
            self._enter(self._DATA, size)
        else:
            self._enter(self._SKIP, _padded(size))

    def _extended(self, data: bytes) -> None:
        if self._ext_type == tarfile.XGLTYPE:
            settings = sorted(set(_pax_records(data)) - {"comment"})
            if settings:
                raise malformed(f"a global pax header that sets {', '.join(settings)[:200]}")
            return
        if self._ext_type == tarfile.XHDTYPE:
            self._pax.update(_pax_records(data))
            if any(key.startswith("GNU.sparse") for key in self._pax):
                raise malformed("a sparse member (not supported)")
            return
        text = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        if self._ext_type == tarfile.GNUTYPE_LONGNAME:
            self._long_name = text
        else:
            self._long_link = text


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _pax_records(data: bytes) -> dict[str, str]:
    """``LENGTH KEY=VALUE\\n`` records; values as bytes in a str (surrogateescape), like names."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos, pos + 12)
        digits = data[pos:space] if space > pos else b""
        if not digits.isdigit():
            raise malformed("a pax record without a length")
        end = pos + int(digits)
        if end <= space + 2 or end > len(data) or data[end - 1] != 0x0A:
            raise malformed("a pax record of a wrong length")
        key, sep, value = data[space + 1 : end - 1].partition(b"=")
        if not sep or not key:
            raise malformed("a pax record without a key")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos = end
    return out


def _pax_size(pax: dict[str, str], default: int) -> int:
    text = pax.get("size")
    if text is None:
        return default
    if not (text.isascii() and text.isdigit()):  # "²" is a digit to isdigit, not to int
        raise malformed(f"a pax size of {text[:40]!r}")
    return int(text)


def _pax_mtime(pax: dict[str, str], default: float) -> float:
    text = pax.get("mtime")
    if text is None:
        return float(default)
    try:
        return float(text)
    except ValueError:
        raise malformed(f"a pax mtime of {text[:40]!r}") from None
