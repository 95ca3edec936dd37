"""How many connections the HTTP servers (``stockade serve``, ``stockade mcp``) hold, and whose:
``GuardedH11Protocol`` under real uvicorn on this machine's loopback, clients on several of
its addresses (127.0.0.2, 127.0.0.3, ...: all of 127/8 is this machine's on Linux).

1,100 connections from one address that each sent a request's head a line a second, opened
again as they were closed, held the cap of 1,000 open connections, and a client with a valid
token was answered 503 for as long as they lasted. Now an address holds a share of the cap
(an eighth unless told), and at the cap the connection that has waited longest for its head
is closed to make room, so slow heads from any number of addresses give way to a client that
says what it wants.

90 connections from nine addresses that each pipelined requests for a 46 KB answer and read
none held a cap of 80 (their heads had come, and the next answer waited for ever for room in
the socket): a client was answered 503 for as long as they lasted. Now a connection whose
client reads none of its answer for the send timeout is reset, and at the cap the one stalled
longest gives way too."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from starlette.types import Receive, Scope, Send

from stockade import exceptions as exc
from stockade.server.connections import ConnectionLimits, address_of, guarded_protocol

# An answer larger than all the buffers between the app and a client that does not read
BIG = 2 * 1024 * 1024
EVENT = b"data: " + b"x" * 1000 + b"\n\n"


class Holding:
    """An ASGI app: ``/ok`` is answered at once; ``/hold`` starts its answer, then sends the
    rest only once the test lets it (its connection is being answered meanwhile); ``/big`` is
    answered ``BIG`` bytes in one piece (``big_sent`` once the app has handed them over);
    ``/events`` is an event stream sent as fast as its client takes it, until its client goes
    (then ``stream_ended``). ``started``: the requests begun, each as its client's address and
    its path."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.released: asyncio.Event | None = None
        self.started: list[tuple[str, str]] = []
        self.big_sent = threading.Event()
        self.stream_ended = threading.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        if self.released is None:
            self.loop, self.released = asyncio.get_running_loop(), asyncio.Event()
        path = scope["path"]
        self.started.append((scope["client"][0] if scope["client"] else "", path))
        if path == "/events":
            await self._stream(receive, send)
            return
        body = b"b" * BIG if path == "/big" else b"ok"
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if path == "/hold":
            await self.released.wait()
        await send({"type": "http.response.body", "body": body})
        if path == "/big":
            self.big_sent.set()

    async def _stream(self, receive: Receive, send: Send) -> None:
        await receive()  # the request's (empty) body; the next message is its client going
        gone = asyncio.ensure_future(receive())
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        while not gone.done():
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        self.stream_ended.set()

    def release(self) -> None:
        if self.loop is not None and self.released is not None:
            self.loop.call_soon_threadsafe(self.released.set)


@contextlib.contextmanager
def serving(limits: ConnectionLimits, app: Holding | None = None) -> Iterator[int]:
    """``app`` (a new ``Holding`` unless given) served by uvicorn with ``GuardedH11Protocol`` and
    ``limits``: its port."""
    import uvicorn

    app = app or Holding()
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


@contextlib.contextmanager
def unread(port: int, source: str, *paths: str) -> Iterator[socket.socket]:
    """A connection from ``source`` that pipelines a request for each of ``paths`` (the last
    asks to close) and reads none of the answers: its receive buffer is as small as it gets."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.bind((source, 0))
        sock.settimeout(10)
        sock.connect(("127.0.0.1", port))
        requests = [f"GET {path} HTTP/1.1\r\nHost: test\r\n" for path in paths]
        requests[-1] += "Connection: close\r\n"
        sock.sendall("".join(f"{head}\r\n" for head in requests).encode())
        yield sock


def reset(sock: socket.socket) -> bool:
    """Whether the server reset the connection (nothing of it read meanwhile)."""
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNRESET


def reset_in_time(sock: socket.socket) -> bool:
    """Whether the server resets the connection within a bound far past any timeout here."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if reset(sock):
            return True
        time.sleep(0.05)
    return False


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
    with pytest.raises(exc.ConfigurationError):
        ConnectionLimits(send_timeout_s=0)


def test_an_ipv6_client_counts_by_its_64_and_an_ipv4_one_by_its_address() -> None:
    # a host is given a whole /64: its addresses share one share
    one_host = {address_of(("2001:db8:1:2::1", 1)), address_of(("2001:db8:1:2:ffff::9", 2))}
    assert one_host == {"2001:db8:1:2::/64"}
    assert address_of(("2001:db8:1:3::1", 1)) != address_of(("2001:db8:1:2::1", 1))
    assert address_of(("::ffff:192.0.2.7", 1)) == address_of(("192.0.2.7", 2)) == "192.0.2.7"
    assert address_of(("127.0.0.1", 1)) != address_of(("127.0.0.2", 1))
    assert address_of(None) is None  # a Unix socket's peer: no share


def test_clients_that_pipeline_requests_and_read_no_answer_give_way_to_one_that_reads() -> None:
    with (
        serving(ConnectionLimits(max_connections=4, max_per_address=2)) as port,
        contextlib.ExitStack() as stack,
    ):
        # the cap is held by connections from two addresses whose heads came: each asked for
        # large answers and reads none, so the app waits for room in its socket
        sources = ("127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3")
        hogs = [stack.enter_context(unread(port, source, *["/big"] * 8)) for source in sources]
        answered = b""
        for _ in range(50):  # as a 503's retry-after asks
            answered = request(port, source="127.0.0.4")
            if not refused(answered):
                break
            time.sleep(0.1)
        assert answered.startswith(b"HTTP/1.1 200 ")
        # the one stalled longest was reset to make room; the others wait for their send timeout
        assert [reset(sock) for sock in hogs].count(True) == 1


def test_a_client_that_reads_none_of_its_answer_is_reset_after_the_send_timeout() -> None:
    with serving(ConnectionLimits(send_timeout_s=0.5)) as port, unread(port, "127.0.0.2", "/big") as sock:
        assert reset_in_time(sock)


def test_an_event_stream_whose_client_stops_reading_is_cut() -> None:
    app = Holding()
    with (
        serving(ConnectionLimits(send_timeout_s=0.5), app) as port,
        socket.create_connection(("127.0.0.1", port), 10, ("127.0.0.2", 0)) as sock,
    ):
        sock.sendall(b"GET /events HTTP/1.1\r\nHost: test\r\n\r\n")
        assert sock.recv(12) == b"HTTP/1.1 200"  # the stream began; its client reads no more
        assert app.stream_ended.wait(30)  # the app saw its client go
        assert reset(sock)


def test_a_request_pipelined_behind_an_unread_answer_waits_until_the_client_reads_it() -> None:
    app = Holding()
    with serving(ConnectionLimits(), app) as port, unread(port, "127.0.0.2", "/big", "/ok") as sock:
        assert app.big_sent.wait(10)  # handed over whole; most of it waits in the server
        assert request(port, source="127.0.0.3").startswith(b"HTTP/1.1 200 ")  # the server went on
        assert [path for source, path in app.started if source == "127.0.0.2"] == ["/big"]
        received = answer(sock)  # now it reads: the second request is answered too
        assert received.count(b"HTTP/1.1 200 ") == 2
        assert received.endswith(b"\r\n\r\nok")
        assert [path for source, path in app.started if source == "127.0.0.2"] == ["/big", "/ok"]


def test_a_client_reading_a_large_answer_slowly_gets_all_of_it() -> None:
    # it reads far slower than the server writes, so the server waits on it all along; but it
    # reads, and the send timeout counts from its last read
    with serving(ConnectionLimits(send_timeout_s=2)) as port, unread(port, "127.0.0.2", "/big") as sock:
        received = b""
        while chunk := sock.recv(8192):
            received += chunk
            time.sleep(0.01)
        assert received.startswith(b"HTTP/1.1 200 ")
        assert received.endswith(b"\r\n\r\n" + b"b" * BIG)
