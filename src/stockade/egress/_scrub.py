"""A credential host's answer on its way back to the code, with no form of the secret in it.

The head's headers and reason scrubbed (``scrubbed_head``), the body decoded if the server
encoded it anyway (``Decoder``, ``reply_decoder``) and scrubbed across chunk borders
(``Scrubber``), the two together as the body comes (``Reply``). Apart from the exchange
(``_http``): what keeps a secret from coming back is read, and tested, on its own.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from typing import Any

from stockade.egress._gate import Forms, Refused, redacted
from stockade.egress._request import HOP_BY_HOP
from stockade.egress._rules import Verdict
from stockade.egress._streams import CHUNK

__all__ = [
    "DECODED",
    "MEMBERS_PER_TURN",
    "Decoder",
    "Reply",
    "Scrubber",
    "reply_decoder",
    "scrubbed_head",
]


class Scrubber:
    """Replaces a secret's forms (``Forms``, in any letter case) in a stream of bytes, across
    chunk borders: the last bytes of a chunk, which may begin a form the next one ends, wait
    for it as they came (looked at again with it, never a second time once replaced)."""

    def __init__(self, forms: Forms) -> None:
        self.forms = forms
        self.keep = max(forms.longest - 1, 0)
        self.tail = b""

    def feed(self, data: bytes) -> bytes:
        data = self.tail + data
        runs = self.forms.runs(data)
        cut = max(len(data) - self.keep, 0)  # a form that begins before it ends in ``data``
        for start, end in runs:
            if start < cut < end:  # a run the cut would split goes whole
                cut = end
        self.tail = data[cut:]
        return redacted(data[:cut], [run for run in runs if run[1] <= cut])

    def end(self) -> bytes:
        data, self.tail = self.tail, b""
        return self.forms.scrub(data)


DECODED = frozenset(("gzip", "x-gzip", "deflate"))  # codings undone to scrub a credential host's reply
# The gzip members one ``Decoder.feed`` starts before it gives the loop a turn: each is a new
# decompressor, ~1 µs, and a read of 256 KiB holds 13,000 empty ones (a body anyone may
# upload to a credential's host, an object store, and ask for back).
MEMBERS_PER_TURN = 256
# What of a read a decompressor is given at once: at a member's end it copies what is left
# (``unused_data``), so a read of many members cost its size once a member (50 ms, 15 so).
DECODER_INPUT = 16 * 1024


class Decoder:
    """Undoes a ``Content-Encoding`` (gzip, deflate) as the body comes, in pieces of at most
    ``CHUNK``: a credential host's reply the proxy must read to scrub (it asked for none).
    Every byte of the body is decoded or the reply cut (``ConnectionError``), none dropped:
    gzip members one after another (RFC 1952, 2.2; the zeros some pad with between them
    skipped, as Python's ``gzip`` does) are each decoded, where only the first was before;
    bytes after a deflate stream's end are an error. An empty piece is the loop's turn for
    the others (``MEMBERS_PER_TURN``)."""

    def __init__(self, coding: str) -> None:
        self.deflate = coding == "deflate"
        self.started = False
        self.members = 0
        self.wbits = zlib.MAX_WBITS | (16 if not self.deflate else 0)
        self.obj = zlib.decompressobj(self.wbits)

    def feed(self, data: bytes) -> Iterator[bytes]:
        if self.deflate and not self.started and data:
            self.started = True
            if data[0] & 0x0F != 8:  # "deflate" is zlib-wrapped (RFC 9110, 8.4.1.2); some send it raw
                self.obj = zlib.decompressobj(-zlib.MAX_WBITS)
        try:
            for at in range(0, len(data), DECODER_INPUT):
                yield from self._inflate(data[at : at + DECODER_INPUT])
        except zlib.error:
            raise ConnectionError("a compressed reply that does not decompress") from None

    def _inflate(self, data: bytes) -> Iterator[bytes]:
        while data:
            if self.obj.eof:  # a member ended, and bytes follow it
                if self.deflate:
                    raise ConnectionError("a compressed reply with bytes after its end")
                data = data.lstrip(b"\0")
                if not data:
                    return
                self.obj = zlib.decompressobj(self.wbits)
                self.members += 1
                if self.members % MEMBERS_PER_TURN == 0:
                    yield b""
            piece = self.obj.decompress(data, CHUNK)
            data = self.obj.unconsumed_tail or self.obj.unused_data
            if piece:
                yield piece

    def end(self) -> bytes:
        try:
            return self.obj.flush()
        except zlib.error:
            raise ConnectionError("a compressed reply that does not decompress") from None


class Reply:
    """What a credential host's reply body becomes on its way to the code: decoded if the
    server encoded it anyway, then scrubbed of the secret's forms; decoded bytes count
    against the sandbox's bytes per minute (``spend``), so a compression bomb is a ``429``."""

    def __init__(self, scrubber: Scrubber, decoder: Decoder | None, spend: Callable[[int], None]) -> None:
        self.scrubber = scrubber
        self.decoder = decoder
        self.spend = spend

    def feed(self, data: bytes) -> Iterator[bytes]:
        """What goes to the code of ``data``, in pieces; an empty one is a turn for the others."""
        if self.decoder is None:
            if scrubbed := self.scrubber.feed(data):
                yield scrubbed
            return
        for piece in self.decoder.feed(data):
            if not piece:
                yield piece
                continue
            self.spend(len(piece))
            if scrubbed := self.scrubber.feed(piece):
                yield scrubbed

    def end(self) -> bytes:
        rest = b""
        if self.decoder is not None:
            rest = self.decoder.end()
            self.spend(len(rest))
        return self.scrubber.feed(rest) + self.scrubber.end()


def reply_decoder(headers: Any, host: str) -> Decoder | None:
    """How to undo a credential host's ``Content-Encoding`` (the proxy asked for none:
    compressed, the secret would pass the scrub): every coding it names, in every such
    header (a list, or the header twice: a client applies them all), ``identity`` aside.
    ``Refused`` (``502``) unless that is none or one the proxy undoes: two codings (even
    gzip twice) are refused, not undone in turn."""
    codings = [
        coding.strip().lower()
        for key, value in headers if key.lower() == b"content-encoding"
        for coding in bytes(value).decode("latin-1").split(",")
    ]  # fmt: skip
    codings = [c for c in codings if c not in ("", "identity")]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in DECODED:  # named, not quoted: a server may echo there
        raise Refused(502, Verdict(
            allowed=False, rule="reply (encoding)",
            reason=f"{host} answered in a Content-Encoding other than one gzip or deflate: not scrubbable",
        ))  # fmt: skip
    return Decoder(codings[0])


def scrubbed_head(headers: Any, reason: bytes, forms: Forms) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """A credential host's answer head for the code: its headers (but those the proxy frames
    itself) and its reason (a server can put anything there too) without the secret's forms,
    in any letter case. A name cannot hold "[REDACTED]" (no token): a header whose name holds
    a form goes. One scan of all the values and one of all the names (h11 allows no line end
    in either), not one per header (10,000 one-byte values and 18 forms: 9 ms of the loop,
    0.6 ms so). A folded value never gets here (``answer_head``)."""
    kept = [
        (bytes(k), bytes(v)) for k, v in headers
        if k not in HOP_BY_HOP and k not in (b"content-length", b"content-encoding")
    ]  # fmt: skip
    if forms.holds(b"\n".join(k for k, _ in kept)):
        kept = [(k, v) for k, v in kept if not forms.holds(k)]
    joined = b"\n".join([*(v for _, v in kept), bytes(reason)])
    *values, said = forms.scrub(joined).split(b"\n")
    return [(k, v) for (k, _), v in zip(kept, values, strict=True)], said
