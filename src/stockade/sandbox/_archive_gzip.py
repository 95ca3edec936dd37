"""A gzipped tar into an extraction as it arrives, a bounded piece at a time.

Apart from the extraction because it knows nothing of tar: it turns a stream that may be
gzip (a run's artifacts fetched from the service, a seed) into the plain bytes ``Extraction.feed``
takes, never holding more than a piece of what a small stream inflates to.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

from stockade.sandbox._tar import malformed

__all__ = ["Inflated"]


class Inflated:
    """A gzipped tar (a run's artifacts, a seed; a plain tar is taken too) into ``feed``
    (``Extraction.feed``) as it arrives, a bounded piece at a time: a few hundred KiB of gzip
    that inflate to a gigabyte stop at the extraction's ``max_bytes``, never held in memory."""

    PIECE = 1 << 20

    def __init__(self, feed: Callable[[bytes], None]) -> None:
        self._feed = feed
        self._head = b""
        self._inflate: Any = None  # zlib's decompressor, once the stream is known to be gzip
        self._plain = False

    def feed(self, data: bytes) -> None:
        if not self._plain and self._inflate is None:
            self._head += data
            if len(self._head) < 2:
                return
            data, self._head = self._head, b""
            if data[:2] == b"\x1f\x8b":
                self._inflate = zlib.decompressobj(wbits=31)
            else:
                self._plain = True
        if self._inflate is None:
            self._feed(data)
            return
        try:
            while data:
                if self._inflate.eof:
                    raise malformed("data past the end of the gzip stream")
                out = self._inflate.decompress(data, self.PIECE)
                if out:
                    self._feed(out)
                data = self._inflate.unconsumed_tail or self._inflate.unused_data
        except zlib.error as error:
            raise malformed(f"a broken gzip stream ({error})") from None

    def finish(self) -> None:
        if self._head:
            self._feed(self._head)
        if self._inflate is not None:
            try:
                rest = self._inflate.flush()  # what zlib held back: less than its window
            except zlib.error as error:
                raise malformed(f"a broken gzip stream ({error})") from None
            if rest:
                self._feed(rest)
            if not self._inflate.eof:
                raise malformed("the gzip stream is cut short")
