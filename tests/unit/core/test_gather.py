"""``Gathered``: what was added, whatever size was announced for it."""

from __future__ import annotations

import pytest

from stockade._gather import Gathered


@pytest.mark.parametrize("expected", [0, 3, 9, 10, 1 << 20, -1])
def test_the_result_is_what_was_added_whatever_was_announced(expected: int) -> None:
    # a size announced right, too large (a file that shrank, a lie), too small (one that grew)
    gathered = Gathered(expected)
    for piece in (b"abc", b"", b"defg", b"hij"):
        gathered.add(piece)
    assert gathered.size == 10
    taken = gathered.take()
    assert taken == b"abcdefghij" and type(taken) is bytes
