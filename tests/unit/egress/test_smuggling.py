"""Request smuggling through the egress proxy: a request whose framing two parsers could read
two ways (Content-Length with Transfer-Encoding, two lengths, a folded header, bare LF line
ends) is refused, or reaches the server rewritten with one reading only. Either way every
request the server gets is one the proxy judged and recorded.

Against a raw server on 127.0.0.2 that keeps the bytes it got, so what is checked is what
went over the wire, not what a library made of it.
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterator

import pytest

from stockade.egress import EgressProxy, NetworkPolicy, _loop
from stockade.types import EgressRecord

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


class RawServer:
    """Answers every connection once, after the client fell quiet, and keeps what it got."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.2", 0))
        self.port = int(self.sock.getsockname()[1])
        self.got: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(0.2)
                data = bytearray()
                try:
                    while chunk := conn.recv(65536):
                        data += chunk
                except TimeoutError:
                    pass
                self.got.append(bytes(data))
                conn.sendall(ANSWER)

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


@pytest.fixture
def server() -> Iterator[RawServer]:
    raw = RawServer()
    try:
        yield raw
    finally:
        raw.close()


def _send(server: RawServer, request: bytes) -> tuple[bytes, list[EgressRecord]]:
    records: list[EgressRecord] = []
    policy = NetworkPolicy(
        allow_hosts=(f"raw.test:{server.port}",),
        allow_addresses=("127.0.0.2/32",),
        resolve={"raw.test": ("127.0.0.2",)},
    )
    proxy = EgressProxy(policy, observer=records.append)
    port = _loop.call(proxy.start_tcp())
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(request.replace(b"PORT", str(server.port).encode()))
            client.shutdown(socket.SHUT_WR)
            answer = bytearray()
            while chunk := client.recv(65536):
                answer += chunk
    finally:
        _loop.call(proxy.close())
    return bytes(answer), records


def _requests_in(wire: bytes) -> int:
    return len(re.findall(rb"(?m)^[A-Z]+ \S+ HTTP/1\.[01]\r?$", wire))


def _judged(server: RawServer, records: list[EgressRecord]) -> None:
    """Every request on the server's wire is one the proxy recorded as allowed."""
    sent = sum(_requests_in(wire) for wire in server.got)
    assert sent <= sum(1 for r in records if r.decision == "allow")
    for wire in server.got:
        head = wire.split(b"\r\n\r\n", 1)[0]
        assert b"\n" not in head.replace(b"\r\n", b""), "a bare LF went to the server"
        assert not re.search(rb"\r\n[ \t]", head), "a folded header went to the server"
        lengths = re.findall(rb"(?im)^content-length:", head)
        encodings = re.findall(rb"(?im)^transfer-encoding:", head)
        assert len(lengths) + len(encodings) <= 1, "two framings went to the server"


def _status(answer: bytes) -> int:
    """The answer's status; 0 when the proxy closed without one (h11 could not read the head)."""
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def test_content_length_with_transfer_encoding(server: RawServer) -> None:
    smuggled = b"GET http://raw.test:PORT/smuggled HTTP/1.1\r\nHost: raw.test:PORT\r\n\r\n"
    answer, records = _send(
        server,
        b"POST http://raw.test:PORT/ HTTP/1.1\r\nHost: raw.test:PORT\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled,
    )
    assert server.got == []  # refused before any connection to the server
    assert _status(answer) == 400 and b"Content-Length and Transfer-Encoding" in answer
    assert [(r.method, r.status, r.decision, r.rule) for r in records] == [
        ("POST", 400, "deny", "request (framing)")
    ]


@pytest.mark.parametrize(
    "lengths", [b"Content-Length: 4\r\nContent-Length: 40\r\n", b"Content-Length: 4, 40\r\n"]
)
def test_two_content_lengths_are_refused(server: RawServer, lengths: bytes) -> None:
    answer, records = _send(
        server, b"POST http://raw.test:PORT/ HTTP/1.1\r\nHost: raw.test:PORT\r\n" + lengths + b"\r\nbody"
    )
    assert server.got == [] and records == [] and _status(answer) == 0


@pytest.mark.parametrize(
    "encoding",
    [b"gzip, chunked", b"chunked, identity", b"xchunked", b"chunked\r\nTransfer-Encoding: chunked"],
)
def test_a_transfer_encoding_other_than_chunked_is_refused(server: RawServer, encoding: bytes) -> None:
    answer, records = _send(
        server,
        b"POST http://raw.test:PORT/ HTTP/1.1\r\nHost: raw.test:PORT\r\nTransfer-Encoding: "
        + encoding
        + b"\r\n\r\n0\r\n\r\n",
    )
    assert server.got == [] and records == [] and _status(answer) == 0


def test_a_folded_header(server: RawServer) -> None:
    answer, records = _send(
        server, b"GET http://raw.test:PORT/ HTTP/1.1\r\nHost: raw.test:PORT\r\nX-A: one\r\n two\r\n\r\n"
    )
    _judged(server, records)  # unfolded (RFC 9112, 5.2: replaced by a space)
    assert _status(answer) == 200 and b"x-a: one two\r\n" in server.got[0]


def test_bare_lf_line_ends(server: RawServer) -> None:
    answer, records = _send(
        server,
        b"GET http://raw.test:PORT/ HTTP/1.1\nHost: raw.test:PORT\nX-A: 1\n\n"
        b"GET http://raw.test:PORT/b HTTP/1.1\r\n\r\n",
    )
    _judged(server, records)  # the first with CRLF line ends; the second (no Host) closes
    assert _status(answer) == 200 and len(server.got) == 1 and [r.path for r in records] == ["/"]
