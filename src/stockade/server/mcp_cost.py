"""What a JSON-RPC message costs the MCP server once parsed, told from its bytes before it is.

Parsed, a message takes far more than its bytes when they spell many small values: a 4 MiB
line of ``[{},{},...]`` became 96 MiB of Python objects (192 MiB at the peak of its parse),
and bounds counted in raw bytes let a client that read no answers hold 16 of them (1.9 GB).
Measured through the SDK's parser, a value takes at most 96 bytes held (a one-key object in
an array, 7 bytes of JSON) and a string its characters times the widest one's bytes in
CPython (1 for ASCII and Latin-1, 2 to U+FFFF, 4 past it): one emoji made a 4 MiB string
16 MiB. ``message_cost`` counts the bytes, strings' at that width, plus ``VALUE_BYTES`` for
each value outside strings, without parsing anything. Both transports bound what they hold
by it, and refuse a message that alone costs more than ``MAX_MESSAGE_COST``, never handing it
to the parser.
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
    """The bytes ``data``, a JSON text, is taken to hold once parsed: its own, its strings'
    times ``char_width``, and ``VALUE_BYTES`` for each value in it (an upper bound: an empty
    array or object counts one too many). Only the structure's commas and brackets are
    counted, not those in strings: escaped quotes and backslashes are cut out first, then each
    piece between two quotes is in a string or out of one, in turn. In pieces of
    ``_SCAN_BYTES``, so that a text of many tiny strings never holds many pieces at once (a
    regular expression's ``sub`` held 237 MiB for 4 MiB of ``"",``); 4 MiB take ~40 ms."""
    plain = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    values, inside, structure = 1, False, 0
    for start in range(0, len(plain), _SCAN_BYTES):
        pieces = plain[start : start + _SCAN_BYTES].split(b'"')
        outside = b"".join(pieces[1 if inside else 0 :: 2])
        structure += len(outside)
        values += outside.count(b",") + outside.count(b"[") + outside.count(b"{")
        inside = inside != (len(pieces) % 2 == 0)  # an odd count of quotes flips it
    # the strings' bytes, with their quotes and escapes: one character at most each
    strings = len(data) - structure
    return len(data) + (char_width(plain) - 1) * strings + VALUE_BYTES * values


def char_width(plain: bytes) -> int:
    """The bytes a character of the strings of ``plain`` (a JSON text, its escaped backslashes
    cut out) takes parsed, at most: CPython stores a string at its widest character's width,
    so one character past U+FFFF (4 bytes of UTF-8, or two escaped surrogates, 12 bytes of
    ASCII) makes every other one 4 bytes: 40 lines of 4 MiB, one emoji each, held 680 MB
    where ASCII held 236. For the whole message, not each string (told apart one by one, a
    message's maybe million strings take a step of Python each): an upper bound, its ASCII
    at most 4 times. Any other non-ASCII character counts 2 (Latin-1 takes 1 byte, its UTF-8
    2, kept beside it once asked for)."""
    if plain.isascii() and b"\\u" not in plain:
        return 1
    # searched for bytes, not by a regular expression: ~5 times faster
    if any(lead in plain for lead in _ASTRAL_LEADS) or b"\\ud" in plain or b"\\uD" in plain:
        return 4  # a surrogate escaped (a lone one takes 2: counted 4 all the same)
    if not plain.isascii():
        return 2
    escapes = plain.count(b"\\u")
    if escapes > plain.count(b"\\u00") or escapes > sum(plain.count(e) for e in _ASCII_ESCAPES):
        return 2
    return 1


_SCAN_BYTES = 64 * 1024
# UTF-8's lead bytes of a character past U+FFFF (0xF5 and on are no UTF-8: counted as such)
_ASTRAL_LEADS = [bytes((lead,)) for lead in range(0xF0, 0x100)]
# the escapes of ASCII characters (``\\u0000`` to ``\\u007f``)
_ASCII_ESCAPES = [b"\\u00" + bytes((digit,)) for digit in b"01234567"]


def too_costly(cost: int) -> str | None:
    """Why a message of ``cost`` is refused, or None when it is not."""
    if cost <= MAX_MESSAGE_COST:
        return None
    return (
        f"the client sent a message that would take ~{cost >> 20} MiB parsed (a JSON value takes "
        f"~{VALUE_BYTES} bytes, a string its length times its widest character's bytes): at most "
        f"{MAX_MESSAGE_COST >> 20} MiB"
    )
