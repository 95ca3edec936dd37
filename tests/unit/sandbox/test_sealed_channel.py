"""Sealed frames (``protocol.Seal``): where code in the sandbox can open the supervisor's
pipes (gVisor's /proc), a frame it writes, replays, reorders or cuts never passes for one the
peer sent. The seal itself, then the host's channel over a supervisor that seals."""

from __future__ import annotations

import os
import queue
import secrets

import pytest

from stockade import SandboxCrashed
from stockade.sandbox._channel import Channel
from stockade.sandbox.supervisor.protocol import PREFIX, FrameError, FrameReader, Seal, encode

KEY = secrets.token_bytes(Seal.SIZE)


def sealed(frames: list[tuple[dict[str, object], bytes]], key: bytes = KEY, count: int = 0) -> list[bytes]:
    seal = Seal(key, b"S", count, head=True)
    return [encode(header, body, seal) for header, body in frames]


def reader(count: int = 0) -> FrameReader:
    r = FrameReader(max_body=1 << 20)
    r.seal = Seal(KEY, b"S", count, head=True)
    return r


def test_sealed_frames_round_trip_whatever_the_chunks() -> None:
    stream = b"".join(sealed([({"id": n, "ev": "out"}, os.urandom(n * 7)) for n in range(1, 6)]))
    r = reader()
    got = []
    for i in range(0, len(stream), 13):  # a pipe hands bytes over in any pieces
        r.feed(stream[i : i + 13])
        got += r.frames()
    assert [h["id"] for h, _ in got] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(lambda f: encode({"id": 1, "ev": "exit", "exit_code": 0}), id="unsealed"),
        pytest.param(lambda f: f[0][:-1] + bytes([f[0][-1] ^ 1]), id="a tag changed"),
        pytest.param(lambda f: f[0][:12] + b"X" + f[0][13:], id="a header changed"),
        pytest.param(lambda f: f[1], id="the second first (reordered or the first dropped)"),
        pytest.param(
            lambda f: sealed([({"id": 1, "ev": "exit"}, b"")], key=secrets.token_bytes(32))[0],
            id="another key",
        ),
        pytest.param(
            lambda f: encode({"id": 1, "ev": "exit"}, b"", Seal(KEY, b"H")), id="the other direction"
        ),
    ],
)
def test_a_frame_the_peer_did_not_send_is_refused(forge: object) -> None:
    genuine = sealed([({"id": 1, "ev": "out"}, b"a"), ({"id": 1, "ev": "exit"}, b"")])
    r = reader()
    r.feed(forge(genuine) + b"".join(genuine))  # type: ignore[operator]  # ahead of the peer's
    with pytest.raises(FrameError, match="seal does not match"):
        r.frames()


def test_a_replayed_frame_is_refused() -> None:
    first, second = sealed([({"id": 1, "ev": "out"}, b"a"), ({"id": 2, "ev": "out"}, b"b")])
    r = reader()
    r.feed(first + second)
    assert len(r.frames()) == 2
    r.feed(first)
    with pytest.raises(FrameError):
        r.frames()


def test_a_forged_prefix_is_refused_before_its_body_is_waited_for() -> None:
    """Code that opened the supervisor's pipe (gVisor's /proc) wrote a prefix saying 128 MiB,
    then the body short of its end: the host held it all, per sandbox, for as long as the
    sandbox lived, since only the whole frame's tag was checked (found from outside). The
    prefix has its own tag: a forged one ends the channel at once, nothing buffered."""
    r = FrameReader(max_body=128 << 20)
    r.seal = Seal(KEY, b"S", head=True)
    r.feed(PREFIX.pack(2, (128 << 20) - 1) + os.urandom(Seal.SIZE) + b"{}")
    with pytest.raises(FrameError, match="prefix's seal"):
        r.frames()
    # a true prefix is waited on as before, and its frame then checked whole
    frame = sealed([({"id": 1, "ev": "out"}, b"x" * 100)])[0]
    r = reader()
    r.feed(frame[: PREFIX.size + Seal.SIZE + 10])
    assert r.frames() == []
    r.feed(frame[PREFIX.size + Seal.SIZE + 10 :])
    assert [h["id"] for h, _ in r.frames()] == [1]


class SealingSupervisor:
    """The supervisor's side over an in-memory stream: answers ``ready``, takes the key the host
    sends, then answers every request sealed; ``forge`` goes in ahead of its answer."""

    def __init__(self) -> None:
        self.replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.requests = FrameReader(max_body=1 << 20)
        self.key = b""
        self.seal: Seal | None = None
        self.forge = b""

    def send(self, data: bytes, deadline: float | None = None) -> None:
        if not self.key:  # the first bytes the host sends here: the key, raw
            self.key = data
            self.seal = Seal(self.key, b"S", head=True)
            self.requests.seal = Seal(self.key, b"H")
            return
        self.requests.feed(data)
        for header, _ in self.requests.frames():
            reply = {"id": header["id"], "ev": "done"}
            self.replies.put(self.forge + encode(reply, b"", self.seal))

    def recv(self) -> bytes:
        return self.replies.get()

    def close(self) -> None:
        self.replies.put(b"")


def test_the_channel_seals_both_ways_and_ends_at_a_forged_frame() -> None:
    supervisor = SealingSupervisor()
    channel = Channel(supervisor, max_body=1 << 20, name="sealed")
    try:
        channel.seal(KEY)
        assert supervisor.key == KEY
        assert channel.call({"op": "stat"}).result(None)[0]["ev"] == "done"
        assert channel.seal_state() == (KEY, 1, 1)
        supervisor.forge = encode({"id": 2, "ev": "done"})  # what code wrote into the pipe
        with pytest.raises(
            SandboxCrashed, match="something in the sandbox wrote to the supervisor's channel"
        ):
            channel.call({"op": "stat"}).result(None)
        assert not channel.open
    finally:
        channel.close()
