"""A request whose send is cut short (Ctrl-C, any exception raised into the sending thread)
may leave half a frame on the wire, which the supervisor would join to the next request: the
channel says nothing more, and says why, at once; the interruption goes on to the caller."""

from __future__ import annotations

import queue

import pytest

from stockade import SandboxClosed
from stockade.sandbox._channel import Channel


class HalfSent:
    """A stream whose send writes half its bytes, then is interrupted."""

    def __init__(self) -> None:
        self.wire = bytearray()
        self.replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    def send(self, data: bytes, deadline: float | None = None) -> None:
        self.wire += data[: len(data) // 2]
        raise KeyboardInterrupt

    def recv(self) -> bytes:
        return self.replies.get()

    def close(self) -> None:
        self.replies.put(b"")


def test_a_send_cut_short_leaves_the_channel_closed_and_says_why() -> None:
    stream = HalfSent()
    channel = Channel(stream, max_body=1 << 20, name="cut")
    try:
        with pytest.raises(KeyboardInterrupt):
            channel.call({"op": "write", "path": "big.bin"}, b"x" * 1000)
        assert stream.wire  # half a frame is out there
        assert not channel.open
        sent = len(stream.wire)
        with pytest.raises(
            SandboxClosed, match=r"send of a write request was interrupted \(KeyboardInterrupt\)"
        ):
            channel.call({"op": "exec", "argv": ["true"]})
        assert len(stream.wire) == sent  # nothing more went after the half frame
    finally:
        channel.close()
