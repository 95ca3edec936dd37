"""What ``read_file`` reads a file with: the lines it shows, fed a chunk at a time (``Window``),
and the scan that feeds it and checks the file is UTF-8 on the way (``scan``). Apart from the
tool: it is a reader of bytes with its own bounds, which the tool only words for the model.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

from stockade.exceptions import ToolError
from stockade.sandbox.facade import Sandbox

__all__ = ["MAX_SHOWN_BYTES", "MAX_SHOWN_LINES", "READ_CHUNK", "Window", "scan"]

# read_file holds one chunk of the file and the lines it shows, never the whole file: a file
# the code wrote may be as large as the sandbox's disk (256 MiB by default), and one string
# per line of it took 28 times its size in the host.
READ_CHUNK = 1 << 20
MAX_SHOWN_BYTES = 128 * 1024  # of one reply's lines; a longer first line is cut
MAX_SHOWN_LINES = 2_000


@dataclass
class Window:
    """The lines ``[offset, offset + limit)`` of a file fed a chunk at a time: the others are
    counted, not split; those shown are kept, ``MAX_SHOWN_BYTES`` of them at most."""

    offset: int
    limit: int
    newlines: int = 0  # lines ended so far
    shown: list[bytes] = field(default_factory=list)
    kept: int = 0  # bytes of shown
    done: bool = False  # no more lines are shown (the limit, or the bytes)
    cut: int | None = None  # the size of the one line shown in part
    line: bytearray | None = None  # the shown line being read, its first bytes
    size: int = 0  # the whole size of that line
    ends_open: bool = False  # the last line has no newline

    def feed(self, chunk: bytes) -> None:
        i = 0
        while i < len(chunk):
            if self.newlines < self.offset:
                i = self._skip(chunk, i)
            elif self.done:
                self.newlines += chunk.count(b"\n", i)
                i = len(chunk)
            else:
                i = self._read(chunk, i)
        if chunk:
            self.ends_open = chunk[-1] != ord("\n")

    def finish(self) -> None:
        """The file ended: a last line without a newline is a line too."""
        if self.line is not None:
            self._end_line()

    def _skip(self, chunk: bytes, i: int) -> int:
        """Past the lines before ``offset``, counted a chunk at a time where it can."""
        need = self.offset - self.newlines
        if chunk.count(b"\n", i) < need:
            self.newlines += chunk.count(b"\n", i)
            return len(chunk)
        for _ in range(need):
            i = chunk.index(b"\n", i) + 1
        self.newlines += need
        return i

    def _read(self, chunk: bytes, i: int) -> int:
        """Gather the shown line at ``i``: only as much of it as may be shown."""
        nl = chunk.find(b"\n", i)
        stop = len(chunk) if nl < 0 else nl
        if self.line is None:
            self.line = bytearray()
        room = MAX_SHOWN_BYTES - self.kept - len(self.line)
        self.line += chunk[i : i + min(stop - i, max(room, 0))]
        self.size += stop - i
        if nl < 0:
            return len(chunk)
        self._end_line()
        self.newlines += 1
        return nl + 1

    def _end_line(self) -> None:
        line, size = self.line or bytearray(), self.size
        self.line, self.size = None, 0
        if self.kept + size <= MAX_SHOWN_BYTES:
            self.shown.append(bytes(line))
            self.kept += size
        elif not self.shown:  # a line longer than a reply: its start, and its size
            self.shown.append(bytes(line))
            self.cut = size
            self.done = True
        else:
            self.done = True  # the next reply starts with it
        self.done = self.done or len(self.shown) >= self.limit

    @property
    def total(self) -> int:
        """The file's lines (a last line without a newline counts)."""
        return self.newlines + (1 if self.ends_open else 0)


def scan(sandbox: Sandbox, path: str, window: Window) -> None:
    """Feed the whole file to ``window`` a chunk at a time, checking it is UTF-8 on the way."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    at = 0
    while True:
        chunk = sandbox.files.read_range(path, at, READ_CHUNK)
        last = len(chunk) < READ_CHUNK
        pending = len(decoder.getstate()[0])
        try:
            decoder.decode(chunk, final=last)  # thrown away: read only for the check
        except UnicodeDecodeError as err:  # shown as U+FFFD, the model would take it for the text
            bad = at - pending + err.start
            size = at + len(chunk) + (0 if last else _size_from(sandbox, path, at + len(chunk)))
            raise ToolError(
                f"{path} is not UTF-8 text (byte {bad:,} of {size:,}): a binary file? "
                "look at its bytes with run_code"
            ) from None
        window.feed(chunk)
        at += len(chunk)
        if last:
            window.finish()
            return


def _size_from(sandbox: Sandbox, path: str, at: int) -> int:
    """How many bytes the file has from ``at`` on (read, not kept)."""
    start = at
    while len(chunk := sandbox.files.read_range(path, at, READ_CHUNK)) == READ_CHUNK:
        at += len(chunk)
    return at + len(chunk) - start
