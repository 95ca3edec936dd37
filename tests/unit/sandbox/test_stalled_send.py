"""A supervisor that stops reading (frozen, stopped, a guest whose vCPUs never run again)
fills the host's side of its stream: a send into it ends by the call's deadline, and fails
the channel (half a frame may be on the wire), instead of holding the caller for ever."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import pytest

from stockade import SandboxCrashed
from stockade.sandbox._channel import Channel
from stockade.sandbox._host import PipeStream
from stockade.sandbox._microvm_instance import SocketStream

MORE_THAN_BUFFERS = 8 << 20


def test_a_request_larger_than_the_socket_holds_ends_at_its_deadline_when_nothing_reads() -> None:
    ours, theirs = socket.socketpair()  # nothing ever reads ``theirs``
    channel = Channel(SocketStream(ours), max_body=1 << 20, name="wedged")
    try:
        with pytest.raises(TimeoutError):
            channel.call({"op": "write", "path": "big.bin"}, b"x" * MORE_THAN_BUFFERS, time.monotonic() + 0.5)
        assert not channel.open
        with pytest.raises(SandboxCrashed, match="not sent by its deadline"):
            channel.call({"op": "ping"})
    finally:
        channel.close()
        theirs.close()
        ours.close()


def test_a_send_into_a_pipe_nobody_reads_ends_at_its_deadline() -> None:
    sleeper = subprocess.Popen(["sleep", "60"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    stream = PipeStream(sleeper)
    try:
        with pytest.raises(TimeoutError):
            stream.send(b"x" * MORE_THAN_BUFFERS, time.monotonic() + 0.5)
    finally:
        sleeper.kill()
        sleeper.wait()
        stream.close()
        assert sleeper.stdout is not None
        sleeper.stdout.close()


def test_a_send_the_peer_reads_is_whole_however_large() -> None:
    ours, theirs = socket.socketpair()
    stream = SocketStream(ours)
    received = bytearray()
    try:

        def drain() -> None:
            while len(received) < MORE_THAN_BUFFERS:
                received.extend(theirs.recv(1 << 20))

        reader = threading.Thread(target=drain)
        reader.start()
        stream.send(b"y" * MORE_THAN_BUFFERS, time.monotonic() + 60)
        reader.join()
        assert bytes(received) == b"y" * MORE_THAN_BUFFERS
    finally:
        theirs.close()
        ours.close()
