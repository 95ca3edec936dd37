"""The supervisor's egress relay on the host, against a socket standing in for the proxy:
it keeps warm connections to the proxy, hands them out oldest first, and forgets those the
proxy closed instead of handing them to the code."""

from __future__ import annotations

import contextlib
import importlib
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.sandbox.supervisor_modules import supervisor_module

# the supervisor's modules are untyped (they run on the sandbox's python): used as Any here
egress: Any = importlib.import_module("stockade.sandbox.supervisor.egress")


class Poller:
    """The part of the supervisor's poller the relay uses, pumped by the test."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.data: dict[int, tuple[Any, Any]] = {}

    def register(self, fd: int, events: int, data: tuple[Any, Any]) -> None:
        self.epoll.register(fd, events)
        self.data[fd] = data

    def modify(self, fd: int, events: int) -> None:
        self.epoll.modify(fd, events)

    def unregister(self, fd: int) -> None:
        del self.data[fd]
        self.epoll.unregister(fd)

    def pump(self, rounds: int = 5) -> None:
        for _ in range(rounds):
            # As the supervisor's Poller: each ready fd's handler is looked up at the poll, and
            # called even if an earlier event of the same batch unregistered the fd (the relay
            # ignores an fd it no longer knows). A look-up per event raised KeyError then.
            ready = [(self.data[fd], fd, ev) for fd, ev in self.epoll.poll(0.02) if fd in self.data]
            for (_, relay), fd, events in ready:
                relay.on_event(fd, events)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[socket.socket]:
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "proxy.sock"))
        server.listen(16)
        server.settimeout(2)
        yield server


def _accepted(server: socket.socket) -> socket.socket:
    conn, _ = server.accept()
    conn.settimeout(2)
    return conn


def test_warm_connections_are_open_before_the_code_connects_and_refilled(
    proxy: socket.socket, tmp_path: Path
) -> None:
    poller = Poller()
    port = _free_port()
    relay = egress.Relay(poller, {"socket": str(tmp_path / "proxy.sock"), "listen": port, "warm": 2})
    try:
        first, second = _accepted(proxy), _accepted(proxy)  # before any client: the warm ones
        assert len(relay.idle) == 2
        with socket.create_connection(("127.0.0.1", port), timeout=2) as client:
            poller.pump()
            assert len(relay.idle) == 1  # not refilled in the accept: a connect on the request's path
            client.sendall(b"GET / HTTP/1.1\r\n\r\n")
            poller.pump()
            assert first.recv(100) == b"GET / HTTP/1.1\r\n\r\n"  # the oldest warm connection
            third = _accepted(proxy)  # refilled once the request was on its way
            assert len(relay.idle) == 2
            first.sendall(b"answer")
            poller.pump()
            assert client.recv(100) == b"answer"
        # The proxy closes a warm connection nobody used: the relay forgets it, no refill.
        second.close()
        poller.pump()
        assert len(relay.idle) == 1
        with socket.create_connection(("127.0.0.1", port), timeout=2) as client:
            poller.pump()
            client.sendall(b"ping")
            poller.pump()
            assert third.recv(100) == b"ping"
        for conn in (first, third):
            conn.close()
    finally:
        relay.close()
    assert not relay.idle and not relay.ends and not poller.data


def test_a_warm_connection_the_proxy_refused_is_not_handed_out(proxy: socket.socket, tmp_path: Path) -> None:
    """Between the poller's look and the client's arrival the proxy may have answered a warm
    connection (its 503 at the connection limit) or closed it: the client gets a fresh one."""
    poller = Poller()
    port = _free_port()
    relay = egress.Relay(poller, {"socket": str(tmp_path / "proxy.sock"), "listen": port, "warm": 1})
    try:
        warm = _accepted(proxy)
        warm.sendall(b"HTTP/1.1 503 too many\r\n\r\n")  # not pumped: the relay has not seen it
        with socket.create_connection(("127.0.0.1", port), timeout=2) as client:
            poller.pump(1)
            fresh = _accepted(proxy)
            client.sendall(b"hello")
            poller.pump()
            assert fresh.recv(100) == b"hello"
            fresh.close()
        warm.close()
    finally:
        relay.close()


def test_past_its_pairs_the_relay_leaves_connections_waiting_not_closed(
    proxy: socket.socket, tmp_path: Path
) -> None:
    """A full relay stops accepting: the code's next connection waits in the backlog and is
    carried once a pair ends. Before, it was accepted and closed: a reset, no answer."""
    poller = Poller()
    port = _free_port()
    relay = egress.Relay(poller, {"socket": str(tmp_path / "proxy.sock"), "listen": port, "pairs": 2})
    with contextlib.ExitStack() as held:
        clients = [
            held.enter_context(socket.create_connection(("127.0.0.1", port), timeout=2)) for _ in range(3)
        ]
        poller.pump()
        carried = [held.enter_context(_accepted(proxy)) for _ in range(2)]
        assert len(relay.ends) == 4 and relay.paused
        clients[2].setblocking(False)
        with pytest.raises(BlockingIOError):  # open, not reset nor ended: it waits
            clients[2].recv(1)
        clients[0].close()
        carried[0].close()
        poller.pump()
        third = held.enter_context(_accepted(proxy))  # its turn once a pair ended
        clients[2].setblocking(True)
        clients[2].sendall(b"hello")
        poller.pump()
        assert third.recv(100) == b"hello" and not relay.paused
        relay.close()
    assert not relay.ends and not poller.data


def test_half_closes_go_through_both_ways_and_an_end_out_of_the_poller_comes_back(
    proxy: socket.socket, tmp_path: Path
) -> None:
    """The code ends its request with a shutdown and gets the answer after it; the proxy
    shuts its side first and still gets megabytes from the code afterwards (its end, with
    nothing to read, has left the poller and must come back to be written to); then the
    pair is closed and nothing of it is left in the poller."""
    poller = Poller()
    port = _free_port()
    relay = egress.Relay(poller, {"socket": str(tmp_path / "proxy.sock"), "listen": port})
    size = 4 * 1024 * 1024  # more than the sockets' buffers: some sends must wait
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as client:
            client.sendall(b"request")
            client.shutdown(socket.SHUT_WR)
            poller.pump()
            upstream = _accepted(proxy)
            got = b""
            while chunk := upstream.recv(100):  # the code's EOF came through
                got += chunk
            assert got == b"request"
            upstream.sendall(b"answer")
            upstream.close()
            poller.pump()
            assert client.recv(100) == b"answer" and client.recv(100) == b""
        assert not relay.ends and set(poller.data) == {relay.listener.fileno()}

        with socket.create_connection(("127.0.0.1", port), timeout=2) as client:
            poller.pump()
            upstream = _accepted(proxy)
            upstream.sendall(b"done")
            upstream.shutdown(socket.SHUT_WR)
            poller.pump()
            assert client.recv(100) == b"done" and client.recv(100) == b""
            # the proxy's end waits for nothing: out of the poller (the listener and the code's end stay)
            code_end = [fd for fd, end in relay.ends.items() if end.client]
            assert set(poller.data) == {relay.listener.fileno(), *code_end}
            received = bytearray()

            def read() -> None:
                while chunk := upstream.recv(1 << 16):
                    received.extend(chunk)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            client.setblocking(False)
            sent = 0
            deadline = time.monotonic() + 30
            while (sent < size or len(received) < size) and time.monotonic() < deadline:
                if sent < size:
                    with contextlib.suppress(BlockingIOError):
                        sent += client.send(b"x" * min(1 << 16, size - sent))
                poller.pump(1)
            client.shutdown(socket.SHUT_WR)
            poller.pump()
            reader.join(5)
            assert len(received) == size
            upstream.close()
            poller.pump()
        assert not relay.ends and set(poller.data) == {relay.listener.fileno()}
    finally:
        relay.close()


def test_streams_over_the_port_carry_megabytes_both_ways_intact(tmp_path: Path) -> None:
    """The microVM's relay and the host's demultiplexer over a socketpair (the port, without
    the VM): a download and an upload of a few MiB, byte for byte, under the flow control."""
    import hashlib
    import threading

    from stockade.egress import _loop
    from stockade.egress._mux import Mux

    size = 3 * 1024 * 1024 + 17
    pattern = hashlib.sha256(b"x").digest() * (size // 32 + 1)
    target = str(tmp_path / "proxy.sock")
    uploads: list[bytes] = []

    def serve(server: socket.socket) -> None:  # the proxy's stand-in: an upload, then a download
        conn, _ = server.accept()
        with conn:
            got = bytearray()
            while len(got) < size:
                got += conn.recv(1 << 16)
            uploads.append(bytes(got))
            conn.sendall(pattern[:size])

    host_end, guest_end = socket.socketpair()
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(target)
        server.listen(4)
        threading.Thread(target=serve, args=(server,), daemon=True).start()
        mux = Mux(host_end, target)
        _loop.call(_start(mux))
        poller = Poller()
        port = _free_port()
        # egressmux builds on egress's listener, by bare name as in the sandbox
        relay = supervisor_module("egressmux").MuxRelay(poller, {"fd": guest_end.fileno(), "listen": port})
        received = bytearray()

        def client() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
                conn.sendall(pattern[:size])
                while len(received) < size:
                    data = conn.recv(1 << 16)
                    if not data:
                        break
                    received.extend(data)

        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 60
            while thread.is_alive() and time.monotonic() < deadline:
                poller.pump(1)
        finally:
            relay.close()
            _loop.call(mux.close())
            guest_end.close()
    thread.join(5)
    assert uploads == [pattern[:size]]
    assert bytes(received) == pattern[:size]
    assert not poller.data


async def _start(mux: object) -> None:
    mux.start()  # type: ignore[attr-defined]
