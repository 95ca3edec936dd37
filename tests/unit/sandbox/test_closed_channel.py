"""A call the host's own ``close`` ends (from another thread, or a pool taking its member
back) raises ``SandboxClosed``: ``SandboxCrashed`` says the sandbox died under the call, and a
pipeline counting crashes must not count its own closes. A supervisor that goes away under a
call is still a crash, and a close after that changes nothing."""

from __future__ import annotations

import queue
import threading

import pytest

from stockade import SandboxClosed, SandboxCrashed
from stockade.sandbox._channel import Channel


class Silent:
    """A supervisor that reads every request and answers none, until it ends (``exit``) or
    its stream is closed."""

    def __init__(self) -> None:
        self.replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.sent = threading.Event()

    def send(self, data: bytes, deadline: float | None = None) -> None:
        self.sent.set()

    def recv(self) -> bytes:
        return self.replies.get()

    def exit(self) -> None:
        self.replies.put(b"")

    def close(self) -> None:
        self.replies.put(b"")


def test_a_call_ended_by_the_host_s_close_raises_sandbox_closed() -> None:
    stream = Silent()
    channel = Channel(stream, max_body=1 << 20, name="closed")
    call = channel.call({"op": "exec", "argv": ["sleep", "3"]})
    stream.sent.wait()
    threading.Thread(target=channel.close).start()
    with pytest.raises(SandboxClosed, match="the host closed it"):
        call.result(None)
    with pytest.raises(SandboxClosed):  # and the next call, before anything is sent
        channel.call({"op": "exec", "argv": ["true"]})


def test_a_supervisor_gone_under_a_call_is_a_crash_even_once_closed() -> None:
    stream = Silent()
    channel = Channel(stream, max_body=1 << 20, name="crashed")
    call = channel.call({"op": "exec", "argv": ["sleep", "3"]})
    stream.exit()
    with pytest.raises(SandboxCrashed, match="the supervisor exited"):
        call.result(None)
    channel.close()  # the host's close after the crash
    with pytest.raises(SandboxCrashed, match="the supervisor exited"):
        channel.call({"op": "exec", "argv": ["true"]})
