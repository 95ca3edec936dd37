"""One ``bytes`` gathered from pieces without a second copy of it.

Keeping the pieces and joining them at the end (``b"".join``) holds them and the joined copy
at once: twice the result, for as long as the join takes. Here each piece is copied into one
buffer as it arrives, and that buffer becomes the result: CPython's ``BytesIO.getvalue`` hands
over the ``bytes`` it fills, not a copy, when nothing else holds it (elsewhere it copies:
the same result, at twice the memory for a moment).
"""

from __future__ import annotations

import io

__all__ = ["Gathered"]


class Gathered:
    """Bytes added piece by piece (``add``), then taken whole (``take``), once."""

    def __init__(self, expected: int) -> None:
        """``expected``: the size announced, which may be wrong. The buffer is set aside for it
        up front, so that it is filled in place rather than grown; ``bytes(n)`` comes zeroed
        from the allocator, whose pages cost memory only once written: a size too large costs
        address space (the caller bounds it), one too small a growth, and neither a wrong
        result."""
        self._buffer = io.BytesIO(bytes(max(expected, 0)))
        self.size = 0

    def add(self, piece: bytes) -> None:
        self._buffer.write(piece)
        self.size += len(piece)

    def take(self) -> bytes:
        """What was added, in order; what was set aside past it is let go (a shorter file)."""
        self._buffer.truncate(self.size)
        data = self._buffer.getvalue()
        self._buffer.close()
        return data
