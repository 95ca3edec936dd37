"""What a JSON-RPC message is taken to cost parsed: its bytes, and a price for each value,
counted outside strings whatever the strings hold."""

from __future__ import annotations

import json
import sys

import pytest

from stockade.server.mcp_cost import VALUE_BYTES, message_cost

# (JSON text, values counted: an empty array or object counts one too many)
SHAPES = [
    ("0", 1),
    ('"a string, with [commas] and {brackets}"', 1),
    ("[1,2,3]", 4),
    ('{"a":1,"b":[]}', 4),
    ('["quote \\" then, a comma", "a backslash \\\\", ",[{"]', 4),
    ('{"k":"\\\\\\"},{"}', 2),  # an escaped backslash, then an escaped quote: still in the string
]


@pytest.mark.parametrize(("text", "values"), SHAPES)
def test_values_are_counted_outside_strings(text: str, values: int) -> None:
    json.loads(text)  # each is JSON
    data = text.encode()
    assert message_cost(data) == len(data) + VALUE_BYTES * values


def test_strings_across_the_scans_pieces_are_told_apart() -> None:
    """The text is scanned in pieces: a string that spans two is still a string."""
    text = json.dumps(["x," * 70_000, [{}, {}], "y" * 100_000 + '"{,', {"z": 0}]).encode()
    # 1, and its 4 commas, 2 arrays and 3 objects: the strings hold 70,000 commas more
    assert message_cost(text) == len(text) + VALUE_BYTES * (1 + 4 + 2 + 3)


def test_many_small_values_cost_far_more_than_their_bytes() -> None:
    junk = json.dumps({"junk": [{}] * 100_000}).encode()
    assert message_cost(junk) > 50 * len(junk)
    text = json.dumps({"content": "x" * 1_000_000}).encode()
    assert message_cost(text) < len(text) + 10 * VALUE_BYTES


@pytest.mark.parametrize("wide", ["😀", "€", "é"], ids=["past-U+FFFF", "past-U+00FF", "latin-1"])
@pytest.mark.parametrize("ascii_only", [True, False], ids=["escaped", "utf-8"])
def test_one_wide_character_widens_the_whole_string(wide: str, ascii_only: bool) -> None:
    """Found from outside: CPython stores a string at its widest character's width, and the
    cost counted a string's JSON bytes: one emoji in 4 MiB of ASCII (raw, or escaped as
    ``\\ud83d\\ude00``) made it 16 MiB parsed, counted 4. The estimate is at least what the
    parsed string takes."""
    text = json.dumps({"content": "x" * 1_000_000 + wide}, ensure_ascii=ascii_only).encode()
    parsed = json.loads(text)["content"]
    assert message_cost(text) >= sys.getsizeof(parsed)


def test_escaped_ascii_is_not_wide() -> None:
    text = json.dumps({"content": "x" * 1_000_000 + "\x05\x7f"}).encode()
    assert b"\\u0005" in text and message_cost(text) < 2 * len(text)
