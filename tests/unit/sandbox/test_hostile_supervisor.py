"""The host's side of the channel against a supervisor that lies (it lives with the code)."""

from __future__ import annotations

import queue

import pytest

from stockade import ProtocolError
from stockade.sandbox._supervised import TRANSFER_CHUNK, Boundary, SupervisedInstance
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.kernel.protocol import FrameReader, encode
from stockade.sandbox.ops import ReadFile
from stockade.types import Enforcement, Mechanism

NONE = Enforcement(
    memory=Mechanism.NONE, cpus=Mechanism.NONE, pids=Mechanism.NONE,
    disk=Mechanism.NONE, network=Mechanism.NONE, timeout=Mechanism.NONE,
)  # fmt: skip


class EndlessFile:
    """A supervisor that answers every read with a full chunk and claims the file is huge."""

    def __init__(self) -> None:
        self._replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._requests = FrameReader(max_body=1 << 30)

    def send(self, data: bytes) -> None:
        self._requests.feed(data)
        for header, _ in self._requests.frames():
            reply = {"id": header["id"], "ev": "done", "size": 1 << 50}
            self._replies.put(encode(reply, b"\0" * TRANSFER_CHUNK))

    def recv(self) -> bytes:
        return self._replies.get()

    def close(self) -> None:
        self._replies.put(b"")


class Killed(Boundary):
    def __init__(self) -> None:
        self.killed = False

    def kill(self) -> None:
        self.killed = True


def test_a_read_that_never_ends_is_cut_at_the_callers_cap() -> None:
    boundary = Killed()
    instance = SupervisedInstance(
        id="liar", tier="fake", stream=EndlessFile(), boundary=boundary,
        spec=SandboxSpec(), enforcement=NONE,
    )  # fmt: skip
    with pytest.raises(ProtocolError):
        instance.execute(ReadFile(path="big", max_bytes=3 * TRANSFER_CHUNK))
    assert boundary.killed
