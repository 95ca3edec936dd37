"""The framed protocol spoken over pipes between the host and the in-sandbox supervisor.

A frame is two big-endian u32 lengths (header, body), a UTF-8 JSON object, then raw bytes.
Raw bodies carry file contents and output chunks untouched (no base64, no UTF-8 assumption).
Standard library only: this module runs inside the sandbox too.
"""

from __future__ import annotations

import struct
import sys

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Callable, Optional

PREFIX = struct.Struct(">II")
MAX_HEADER = 1 << 20

# What one run_code report may hold. The interpreter keeps to it (results and error texts
# up to the run's ``cap``, the sandbox's output_bytes, and never past MAX_CODE_REPORT bytes of
# JSON) and the host enforces it before parsing: code in the sandbox can write to the
# interpreter's reply pipe, so a report is as untrusted as the code. The supervisor passes on
# no report past its cap and CODE_REPORT_MARKS (the error's name, the marks of what was cut).
MAX_CODE_REPLY = 128 << 20
MAX_CODE_REPORT = 96 << 20
CODE_REPORT_MARKS = 64 << 10
MAX_RESULT_COUNT = 10_000  # results of one run (a display() loop can make millions)
# Characters the interpreter keeps of a result's text (text/plain: its head, an ellipsis, then
# notes of what was dropped) and of an error's value and traceback (its end); of an error's
# name; of any other MIME value (a larger one is dropped with a note). The host holds a report
# to them too (sandbox/_replies.py): a report code wrote carried 96 MiB of text.
MAX_TEXT = 1 << 20
MAX_NAME = 1000
MAX_VALUE = 32 << 20
MAX_RESULT_ENTRIES = 20_000  # MIME entries over all the results of one run
MAX_BUNDLE_ENTRIES = 64  # MIME entries of one result

# The JSON of a listing (supervisor/files.py) at most: ASCII, so that at any width its text
# (``text_size``) stays within the host's cap on a frame, MAX_CODE_REPLY. A larger one is
# refused (``ListingTooLarge``): 65,521 entries of 4 KB paths made a frame of 268 MB.
MAX_LIST_JSON = 32 << 20

# The execs a command's final frame reports (supervisor/execrecords.py): at most this many records, each
# {path, argv, verdict, rule} with at most MAX_EXEC_ARGV arguments. The host's bound on the
# values of a header (sandbox/_channel.py) is made from these. A record keeps at most
# MAX_EXEC_WORD characters of a word and MAX_EXEC_RECORD_ARGV of its argv (a word cut is
# its head and a mark naming how much more and its SHA-256), and a report's records take at
# most MAX_EXEC_REPORT bytes of JSON and of text (``text_size``: its characters at their
# width), so that a report always fits a header: 600 execs of one 2,000-byte word each made
# 1.2 MB of records, over MAX_HEADER, and the host ended the sandbox. Past it, counted.
MAX_EXEC_RECORDS = 1000
MAX_EXEC_ARGV = 64
MAX_EXEC_WORD = 4096
MAX_EXEC_RECORD_ARGV = 32 << 10
MAX_EXEC_REPORT = 768 << 10


class FrameError(Exception):
    pass


try:  # the C halves of json: the json package imports re and enum, slow to start
    import _json

    class _Context:
        strict = True
        object_hook = None
        object_pairs_hook = None
        parse_float = float
        parse_int = int
        parse_constant = None
        memo: "dict[Any, Any]" = {}  # noqa: RUF012 - the scanner reads it, never mutates

    _scan = _json.make_scanner(_Context())
    _encode = _json.make_encoder(
        None, None, _json.encode_basestring_ascii, None, ":", ",", False, False, False
    )

    def dumps(obj: "Any") -> str:
        return "".join(_encode(obj, 0))

    def loads(text: str) -> "Any":
        value, end = _scan(text, 0)
        if end != len(text):
            raise ValueError("extra data after the JSON value")
        return value

except ImportError:  # pragma: no cover - a Python built without the accelerator
    import json

    def dumps(obj: "Any") -> str:
        return json.dumps(obj, separators=(",", ":"))

    def loads(text: str) -> "Any":
        return json.loads(text)


def text_width(raw: bytes) -> int:
    """The bytes a character of the text parsed from ``raw`` (JSON, ASCII with every other
    character escaped) may take in Python: a string is held at the width of its widest
    character, so an escape past U+00FF makes it two bytes a character, and one past U+FFFF
    (a surrogate pair) four: 100 MB of JSON with one emoji in it is 400 MB of text. Every
    ``\\u`` is counted as an escape (an escaped backslash before a ``u`` too: more, never
    less). Regular expressions: C's speed over any length (imported here only, when a large
    report calls for it)."""
    if b"\\u" not in raw:
        return 1
    import re

    if re.search(rb"\\u[dD][89abAB]", raw):
        return 4
    return 2 if re.search(rb"\\u(?:0[1-9a-fA-F]|[1-9a-fA-F])", raw) else 1


def text_size(raw: bytes) -> "tuple[int, int]":
    """At most how many characters the text parsed from ``raw`` has (one a byte of JSON, one
    an escape of six), and their width (``text_width``): JSON joined of parts has the sum of
    their characters at the widest of their widths. Escapes are undercounted, never over: a
    ``\\u`` after an escaped backslash (``\\\\u``, a backslash and a "u") is not one, and
    counting it would let a report of them pass for less text than it makes."""
    escapes = raw.count(b"\\u") - raw.count(b"\\\\u")
    return max(0, len(raw) - 5 * escapes), text_width(raw)


def text_bytes(raw: bytes) -> int:
    """At most how many bytes the text parsed from ``raw`` takes (``text_size``: its
    characters at their width): what a cap on a report bounds, not its bytes of JSON."""
    chars, width = text_size(raw)
    return chars * width


def over_cap(raw: bytes, cap: int) -> bool:
    """Whether the JSON ``raw``, or the text parsed from it, takes more than ``cap`` bytes."""
    return len(raw) > cap or (len(raw) * 4 > cap and text_bytes(raw) > cap)


# The seal's MACs (``Seal.mac``): keyed BLAKE2b-256 where the sandbox's Python has CPython's
# own BLAKE2 (``best_mac``), HMAC-SHA256 elsewhere; the supervisor names its own in ``ready``.
BLAKE2B = "blake2b"
HMAC_SHA256 = "hmac-sha256"
MACS = (BLAKE2B, HMAC_SHA256)


def best_mac() -> str:
    """The MAC this Python seals with. Keyed BLAKE2b is built in (``_blake2``: no library to
    load), where HMAC-SHA256's import of OpenSSL (``_hashlib``, with hashlib, hmac and
    warnings) took 13-38 ms of the first ``run_code`` on gVisor, on its critical path (the
    supervisor checks the first sealed request). Only up to 3.13, whose BLAKE2 object zeroes
    its state (key-derived) when freed, as OpenSSL's HMAC does: 3.14's HACL* one is not
    known to."""
    if sys.version_info >= (3, 14):
        return HMAC_SHA256
    try:
        import _blake2  # noqa: F401
    except ImportError:
        return HMAC_SHA256
    return BLAKE2B


class Seal:
    """Frames authenticated one way (``direction``), for a peer that shares ``key``.

    Where code in the sandbox can reach the supervisor's end of the channel (gVisor's
    ``/proc/<pid>/fd`` ignores the non-dumpable flag that keeps it out on Linux: code opened
    the supervisor's pipes and wrote frames of its own to the host), each frame carries a
    tag under a key of 32 random bytes, over the direction, the frame's number in it, and the
    frame: keyed BLAKE2b-256 of them (``mac``), or HMAC-SHA256 of them with the SHA-256 of the
    frame. A frame that code wrote, replayed, dropped or reordered fails the check, and the
    host ends the sandbox. The key lives where code cannot read it: in the host's memory, and
    in the supervisor's (unreadable to code there too) in a mapping that forks leave out
    (``MADV_DONTFORK``: no zygote, interpreter or shim has it), read from the pipe straight
    into that mapping and only ever handed to the C halves of blake2 or hmac, so that no copy
    of it lies in a Python heap a fork would carry."""

    SIZE = 32

    def __init__(
        self, key: "Any", direction: bytes, count: int = 0, head: bool = False, mac: str = HMAC_SHA256
    ) -> None:
        if mac not in MACS:
            raise ValueError(f"unknown seal {mac!r}")
        self.key = key  # bytes on the host; a view of the mapping in the sandbox
        self.direction = direction
        self.count = count
        self.mac = mac
        # ``head``: each frame's prefix carries a tag of its own too (``head_tag``), checked
        # before its body is waited for: code that wrote a prefix of 128 MiB to the host made
        # it hold that much per sandbox before the frame's tag was checked (found from outside).
        # The supervisor's frames to the host carry it; the host's to it need not (what code
        # makes the supervisor hold is its own sandbox's memory).
        self.head = head

    def head_tag(self, prefix: "Any") -> bytes:
        """The tag of the next frame's prefix (the frame's own tag still covers it)."""
        if self.mac == BLAKE2B:
            return self._blake2(b"stockade-head", prefix)
        import hmac

        return hmac.digest(
            self.key, self.direction + b"head" + self.count.to_bytes(8, "big") + prefix, "sha256"
        )

    def tag(self, frame: "Any") -> bytes:
        if self.mac == BLAKE2B:
            tag = self._blake2(b"stockade-frame", frame)
            self.count += 1
            return tag
        import hashlib
        import hmac

        digest = hashlib.sha256(frame).digest()
        tag = hmac.digest(self.key, self.direction + self.count.to_bytes(8, "big") + digest, "sha256")
        self.count += 1
        return tag

    def _blake2(self, person: bytes, data: "Any") -> bytes:
        """Keyed BLAKE2b-256 over the direction, the count and ``data`` (streamed: a large
        frame is not copied), ``person`` telling a prefix's tag from a frame's."""
        import _blake2

        mac = _blake2.blake2b(key=self.key, digest_size=Seal.SIZE, person=person)
        mac.update(self.direction + self.count.to_bytes(8, "big"))
        mac.update(data)
        return mac.digest()

    def check(self, frame: "Any", tag: bytes) -> bool:
        return self.matches(self.tag(frame), tag)

    @staticmethod
    def matches(tag: bytes, given: bytes) -> bool:
        """In constant time (hmac's compare_digest, without importing hmac)."""
        from _operator import _compare_digest

        return _compare_digest(tag, given)


def encode(header: "dict[str, Any]", body: bytes = b"", seal: "Optional[Seal]" = None) -> bytes:
    head = dumps(header).encode()
    prefix = PREFIX.pack(len(head), len(body))
    if seal is not None and seal.head:
        prefix += seal.head_tag(prefix)
    frame = prefix + head + body
    return frame + seal.tag(frame) if seal is not None else frame


class FrameReader:
    """Incremental decoder: feed bytes, take complete frames.

    ``max_body`` bounds what a peer may make us buffer; a larger frame is a protocol error
    (the host never trusts the supervisor, which lives with the untrusted code).
    """

    def __init__(self, max_body: int, parse_header: "Optional[Callable[[bytes], Any]]" = None) -> None:
        self._buf = bytearray()
        self._max_body = max_body
        # The host parses headers with its own bounds on their structure; it may raise ValueError.
        self._parse_header = parse_header
        self.seal: "Optional[Seal]" = None  # set: every frame from here on carries its tag
        self._head_checked = False  # the prefix of the frame being read passed its seal

    def feed(self, data: "bytes | memoryview") -> None:
        self._buf += data

    def take_pending(self) -> bytes:
        """The bytes of frames not yet complete; the reader forgets them."""
        data = bytes(self._buf)
        self._buf.clear()
        self._head_checked = False
        return data

    def frames(self) -> "list[tuple[dict[str, Any], bytes]]":
        out: "list[tuple[dict[str, Any], bytes]]" = []
        while len(self._buf) >= PREFIX.size:
            hlen, blen = PREFIX.unpack_from(self._buf)
            start = PREFIX.size
            if self.seal is not None and self.seal.head:
                start += Seal.SIZE
                if len(self._buf) < start:
                    break
                if not self._head_checked:  # once per frame, not at every chunk of its body
                    tag = self.seal.head_tag(bytes(self._buf[: PREFIX.size]))
                    if not self.seal.matches(tag, bytes(self._buf[PREFIX.size : start])):
                        raise FrameError("a frame its peer did not send (its prefix's seal does not match)")
                    self._head_checked = True
            if hlen > MAX_HEADER or blen > self._max_body:
                raise FrameError(f"frame too large (header {hlen}, body {blen})")
            end = start + hlen + blen
            sealed = end + (Seal.SIZE if self.seal is not None else 0)
            if len(self._buf) < sealed:
                break
            with memoryview(self._buf) as view:  # one copy of a large body, not two
                if self.seal is not None and not self.seal.check(view[:end], bytes(view[end:sealed])):
                    raise FrameError("a frame its peer did not send (its seal does not match)")
                raw = bytes(view[start : start + hlen])
                body = bytes(view[start + hlen : end])
            try:
                header = self._parse_header(raw) if self._parse_header else loads(raw.decode())
            except (ValueError, StopIteration, UnicodeDecodeError, RecursionError) as exc:
                raise FrameError(f"bad frame header: {exc}") from None
            if not isinstance(header, dict):
                raise FrameError("frame header is not an object")
            del self._buf[:sealed]
            self._head_checked = False
            out.append((header, body))
        return out
