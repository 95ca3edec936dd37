"""How an answer leaves the proxy: a small one whose server wrote its head and body apart goes
to the client in one write (on gVisor each write is a wake-up of the relay and of the code),
but a head waits for its body only a short while, and not at all for a large body.

Against a raw server on 127.0.0.2 that writes an answer's head, waits, then writes its body.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from stockade.egress import EgressProxy, NetworkPolicy, _loop
from stockade.egress._http import HOLD_MAX
from stockade.types import EgressRecord


class SplitServer:
    """Answers each connection's first request with its head, then ``body`` ``delay_s`` later."""

    def __init__(self, body: bytes, delay_s: float) -> None:
        self.body = body
        self.delay_s = delay_s
        self.sock = socket.create_server(("127.0.0.2", 0))
        self.port = int(self.sock.getsockname()[1])
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(self.body))
                time.sleep(self.delay_s)
                conn.sendall(self.body)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a shutdown wakes the accept waiting in the thread
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)


@contextlib.contextmanager
def split_server(body: bytes, delay_s: float) -> Iterator[SplitServer]:
    server = SplitServer(body, delay_s)
    try:
        yield server
    finally:
        server.close()


def _get(server: SplitServer, *, hold_s: float) -> tuple[list[tuple[float, bytes]], list[EgressRecord]]:
    """One GET through a new proxy: each piece the client read (seconds after it sent the
    request, bytes), and the proxy's records."""
    records: list[EgressRecord] = []
    policy = NetworkPolicy(
        allow_hosts=(f"split.test:{server.port}",),
        allow_addresses=("127.0.0.2/32",),
        resolve={"split.test": ("127.0.0.2",)},
    )
    proxy = EgressProxy(policy, observer=records.append)
    proxy.exchange.hold_s = hold_s
    port = _loop.call(proxy.start_tcp())
    pieces: list[tuple[float, bytes]] = []
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(
                f"GET http://split.test:{server.port}/ HTTP/1.1\r\nHost: split.test\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            sent = time.monotonic()
            while chunk := client.recv(1 << 20):
                pieces.append((time.monotonic() - sent, chunk))
    finally:
        _loop.call(proxy.close())
    return pieces, records


def test_a_small_answer_written_in_two_pieces_reaches_the_client_in_one() -> None:
    with split_server(b"hello", delay_s=0.05) as server:
        pieces, records = _get(server, hold_s=5.0)
    assert pieces[0][1].startswith(b"HTTP/1.1 200 ") and pieces[0][1].endswith(b"\r\n\r\nhello")
    assert [(r.status, r.bytes_in, r.decision) for r in records] == [(200, 5, "allow")]


def test_a_head_waits_for_its_body_no_longer_than_the_hold() -> None:
    with split_server(b"late", delay_s=1.5) as server:
        pieces, records = _get(server, hold_s=0.05)
    (at, head), *rest = pieces
    assert head.endswith(b"\r\n\r\n") and at < 1.0  # the head went alone, long before the body
    assert b"".join(p for _, p in rest) == b"late"
    assert [(r.status, r.bytes_in) for r in records] == [(200, 4)]


def test_a_large_body_does_not_hold_its_head_back() -> None:
    size = HOLD_MAX + 1
    with split_server(b"x" * size, delay_s=1.5) as server:
        pieces, records = _get(server, hold_s=5.0)
    (at, head), *rest = pieces
    assert head.endswith(b"\r\n\r\n") and at < 1.0
    assert sum(len(p) for _, p in rest) == size
    assert [(r.status, r.bytes_in) for r in records] == [(200, size)]
