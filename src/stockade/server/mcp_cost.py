"""What a JSON-RPC message costs the MCP server once parsed, told from its bytes before it is.

Parsed, a message takes far more than its bytes when they spell many small values: a 4 MiB
line of ``[{},{},...]`` became 96 MiB of Python objects (192 MiB at the peak of its parse),
and bounds counted in raw bytes let a client that read no answers hold 16 of them (1.9 GB).
Measured through the SDK's parser, a value takes at most 96 bytes held (a one-key object in
an array, 7 bytes of JSON) and a string about its own bytes: ``message_cost`` counts the
bytes plus ``VALUE_BYTES`` for each value, outside strings, without parsing anything. Both
transports bound what they hold by it, and refuse a message that alone costs more than
``MAX_MESSAGE_COST``, never handing it to the parser.
"""

from __future__ import annotations

__all__ = ["MAX_MESSAGE_COST", "VALUE_BYTES", "message_cost", "too_costly"]

# A parsed JSON value's bytes at most (96 measured), with room for another Python's objects
VALUE_BYTES = 128
# One message parsed at most: 4 MiB of strings, or about a quarter of a million values (a
# call's arguments, at most 256 KiB, take half of it at worst). Over HTTP a body counts its
# bytes besides (``mcp_http``): one alone always fits the bodies held at once, 64 MiB.
MAX_MESSAGE_COST = 32 << 20


def message_cost(data: bytes) -> int:
    """The bytes ``data``, a JSON text, is taken to hold once parsed: its own, and
    ``VALUE_BYTES`` for each value in it (an upper bound: an empty array or object counts one
    too many). Only the structure's commas and brackets are counted, not those in strings:
    escaped quotes and backslashes are cut out first, then each piece between two quotes is
    in a string or out of one, in turn. In pieces of ``_SCAN_BYTES``, so that a text of many
    tiny strings never holds many pieces at once (a regular expression's ``sub`` held 237 MiB
    for 4 MiB of ``"",``); 4 MiB take ~40 ms."""
    plain = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    values, inside = 1, False
    for start in range(0, len(plain), _SCAN_BYTES):
        pieces = plain[start : start + _SCAN_BYTES].split(b'"')
        outside = b"".join(pieces[1 if inside else 0 :: 2])
        values += outside.count(b",") + outside.count(b"[") + outside.count(b"{")
        inside = inside != (len(pieces) % 2 == 0)  # an odd count of quotes flips it
    return len(data) + VALUE_BYTES * values


_SCAN_BYTES = 64 * 1024


def too_costly(cost: int) -> str | None:
    """Why a message of ``cost`` is refused, or None when it is not."""
    if cost <= MAX_MESSAGE_COST:
        return None
    return (
        f"the client sent a message that would take ~{cost >> 20} MiB parsed (a JSON value takes "
        f"~{VALUE_BYTES} bytes, a string its length): at most {MAX_MESSAGE_COST >> 20} MiB"
    )
