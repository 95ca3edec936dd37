"""How many connections the HTTP servers (``stockade serve``, ``stockade mcp``) hold, and whose:
``GuardedH11Protocol`` under real uvicorn on this machine's loopback, clients on several of
its addresses (127.0.0.2, 127.0.0.3, ...: all of 127/8 is this machine's on Linux).

1,100 connections from one address that each sent a request's head a line a second, opened
again as they were closed, held the cap of 1,000 open connections, and a client with a valid
token was answered 503 for as long as they lasted. Now an address holds a share of the cap
(an eighth unless told), and at the cap the connection that has waited longest for its head
is closed to make room, so slow heads from any number of addresses give way to a client that
says what it wants."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from starlette.types import Receive, Scope, Send

from stockade import exceptions as exc
from stockade.server.connections import ConnectionLimits, address_of, guarded_protocol


class Holding:
    """An ASGI app: ``/ok`` is answered at once; ``/hold`` starts its answer, then sends the
    rest only once the test lets it (its connection is being answered meanwhile)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.released: asyncio.Event | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        if self.released is None:
            self.loop, self.released = asyncio.get_running_loop(), asyncio.Event()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        if scope["path"] == "/hold":
            await self.released.wait()
        await send({"type": "http.response.body", "body": b"ok"})

    def release(self) -> None:
        if self.loop is not None and self.released is not None:
            self.loop.call_soon_threadsafe(self.released.set)


@contextlib.contextmanager
def serving(limits: ConnectionLimits) -> Iterator[int]:
    """``Holding`` served by uvicorn with ``GuardedH11Protocol`` and ``limits``: its port."""
    import uvicorn

    app = Holding()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="error", lifespan="off", http=guarded_protocol(limits)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started, "uvicorn did not start"
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        app.release()
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def connections(port: int, *addresses: str) -> Iterator[list[socket.socket]]:
    """A connection to ``port`` from each of ``addresses``, in that order, each having sent
    the start of a request's head and no more (a slow head)."""
    with contextlib.ExitStack() as stack:
        opened = []
        for address in addresses:
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), 10, (address, 0)))
            with contextlib.suppress(OSError):  # a refused one may be closed already
                sock.sendall(b"GET /ok HTTP/1.1\r\nHost: test\r\n")
            opened.append(sock)
        yield opened


def answer(sock: socket.socket) -> bytes:
    """All the server sends until it closes the connection."""
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


def request(port: int, path: str = "/ok", *, source: str) -> bytes:
    """A whole request from ``source``: all the server answered."""
    with socket.create_connection(("127.0.0.1", port), 10, (source, 0)) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".encode())
        return answer(sock)


def refused(answered: bytes) -> bool:
    return answered == b"" or answered.startswith(b"HTTP/1.1 503 ")


def still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True  # nothing to read, not closed
    finally:
        sock.setblocking(True)


def test_one_address_holds_its_share_of_the_connections_and_another_still_gets_in() -> None:
    with serving(ConnectionLimits(max_connections=8, max_per_address=2)) as port:
        with connections(port, "127.0.0.2", "127.0.0.2", "127.0.0.2", "127.0.0.2") as slow:
            # the third and fourth from 127.0.0.2 are answered 503 at once, asked nothing
            assert [refused(answer(sock)) for sock in slow[2:]] == [True, True]
            assert all(still_open(sock) for sock in slow[:2])
            assert request(port, source="127.0.0.3").startswith(b"HTTP/1.1 200 ")
        # loopback is an address as any other: it has its share
        with connections(port, "127.0.0.1", "127.0.0.1", "127.0.0.1") as slow:
            assert refused(answer(slow[2]))


def test_at_the_cap_slow_heads_give_way_to_a_client_that_says_what_it_wants() -> None:
    with (
        serving(ConnectionLimits(max_connections=4, max_per_address=2)) as port,
        connections(port, "127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3") as slow,
    ):
        # the cap is held by four slow heads from two addresses, each within its share
        assert request(port, source="127.0.0.4").startswith(b"HTTP/1.1 200 ")
        # the one that had waited longest for its head was closed for room, nothing said
        assert answer(slow[0]) == b""
        assert all(still_open(sock) for sock in slow[1:])


def test_at_the_cap_with_every_connection_being_answered_a_new_one_is_refused() -> None:
    with (
        serving(ConnectionLimits(max_connections=3, max_per_address=3)) as port,
        contextlib.ExitStack() as stack,
    ):
        for _ in range(3):  # each sent its whole head, and its answer has begun
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), 10, ("127.0.0.2", 0)))
            sock.sendall(b"GET /hold HTTP/1.1\r\nHost: test\r\n\r\n")
            assert sock.recv(12) == b"HTTP/1.1 200"
        assert refused(request(port, source="127.0.0.3"))


def test_an_address_share_is_an_eighth_of_the_cap_unless_told() -> None:
    assert ConnectionLimits().per_address == 125
    assert ConnectionLimits(max_connections=4).per_address == 1
    assert ConnectionLimits(max_connections=100, max_per_address=10).per_address == 10
    assert ConnectionLimits(max_connections=100, max_per_address=500).per_address == 100
    with pytest.raises(exc.ConfigurationError):
        ConnectionLimits(max_per_address=0)


def test_an_ipv6_client_counts_by_its_64_and_an_ipv4_one_by_its_address() -> None:
    # a host is given a whole /64: its addresses share one share
    one_host = {address_of(("2001:db8:1:2::1", 1)), address_of(("2001:db8:1:2:ffff::9", 2))}
    assert one_host == {"2001:db8:1:2::/64"}
    assert address_of(("2001:db8:1:3::1", 1)) != address_of(("2001:db8:1:2::1", 1))
    assert address_of(("::ffff:192.0.2.7", 1)) == address_of(("192.0.2.7", 2)) == "192.0.2.7"
    assert address_of(("127.0.0.1", 1)) != address_of(("127.0.0.2", 1))
    assert address_of(None) is None  # a Unix socket's peer: no share
