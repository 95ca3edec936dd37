"""The framed protocol spoken over pipes between the host and the in-sandbox supervisor.

A frame is two big-endian u32 lengths (header, body), a UTF-8 JSON object, then raw bytes.
Raw bodies carry file contents and output chunks untouched (no base64, no UTF-8 assumption).
Standard library only: this module runs inside the sandbox too.
"""

from __future__ import annotations

import json
import struct
from typing import Any

PREFIX = struct.Struct(">II")
MAX_HEADER = 1 << 20


class FrameError(Exception):
    pass


def encode(header: dict[str, Any], body: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return PREFIX.pack(len(head), len(body)) + head + body


class FrameReader:
    """Incremental decoder: feed bytes, take complete frames.

    ``max_body`` bounds what a peer may make us buffer; a larger frame is a protocol error
    (the host never trusts the supervisor, which lives with the untrusted code).
    """

    def __init__(self, max_body: int) -> None:
        self._buf = bytearray()
        self._max_body = max_body

    def feed(self, data: bytes) -> None:
        self._buf += data

    def frames(self) -> list[tuple[dict[str, Any], bytes]]:
        out: list[tuple[dict[str, Any], bytes]] = []
        while len(self._buf) >= PREFIX.size:
            hlen, blen = PREFIX.unpack_from(self._buf)
            if hlen > MAX_HEADER or blen > self._max_body:
                raise FrameError(f"frame too large (header {hlen}, body {blen})")
            end = PREFIX.size + hlen + blen
            if len(self._buf) < end:
                break
            try:
                header = json.loads(bytes(self._buf[PREFIX.size : PREFIX.size + hlen]))
            except ValueError as exc:
                raise FrameError(f"bad frame header: {exc}") from None
            if not isinstance(header, dict):
                raise FrameError("frame header is not an object")
            body = bytes(self._buf[PREFIX.size + hlen : end])
            del self._buf[:end]
            out.append((header, body))
        return out
