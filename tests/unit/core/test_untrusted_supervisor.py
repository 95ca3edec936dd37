"""The host never trusts what the in-sandbox supervisor says (it lives with the code)."""

from __future__ import annotations

import queue
import time

import pytest

from stockade import ProtocolError, SandboxCrashed
from stockade.sandbox._channel import Channel
from stockade.sandbox.kernel.protocol import PREFIX, FrameError, FrameReader, encode


class FakeStream:
    """A supervisor that answers with whatever the test scripts."""

    def __init__(self) -> None:
        self.incoming: queue.Queue[bytes] = queue.Queue()
        self.sent: list[bytes] = []

    def recv(self) -> bytes:
        return self.incoming.get()

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def close(self) -> None:
        self.incoming.put(b"")


def test_frames_round_trip_including_raw_bodies() -> None:
    reader = FrameReader(max_body=1024)
    body = bytes(range(256))
    reader.feed(encode({"id": 1, "name": "é\udcff"}, body)[:5])
    assert reader.frames() == []
    reader.feed(encode({"id": 1, "name": "é\udcff"}, body)[5:])
    [(header, got)] = reader.frames()
    assert header["id"] == 1 and got == body


@pytest.mark.parametrize(
    "evil",
    [
        PREFIX.pack(10, (1 << 32) - 1),  # a body larger than anything we accept
        PREFIX.pack(1 << 30, 0),  # a header larger than anything we accept
        PREFIX.pack(3, 0) + b"{{{",  # not JSON
        PREFIX.pack(2, 0) + b"[]",  # JSON, but not an object
        PREFIX.pack(4, 0) + b"\xff\xfe{}",  # not UTF-8
    ],
)
def test_malformed_frames_are_protocol_errors(evil: bytes) -> None:
    reader = FrameReader(max_body=1 << 20)
    reader.feed(evil)
    with pytest.raises(FrameError):
        reader.frames()


def test_a_lying_supervisor_kills_the_channel_not_the_host() -> None:
    stream = FakeStream()
    channel = Channel(stream, max_body=1024, name="test")
    call = channel.call({"op": "ping"})
    stream.incoming.put(PREFIX.pack(10, 1 << 30))  # claims a 1 GiB body
    with pytest.raises(SandboxCrashed, match="protocol violation"):
        call.result(time.monotonic() + 5)
    assert not channel.open
    with pytest.raises(SandboxCrashed):
        channel.call({"op": "ping"})


def test_frames_for_unknown_requests_are_ignored() -> None:
    stream = FakeStream()
    channel = Channel(stream, max_body=1024, name="test")
    call = channel.call({"op": "ping"})
    stream.incoming.put(encode({"id": 999, "ev": "done"}))  # forged answer to nobody
    stream.incoming.put(encode({"id": call.rid, "ev": "done", "pid": 7}))
    header, _ = call.result(time.monotonic() + 5)
    assert header["pid"] == 7


def test_a_silent_supervisor_times_out() -> None:
    channel = Channel(FakeStream(), max_body=1024, name="test")
    with pytest.raises(TimeoutError):
        channel.call({"op": "ping"}).result(time.monotonic() + 0.05)


def test_protocol_errors_are_not_retryable() -> None:
    assert not ProtocolError.retryable
