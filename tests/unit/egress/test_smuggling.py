"""Request smuggling through the egress proxy: a request whose framing two parsers could read
two ways (Content-Length with Transfer-Encoding, two lengths, a folded header, bare LF line
ends) is refused, or reaches the server rewritten with one reading only. Either way every
request the server gets is one the proxy judged and recorded.

A request the proxy cannot read at all (a broken request line, a head too long, a framing
h11 refuses) is answered ``400`` (``431``) with the reason and recorded, once, without any
connection to a server: on a new connection, on a kept one after a first request, and
inside a tunnel whose TLS the proxy opened.

A tunnel the proxy splices carries TLS both ways: a server that does not answer the
ClientHello as TLS (a Redis or an SMTP server on an allowed port) gets the hello and nothing
more, whatever the client sends after it (records whose header is made up and whose body is
a command); after a TLS server answered, plain text from the client, or the start of a
header that is no record's (``QUIT``), closes the tunnel unsent.

A server's answer is bounded the same way: its heads (a final one, and the 1xx ones before
it, which count against the bytes per minute, are bounded in number and share its deadline).

Against a raw server on 127.0.0.2 that keeps the bytes it got, so what is checked is what
went over the wire, not what a library made of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from stockade.egress import EgressProxy, HostRule, NetworkPolicy, _loop, _streams
from stockade.egress._feed import HEAD_LINES, INFORMATIONAL_LIMIT, PIECES_PER_TURN, load_h11
from stockade.egress._streams import Plain
from stockade.egress._tunnel import MAX_RECORD, NotTLS, Records
from stockade.egress._upstream import UpstreamKey
from stockade.types import EgressRecord
from tests.conftest import wait_for
from tests.egress_servers import servers

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


class RawServer:
    """Answers every connection once, after the client fell quiet (or sent ``until``: a quiet
    moment of a loaded host is no end), and keeps what it got; then holds the connection
    open ``hold`` seconds before closing it."""

    def __init__(self, answer: bytes = ANSWER, *, until: bytes | None = None, hold: float = 0.0) -> None:
        self.answer = answer
        self.until = until
        self.hold = hold
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
                conn.settimeout(0.2 if self.until is None else 30)
                data = bytearray()
                try:
                    while chunk := conn.recv(65536):
                        data += chunk
                        if self.until is not None and data.endswith(self.until):
                            break
                except TimeoutError:
                    pass
                self.got.append(bytes(data))
                conn.sendall(self.answer)
                time.sleep(self.hold)

    def close(self) -> None:
        # A close alone does not wake an accept waiting in another thread (Linux): a shutdown does.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)


@pytest.fixture
def server() -> Iterator[RawServer]:
    raw = RawServer()
    try:
        yield raw
    finally:
        raw.close()


def _policy(
    server: RawServer | Counting, max_bytes_per_minute: int = NetworkPolicy.max_bytes_per_minute
) -> NetworkPolicy:
    return NetworkPolicy(
        allow_hosts=(f"raw.test:{server.port}",),
        allow_addresses=("127.0.0.2/32",),
        resolve={"raw.test": ("127.0.0.2",)},
        max_bytes_per_minute=max_bytes_per_minute,
    )


def _send(
    server: RawServer,
    request: bytes,
    *,
    end: bool = True,
    head_timeout_s: float | None = None,
    answer_timeout_s: float | None = None,
    max_bytes_per_minute: int = NetworkPolicy.max_bytes_per_minute,
) -> tuple[bytes, list[EgressRecord]]:
    """``request`` (``PORT`` is the server's) through a new proxy, and all that came back;
    ``end``: the client's side is shut after it (else the proxy answers a head still open)."""
    records: list[EgressRecord] = []
    proxy = EgressProxy(_policy(server, max_bytes_per_minute=max_bytes_per_minute), observer=records.append)
    if head_timeout_s is not None:
        proxy.exchange.head_timeout_s = head_timeout_s
    if answer_timeout_s is not None:
        proxy.exchange.answer_timeout_s = answer_timeout_s
    port = _loop.call(proxy.start_tcp())
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(request.replace(b"PORT", str(server.port).encode()))
            if end:
                with contextlib.suppress(OSError):  # the proxy may have answered and closed already
                    client.shutdown(socket.SHUT_WR)
            answer = bytearray()
            while chunk := client.recv(65536):
                answer += chunk
    finally:
        _loop.call(proxy.close())
    return bytes(answer), records


def _tunnel(proxy_port: int, target: str) -> tuple[socket.socket, bytes]:
    """A connection to the proxy that asked it to ``CONNECT target``, and the answer's head."""
    raw = socket.create_connection(("127.0.0.1", proxy_port), timeout=10)
    raw.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += raw.recv(1)
    return raw, head


def _send_in_tunnel(server: RawServer, request: bytes) -> tuple[bytes, list[EgressRecord]]:
    """``request`` inside a tunnel to raw.test whose TLS the proxy opens (a rule with
    methods), the client trusting the sandbox's CA; what came back inside the TLS."""
    records: list[EgressRecord] = []
    policy = NetworkPolicy(
        rules=(HostRule(host="raw.test", ports=(server.port,), methods=("GET", "POST")),),
        allow_addresses=("127.0.0.2/32",),
        resolve={"raw.test": ("127.0.0.2",)},
    )
    proxy = EgressProxy(policy, observer=records.append)
    assert proxy.ca_pem is not None
    ctx = ssl.create_default_context(cadata=proxy.ca_pem.decode())
    port = _loop.call(proxy.start_tcp())
    try:
        raw, head = _tunnel(port, f"raw.test:{server.port}")
        with raw:
            assert head.startswith(b"HTTP/1.1 200"), head
            with ctx.wrap_socket(raw, server_hostname="raw.test") as client:
                client.sendall(request.replace(b"PORT", str(server.port).encode()))
                answer = bytearray()
                try:
                    while chunk := client.recv(65536):
                        answer += chunk
                except (ssl.SSLEOFError, ConnectionResetError):  # closed after the answer, no goodbye
                    pass
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


def _statuses(answer: bytes) -> list[int]:
    """The status of each answer in ``answer`` (the proxy's bodies are one line each)."""
    return [int(s) for s in re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)]


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


def _refused_unread(
    server: RawServer, answer: bytes, records: list[EgressRecord], status: int, rule: str, said: bytes
) -> None:
    """One answer ``status`` saying ``said`` and ``rule``, one record of it, no server."""
    assert server.got == []  # no connection to the server at all
    assert _status(answer) == status and said in answer and f"rule: {rule}".encode() in answer
    assert len(_statuses(answer)) == 1
    (record,) = records
    assert (record.status, record.decision, record.rule, record.bytes_out, record.bytes_in) == (
        status, "deny", rule, 0, 0,
    )  # fmt: skip


@pytest.mark.parametrize(
    "lengths", [b"Content-Length: 4\r\nContent-Length: 40\r\n", b"Content-Length: 4, 40\r\n"]
)
def test_two_content_lengths_are_refused(server: RawServer, lengths: bytes) -> None:
    answer, records = _send(
        server, b"POST http://raw.test:PORT/ HTTP/1.1\r\nHost: raw.test:PORT\r\n" + lengths + b"\r\nbody"
    )
    _refused_unread(server, answer, records, 400, "request (framing)", b"two Content-Length values")
    assert (records[0].host, records[0].port, records[0].method, records[0].path) == (
        "raw.test", server.port, "POST", "/",
    )  # fmt: skip
    assert records[0].reason == "two Content-Length values, or one that is no number"


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
    _refused_unread(server, answer, records, 400, "request (framing)", b"other than chunked")
    assert records[0].method == "POST"


SECRET_LOOKING = b"tok-not-for-the-trail"


@pytest.mark.parametrize(
    ("request_bytes", "method"),
    [
        (b"GET http://raw.test:PORT/ HTTP/1.1 extra\r\nHost: raw.test:PORT\r\n\r\n", ""),  # request line
        (b"GET http://raw.test:PORT/ HTTP/1.1\r\nHost: raw.test:PORT\r\nBad Name: x\r\n\r\n", "GET"),
        (b"GET http://raw.test:PORT/ HTTP/1.1\r\nX-Token: a\x00" + SECRET_LOOKING + b"\r\n\r\n", "GET"),
        (b"GET http://raw.test:PORT/ HTTP/1.1\r\n\r\n", "GET"),  # HTTP/1.1 without Host
        (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", ""),  # not HTTP at all
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", ""),  # TLS to a plain proxy
    ],
)
def test_a_request_h11_cannot_read_is_a_400_and_one_record(
    server: RawServer, request_bytes: bytes, method: str
) -> None:
    answer, records = _send(server, request_bytes)
    _refused_unread(server, answer, records, 400, "request (syntax)", b"not HTTP/1.1")
    assert records[0].method == method
    assert all(SECRET_LOOKING.decode() not in repr(r) for r in records)  # h11's message quotes it


def test_a_head_cut_by_the_clients_end_is_a_400_and_one_record(server: RawServer) -> None:
    answer, records = _send(server, b"GET http://raw.test:PORT/cut HTTP/1.1\r\nHost: raw.te")
    _refused_unread(server, answer, records, 400, "request (syntax)", b"ended inside the request's head")
    assert (records[0].method, records[0].path) == ("GET", "/cut")


def test_a_head_that_does_not_end_in_time_is_a_408_and_one_record(server: RawServer) -> None:
    answer, records = _send(
        server, b"GET http://raw.test:PORT/slow HTTP/1.1\r\nHost: raw.te", end=False, head_timeout_s=0.3
    )
    _refused_unread(server, answer, records, 408, "request (timeout)", b"did not end in time")
    assert (records[0].method, records[0].path) == ("GET", "/slow")


def test_a_connection_idle_before_any_request_is_no_record(server: RawServer) -> None:
    answer, records = _send(server, b"", end=False, head_timeout_s=0.3)
    assert answer == b"" and records == [] and server.got == []


def test_a_head_too_long_is_a_431(server: RawServer) -> None:
    # The head never ends: h11 gives up at the proxy's limit, while the client still sends.
    answer, records = _send(
        server,
        b"GET http://raw.test:PORT/ HTTP/1.1\r\nHost: raw.test:PORT\r\nX-A: " + b"a" * 70_000,
        end=False,
    )
    _refused_unread(server, answer, records, 431, "request (size)", b"longer than 65536 bytes")
    assert (records[0].method, records[0].path) == ("GET", "/")


async def _arrived(data: bytes, *, end: bool) -> tuple[Plain, socket.socket]:
    """A stream for the proxy whose peer (returned too) already sent ``data``: it waits
    whole in the kernel's buffer, so the proxy's first read gets all of it (over TCP a
    head of 80 KB may come in two reads, and h11 refuses the first while incomplete)."""
    ours, theirs = socket.socketpair()
    theirs.settimeout(10)
    theirs.sendall(data)
    if end:
        theirs.shutdown(socket.SHUT_WR)
    return await _streams.wrap(ours), theirs


def _received(peer: socket.socket) -> bytes:
    answer = bytearray()
    with peer:
        while chunk := peer.recv(65536):
            answer += chunk
    return bytes(answer)


MANY_HEADERS = b"".join(b"X-%d: a\r\n" % n for n in range(8000))  # about 80 KB of short lines
LONG_HEADERS = b"".join(b"X-%d: %s\r\n" % (n, b"a" * 2000) for n in range(40))  # 80 KB in 40 lines


def test_a_head_too_long_that_comes_whole_in_one_read_is_a_431(server: RawServer) -> None:
    """h11 bounds a head only while it is incomplete: one that came whole is measured too."""
    request = b"GET http://raw.test:0/ HTTP/1.1\r\nHost: raw.test\r\n%s\r\n" % LONG_HEADERS
    answer, records = _served(server, request)
    _refused_unread(server, answer, records, 431, "request (size)", b"longer than 65536 bytes")
    assert (records[0].method, records[0].path) == ("GET", "/")


def test_an_answer_head_too_long_is_a_502(server: RawServer) -> None:
    """The same for a server's answer: the code gets a 502, none of that head."""
    huge = b"HTTP/1.1 200 OK\r\n%sContent-Length: 2\r\n\r\nok" % MANY_HEADERS
    answer, records, _ = _answered_by(server, huge)
    assert _statuses(answer) == [502] and b"x-1:" not in answer.lower() and b"rule: reply (size)" in answer
    assert [(r.method, r.status, r.rule) for r in records] == [("GET", 502, "reply (size)")]


PROCESSING = b"HTTP/1.1 102 Processing\r\n\r\n"


def test_informational_answers_are_bounded_in_number() -> None:
    """``102 Processing`` without end costs the shared loop a head each: past 16, a 502."""
    raw = RawServer(answer=PROCESSING * 1000 + ANSWER)
    try:
        answer, records = _send(raw, b"GET http://raw.test:PORT/ HTTP/1.1\r\nHost: raw.test:PORT\r\n\r\n")
    finally:
        raw.close()
    assert _statuses(answer) == [502] and b"rule: reply (informational)" in answer
    assert [(r.status, r.decision, r.rule) for r in records] == [(502, "allow", "reply (informational)")]


def test_informational_answers_count_against_the_bytes_per_minute() -> None:
    heavy = b"HTTP/1.1 103 Early Hints\r\nLink: " + b"a" * 1000 + b"\r\n\r\n"
    raw = RawServer(answer=heavy * 10 + ANSWER)
    try:
        answer, records = _send(
            raw,
            b"GET http://raw.test:PORT/ HTTP/1.1\r\nHost: raw.test:PORT\r\n\r\n",
            max_bytes_per_minute=5000,
        )
    finally:
        raw.close()
    assert _statuses(answer) == [429] and b"max_bytes_per_minute" in answer
    assert [(r.status, r.rule) for r in records] == [(429, "max_bytes_per_minute")]


def test_informational_answers_do_not_extend_the_deadline_of_the_final_one() -> None:
    """One ``102`` and then silence: the answer's deadline runs from the request, not anew."""
    raw = RawServer(answer=PROCESSING, hold=8.0)
    try:
        started = time.monotonic()
        answer, records = _send(
            raw, b"GET http://raw.test:PORT/ HTTP/1.1\r\nHost: raw.test:PORT\r\n\r\n", answer_timeout_s=1.0
        )
        took = time.monotonic() - started
    finally:
        raw.close()
    assert took < 5.0 and _statuses(answer) == [502] and b"no answer in 1 s" in answer
    assert [(r.status, r.reason) for r in records] == [
        (502, f"sent, then raw.test:{raw.port} failed: no answer in 1 s")
    ]


class CountedLines(load_h11().Connection):  # type: ignore[misc]
    """h11's side of a connection to a server, counting the line ends it was given to parse."""

    def __init__(self) -> None:
        super().__init__(load_h11().CLIENT)
        self.lines = 0

    def receive_data(self, data: bytes) -> None:
        self.lines += bytes(data).count(b"\n")
        super().receive_data(data)


def _answered_by(server: RawServer, answer: bytes) -> tuple[bytes, list[EgressRecord], int]:
    """A GET to raw.test over a connection kept from an earlier request, whose server sent
    ``answer`` already: what the client got, the records, and the lines h11 was given."""
    records: list[EgressRecord] = []
    proxy = EgressProxy(_policy(server), observer=records.append)
    key = UpstreamKey(address="127.0.0.2", port=server.port, scheme="http", host="raw.test", credential="")
    up = CountedLines()

    async def serve() -> tuple[socket.socket, socket.socket]:
        upstream, server_side = await _arrived(answer, end=False)
        proxy.exchange.upstreams.give(key, upstream, up)
        client, peer = await _arrived(
            b"GET http://raw.test:%d/ HTTP/1.1\r\nHost: raw.test\r\n\r\n" % server.port, end=True
        )
        await proxy.exchange.serve(client, tunnel=None)
        client.close()
        return peer, server_side

    peer, server_side = _loop.call(serve())
    try:
        got = _received(peer)
    finally:
        server_side.close()
        _loop.call(proxy.close())
    return got, records, up.lines


MANY_LINES = b"a:b\r\n" * 10_000  # 50 KB: within HEAD_LIMIT, 40 times HEAD_LINES


def test_an_answer_head_of_too_many_lines_is_a_502_h11_never_parses(server: RawServer) -> None:
    """Parsing a head is what it costs the loop every sandbox shares, by its lines more than
    its bytes: a server's head is counted before h11 sees it, like a request's."""
    answer, records, parsed = _answered_by(
        server, b"HTTP/1.1 200 OK\r\n%sContent-Length: 2\r\n\r\nok" % MANY_LINES
    )
    assert _statuses(answer) == [502] and b"more than 256 lines" in answer and b"rule: reply (size)" in answer
    assert [(r.status, r.decision, r.rule) for r in records] == [(502, "allow", "reply (size)")]
    assert parsed <= HEAD_LINES


def test_informational_heads_are_bounded_in_lines_together(server: RawServer) -> None:
    """Sixteen ``103`` heads each within the limit, 200 lines each: together past it, a 502."""
    hints = b"HTTP/1.1 103 Early Hints\r\n" + b"Link: </a.css>; rel=preload\r\n" * 200 + b"\r\n"
    answer, records, parsed = _answered_by(server, hints * 16 + ANSWER)
    assert _statuses(answer) == [502] and b"rule: reply (informational)" in answer
    assert [(r.status, r.rule) for r in records] == [(502, "reply (informational)")]
    assert parsed <= 2 * HEAD_LINES


def test_a_few_early_hints_and_a_head_of_many_headers_pass(server: RawServer) -> None:
    hint = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
    headers = b"".join(b"X-%d: a\r\n" % n for n in range(HEAD_LINES - 3))  # and the status line, the end
    answer, records, _ = _answered_by(
        server, hint * INFORMATIONAL_LIMIT + b"HTTP/1.1 200 OK\r\n%sContent-Length: 2\r\n\r\nok" % headers
    )
    assert _statuses(answer) == [200] and answer.endswith(b"\r\n\r\nok") and b"x-252: a" in answer.lower()
    assert [(r.status, r.decision) for r in records] == [(200, "allow")]


def test_an_unreadable_second_request_on_a_kept_connection(server: RawServer) -> None:
    answer, records = _send(
        server,
        b"GET http://raw.test:PORT/first HTTP/1.1\r\nHost: raw.test:PORT\r\n\r\n"
        b"POST http://raw.test:PORT/second HTTP/1.1\r\nHost: raw.test:PORT\r\n"
        b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    )
    assert _statuses(answer) == [200, 400]
    assert [(r.method, r.path, r.status, r.decision, r.rule) for r in records] == [
        ("GET", "/first", 200, "allow", f"allow: raw.test:{server.port}"),
        ("POST", "/second", 400, "deny", "request (framing)"),
    ]
    assert len(server.got) == 1 and _requests_in(server.got[0]) == 1 and b"/second" not in server.got[0]


@pytest.mark.parametrize(
    ("request_bytes", "status", "rule"),
    [
        (b"POST /x HTTP/1.1\r\nHost: raw.test\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
         400, "request (framing)"),
        (b"POST /x HTTP/1.1\r\nHost: raw.test\r\nTransfer-Encoding: gzip\r\n\r\n", 400, "request (framing)"),
        (b"GET /x HTTP/1.1 \r\nHost: raw.test\r\n\r\n", 400, "request (syntax)"),
        (b"GET /x HTTP/1.1\r\nHost: raw.test\r\nX-A: " + b"a" * 70_000 + b"\r\n", 431, "request (size)"),
    ],
)  # fmt: skip
def test_an_unreadable_request_inside_an_opened_tunnel(
    server: RawServer, request_bytes: bytes, status: int, rule: str
) -> None:
    answer, records = _send_in_tunnel(server, request_bytes)
    assert server.got == [] and _status(answer) == status and f"rule: {rule}".encode() in answer
    (record,) = records  # the CONNECT itself is no record of its own: its requests are
    assert (record.host, record.port, record.status, record.decision, record.rule) == (
        "raw.test", server.port, status, "deny", rule,
    )  # fmt: skip


def test_an_unreadable_request_after_one_inside_an_opened_tunnel(tmp_path: Path) -> None:
    """A first request answered by a real HTTPS server (its credential added), then one
    h11 cannot read on the same opened TLS: a 400 and its record, nothing more to the server."""
    with servers(tmp_path) as local:
        records: list[EgressRecord] = []
        proxy = EgressProxy(local.policy(), observer=records.append)
        assert proxy.ca_pem is not None
        ctx = ssl.create_default_context(cadata=proxy.ca_pem.decode())
        port = _loop.call(proxy.start_tcp())
        try:
            target = f"api.test:{local.https_port}".encode()
            raw, head = _tunnel(port, target.decode())
            assert head.startswith(b"HTTP/1.1 200"), head
            with raw, ctx.wrap_socket(raw, server_hostname="api.test") as client:
                client.sendall(
                    b"GET /auth HTTP/1.1\r\nHost: " + target + b"\r\n\r\n"
                    b"GET /second HTTP/1.1\r\nHost " + target + b"\r\n\r\n"
                )
                answer = bytearray()
                with contextlib.suppress(ssl.SSLEOFError, ConnectionResetError):
                    while chunk := client.recv(65536):
                        answer += chunk
        finally:
            _loop.call(proxy.close())
        paths = list(local.https_seen.paths)
    assert _statuses(bytes(answer)) == [200, 400] and b"authorized=True" in answer
    assert [(r.method, r.path, r.status, r.decision, r.rule, r.credential) for r in records] == [
        ("GET", "/auth", 200, "allow", f"allow: api.test:{local.https_port}", "api"),
        ("GET", "/second", 400, "deny", "request (syntax)", ""),
    ]
    assert paths == ["/auth"]


def test_a_chunked_body_that_breaks_its_framing_is_recorded(server: RawServer) -> None:
    """The head was judged and went out; the body then breaks its chunked framing: the
    server's connection is cut, the client gets a 400, and the request is one record."""
    answer, records = _send(
        server,
        b"POST http://raw.test:PORT/ HTTP/1.1\r\nHost: raw.test:PORT\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\nnot a chunk\r\n0\r\n\r\n",
    )
    assert _status(answer) == 400 and b"breaks its framing" in answer
    assert [(r.method, r.status, r.decision, r.rule) for r in records] == [
        ("POST", 400, "deny", "request (framing)")
    ]


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
    _judged(server, records)  # the first with CRLF line ends; the second (no Host) is a 400
    assert _status(answer) == 200 and len(server.got) == 1
    assert [(r.path, r.status, r.rule) for r in records] == [
        ("/", 200, f"allow: raw.test:{server.port}"),
        ("/b", 400, "request (syntax)"),
    ]


def test_a_server_answer_h11_cannot_read_is_a_502_and_one_record() -> None:
    raw = RawServer(answer=b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok")
    try:
        answer, records = _send(raw, b"GET http://raw.test:PORT/ HTTP/1.1\r\nHost: raw.test:PORT\r\n\r\n")
    finally:
        raw.close()
    assert _statuses(answer) == [502] and b"is not HTTP/1.1" in answer
    assert [(r.method, r.status, r.decision) for r in records] == [("GET", 502, "allow")]
    assert "Content-Length" not in records[0].reason  # h11's words about the bytes stay out


@pytest.mark.parametrize(
    "target",
    [
        "http://evil.test/steal",  # a server reads the host from here, not from Host (RFC 9112, 3.2.2)
        "https://evil.test/steal",
        "http://raw.test:PORT/steal",  # the tunnel's host, another scheme
        "https://raw.test:1/steal",  # ... another port
        "https://user@raw.test:PORT/steal",
        "https://[raw.test]:PORT/",  # no URL at all
        "*",
    ],
)
def test_inside_an_opened_tunnel_a_target_for_another_origin_is_a_400(server: RawServer, target: str) -> None:
    answer, records = _send_in_tunnel(
        server, f"GET {target} HTTP/1.1\r\nHost: raw.test:PORT\r\n\r\n".encode()
    )
    assert server.got == [] and _status(answer) == 400 and b"rule: request (target)" in answer
    (record,) = records
    assert (record.status, record.decision, record.rule) == (400, "deny", "request (target)")


def _credentialed_tunnel(tmp_path: Path, request: bytes) -> tuple[bytes, list[EgressRecord], list[str]]:
    """``request`` (``TARGET``: api.test's host and port) inside an opened tunnel to the real
    HTTPS server whose credential the proxy adds: what came back, the records, the paths the
    server was asked for."""
    with servers(tmp_path) as local:
        records: list[EgressRecord] = []
        proxy = EgressProxy(local.policy(), observer=records.append)
        assert proxy.ca_pem is not None
        ctx = ssl.create_default_context(cadata=proxy.ca_pem.decode())
        port = _loop.call(proxy.start_tcp())
        try:
            target = f"api.test:{local.https_port}"
            raw, head = _tunnel(port, target)
            assert head.startswith(b"HTTP/1.1 200"), head
            with raw, ctx.wrap_socket(raw, server_hostname="api.test") as client:
                client.sendall(request.replace(b"TARGET", target.encode()))
                answer = bytearray()
                with contextlib.suppress(ssl.SSLEOFError, ConnectionResetError):
                    while chunk := client.recv(65536):
                        answer += chunk
        finally:
            _loop.call(proxy.close())
        return bytes(answer), records, list(local.https_seen.paths)


def test_inside_an_opened_tunnel_another_host_in_the_target_never_gets_the_credential(tmp_path: Path) -> None:
    answer, records, paths = _credentialed_tunnel(
        tmp_path, b"GET http://evil.test/steal HTTP/1.1\r\nHost: TARGET\r\n\r\n"
    )
    assert paths == [] and _statuses(answer) == [400]
    assert [(r.status, r.rule, r.credential) for r in records] == [(400, "request (target)", "")]


def test_inside_an_opened_tunnel_its_own_origin_as_a_url_goes_as_a_path(tmp_path: Path) -> None:
    answer, records, paths = _credentialed_tunnel(
        tmp_path, b"GET https://TARGET/auth?y=1 HTTP/1.1\r\nHost: TARGET\r\nConnection: close\r\n\r\n"
    )
    assert _statuses(answer) == [200] and b"authorized=True" in answer and paths == ["/auth?y=1"]
    assert [(r.path, r.status, r.credential) for r in records] == [("/auth?y=1", 200, "api")]


def test_a_connect_inside_an_opened_tunnel_is_refused(server: RawServer) -> None:
    answer, records = _send_in_tunnel(
        server, b"CONNECT raw.test:PORT HTTP/1.1\r\nHost: raw.test:PORT\r\n\r\n"
    )
    assert server.got == [] and _status(answer) == 400 and b"rule: request (method)" in answer
    assert [(r.method, r.status, r.decision) for r in records] == [("CONNECT", 400, "deny")]


@pytest.mark.parametrize("target", ["http://[raw.test]:PORT/", "http://[::1:PORT/"])
def test_a_target_that_is_no_url_is_a_400_and_one_record(server: RawServer, target: str) -> None:
    answer, records = _send(server, f"GET {target} HTTP/1.1\r\nHost: raw.test\r\n\r\n".encode())
    assert server.got == [] and _statuses(answer) == [400]
    assert [(r.method, r.status, r.decision, r.rule) for r in records] == [("GET", 400, "deny", "request")]


def test_a_redirect_whose_location_is_no_url_is_a_502_and_one_record() -> None:
    raw = RawServer(answer=b"HTTP/1.1 302 Found\r\nLocation: http://[evil.test/\r\nContent-Length: 0\r\n\r\n")
    try:
        answer, records = _send(raw, b"GET http://raw.test:PORT/ HTTP/1.1\r\nHost: raw.test:PORT\r\n\r\n")
    finally:
        raw.close()
    assert _statuses(answer) == [502] and b"evil" not in answer
    assert [(r.method, r.status, r.decision, r.rule) for r in records] == [("GET", 502, "allow", "redirect")]


def _dechunked(body: bytes) -> tuple[bytes, int]:
    """A chunked body's bytes, and how many chunks carried them."""
    data, chunks = bytearray(), 0
    while True:
        size, _, body = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return bytes(data), chunks
        data += body[:n]
        body = body[n + 2 :]
        chunks += 1


def test_a_body_in_tiny_chunks_goes_whole_in_few_chunks() -> None:
    """20,000 chunks of one byte: all the bytes reach the server, joined into a few chunks
    (relayed piece by piece, such a body held the loop every sandbox's proxy shares)."""
    with contextlib.closing(RawServer(until=b"0\r\n\r\n")) as server:
        _tiny_chunks(server)


def _tiny_chunks(server: RawServer) -> None:
    sent = bytes(range(256)) * 78 + b"x" * 32
    body = b"".join(b"1\r\n%c\r\n" % b for b in sent) + b"0\r\n\r\n"
    answer, records = _send(
        server,
        b"POST http://raw.test:PORT/ HTTP/1.1\r\nHost: raw.test:PORT\r\nTransfer-Encoding: chunked\r\n\r\n"
        + body,
    )
    (wire,) = server.got
    got, chunks = _dechunked(wire.split(b"\r\n\r\n", 1)[1])
    assert _status(answer) == 200 and got == sent and chunks <= len(sent) // 1024 + 4
    assert [(r.status, r.bytes_out) for r in records] == [(200, len(sent))]


# A chunked body's trailer: header lines after its last chunk, which h11 parses in one go
# once their blank line comes. 12,000 ``a:b`` lines (60 KB, within the head's 64 KiB) held
# the loop every sandbox shares ~20 ms a message: h11 gets what came a bounded number of
# lines at a time, and a trailer past HEAD_LINES is refused like a head of as many lines.
LONG_TRAILER = b"a:b\r\n" * 12_000


class CountedByRole(load_h11().Connection):  # type: ignore[misc]
    """Any h11 connection (the proxy's side of a client's or of a server's), counting the
    line ends each role's connections were given to parse."""

    lines: ClassVar[dict[Any, int]] = {}
    pieces: ClassVar[dict[Any, int]] = {}  # how many times each role was given bytes

    def receive_data(self, data: bytes) -> None:
        CountedByRole.lines[self.our_role] = CountedByRole.lines.get(self.our_role, 0) + bytes(data).count(
            b"\n"
        )
        CountedByRole.pieces[self.our_role] = CountedByRole.pieces.get(self.our_role, 0) + 1
        super().receive_data(data)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[Any, int]:
    """The lines h11 was given, by its role: ``SERVER`` reads requests, ``CLIENT`` answers."""
    CountedByRole.lines = {}
    CountedByRole.pieces = {}
    monkeypatch.setattr(load_h11(), "Connection", CountedByRole)
    return CountedByRole.lines


def _chunked_post(trailer: bytes, body: bytes = b"5\r\nhello\r\n") -> bytes:
    head = b"POST http://raw.test:0/ HTTP/1.1\r\nHost: raw.test\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + body + b"0\r\n" + trailer + b"\r\n"


def _served(server: RawServer, request: bytes) -> tuple[bytes, list[EgressRecord]]:
    """``request`` (its port 0 made the server's), there whole at the proxy's first read."""
    records: list[EgressRecord] = []
    proxy = EgressProxy(_policy(server), observer=records.append)
    request = request.replace(b"raw.test:0/", b"raw.test:%d/" % server.port)

    async def serve() -> socket.socket:
        client, peer = await _arrived(request, end=True)
        await proxy.exchange.serve(client, tunnel=None)
        client.close()
        return peer

    try:
        answer = _received(_loop.call(serve()))
    finally:
        _loop.call(proxy.close())
    return answer, records


def test_a_request_trailer_of_too_many_lines_is_a_431_h11_parses_a_few_lines_of(
    server: RawServer, counted: dict[Any, int]
) -> None:
    """Head, body and trailer in the proxy's first read: h11 is given the head, then the
    rest a few lines at a time; a trailer past HEAD_LINES lines is a 431, before any byte
    of the request went to the server (its connection was opened, and is cut)."""
    answer, records = _served(server, _chunked_post(LONG_TRAILER))
    assert _statuses(answer) == [431] and b"a request trailer of more than 256 lines" in answer
    assert [(r.status, r.decision, r.rule, r.bytes_out) for r in records] == [
        (431, "deny", "request (size)", 0)
    ]
    assert b"".join(server.got) == b""
    assert counted[load_h11().SERVER] <= 2 * HEAD_LINES


def test_a_request_trailer_of_too_many_lines_inside_an_opened_tunnel(
    tmp_path: Path, counted: dict[Any, int]
) -> None:
    """The same inside a tunnel whose TLS the proxy opened, to a host it adds a credential for."""
    answer, records, paths = _credentialed_tunnel(
        tmp_path,
        b"POST /auth HTTP/1.1\r\nHost: TARGET\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n"
        + LONG_TRAILER
        + b"\r\n",
    )
    assert paths == [] and _statuses(answer) == [431] and b"rule: request (size)" in answer
    assert [(r.status, r.decision, r.rule, r.credential) for r in records] == [
        (431, "deny", "request (size)", "")
    ]
    assert counted[load_h11().SERVER] <= 2 * HEAD_LINES


def test_an_answer_trailer_of_too_many_lines_is_cut_h11_parses_a_few_lines_of(server: RawServer) -> None:
    """The same for a server's chunked answer: cut, and its trailer's lines never parsed."""
    answer, records, parsed = _answered_by(
        server,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n" + LONG_TRAILER + b"\r\n",
    )
    assert b"a:b" not in answer
    assert [(r.status, r.decision, r.rule, r.reason) for r in records] == [
        (
            502,
            "allow",
            "reply (size)",
            "the server answered 200, then an answer trailer of more than 256 lines",
        )
    ]
    assert parsed <= 2 * HEAD_LINES


SMALL_TRAILER = b"X-Checksum: 1234\r\nX-Count: 2\r\n"
LINES_OF_BODY = b"a\n" * 20_000  # a body's own line ends are bytes to relay, not lines to parse


def test_a_chunked_request_with_a_small_trailer_and_a_body_of_many_lines_passes(
    counted: dict[Any, int],
) -> None:
    with contextlib.closing(RawServer(until=b"0\r\n\r\n")) as server:
        body = b"%x\r\n%s\r\n" % (len(LINES_OF_BODY), LINES_OF_BODY)
        answer, records = _served(server, _chunked_post(SMALL_TRAILER, body=body))
        (wire,) = server.got
    assert _status(answer) == 200
    assert _dechunked(wire.split(b"\r\n\r\n", 1)[1])[0] == LINES_OF_BODY
    assert [(r.status, r.bytes_out) for r in records] == [(200, len(LINES_OF_BODY))]


def test_a_chunked_answer_with_a_small_trailer_and_a_body_of_many_lines_passes(server: RawServer) -> None:
    chunked = b"%x\r\n%s\r\n0\r\n%s\r\n" % (len(LINES_OF_BODY), LINES_OF_BODY, SMALL_TRAILER)
    answer, records, _ = _answered_by(
        server, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
    )
    assert _statuses(answer) == [200]
    assert _dechunked(answer.split(b"\r\n\r\n", 1)[1])[0] == LINES_OF_BODY
    assert [(r.status, r.bytes_in) for r in records] == [(200, len(LINES_OF_BODY))]


NEWLINES = b"\n" * 150_000  # a body of line ends only: each is a line to a parser of lines


def test_a_chunk_of_line_ends_goes_to_h11_whole_not_a_few_lines_at_a_time(counted: dict[Any, int]) -> None:
    """h11 takes a chunk's bytes as data, however many line ends they hold: they go to it
    as they came, not ``HEAD_LINES`` at a time (586 pieces of 256 bytes, each re-slicing
    what was left of the read: 9 MB/s, and 40-50 ms steps of the loop every sandbox shares)."""
    with contextlib.closing(RawServer(until=b"0\r\n\r\n")) as server:
        body = b"%x\r\n%s\r\n" % (len(NEWLINES), NEWLINES)
        answer, records = _served(server, _chunked_post(SMALL_TRAILER, body=body))
        (wire,) = server.got
    assert _status(answer) == 200
    assert _dechunked(wire.split(b"\r\n\r\n", 1)[1])[0] == NEWLINES
    assert [(r.status, r.bytes_out) for r in records] == [(200, len(NEWLINES))]
    assert CountedByRole.pieces[load_h11().SERVER] <= 8  # the head, a piece a read, the end


def test_pieces_of_one_read_let_the_other_connections_run(counted: dict[Any, int]) -> None:
    """Short chunks full of line ends: one read is many pieces of bounded lines to give h11
    (500 to 1,000 here, and 500 events), and the loop every sandbox's proxy shares serves
    the others every ``PIECES_PER_TURN`` of them, not only once the read is all given."""
    chunks = b"".join(b"ff\r\n%s\r\n" % (b"\n" * 255) for _ in range(500))
    server = RawServer(until=b"0\r\n\r\n")
    records: list[EgressRecord] = []
    proxy = EgressProxy(_policy(server), observer=records.append)
    seen: list[int] = []  # the pieces given so far, at each turn another connection had

    async def other() -> None:
        while True:
            await asyncio.sleep(0)
            seen.append(CountedByRole.pieces.get(load_h11().SERVER, 0))

    async def serve() -> socket.socket:
        request = _chunked_post(b"", body=chunks).replace(b"raw.test:0/", b"raw.test:%d/" % server.port)
        client, peer = await _arrived(request, end=True)
        others = asyncio.ensure_future(other())
        await proxy.exchange.serve(client, tunnel=None)
        others.cancel()
        client.close()
        return peer

    try:
        answer = _received(_loop.call(serve()))
    finally:
        _loop.call(proxy.close())
        server.close()
    assert _status(answer) == 200 and [r.bytes_out for r in records] == [500 * 255]
    assert seen[-1] >= 3 * PIECES_PER_TURN
    assert max(b - a for a, b in itertools.pairwise(seen)) <= PIECES_PER_TURN + 1


def test_an_answer_head_with_a_folded_line_is_a_502_h11_never_parses(server: RawServer) -> None:
    """h11 would join the folded line to the one before with a space (RFC 9112, 5.2), which
    carried a secret split there past a credential host's scrub: refused from any server,
    before h11 parses any of it."""
    answer, records, parsed = _answered_by(
        server,
        b"HTTP/1.1 200 OK\r\nX-Echo: Bearer Tok\r\n\t-Zq9xKp3LmW7vT2nR8sY4bQ6\r\nContent-Length: 2\r\n\r\nok",
    )
    assert _statuses(answer) == [502] and b"rule: reply (syntax)" in answer and b"Zq9x" not in answer
    assert [(r.status, r.decision, r.rule) for r in records] == [(502, "allow", "reply (syntax)")]
    assert parsed == 0


# -- what a spliced tunnel carries -------------------------------------------------------------


def _client_hello(name: str) -> bytes:
    """A real TLS ClientHello for ``name``, as a client's first bytes in a tunnel."""
    obj = ssl.create_default_context().wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname=name)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def _record(kind: int, body: bytes) -> bytes:
    return bytes([kind, 3, 3]) + len(body).to_bytes(2, "big") + body


PLAIN = b"\r\nSET key value\r\n"
# The start of a TLS server's answer to a ClientHello: a handshake record holding a ServerHello.
SERVER_HELLO = _record(22, b"\x02\x00\x00\x26\x03\x03" + b"\x00" * 32 + b"\x00\x13\x01\x00")
# A record header made up in front of plain text, a record as long as one may be: the client's
# framing alone cannot tell it from TLS, and a server that reads lines runs the second line.
FAKE_RECORD = _record(23, PLAIN.ljust(MAX_RECORD, b"A"))


class Counting:
    """A raw TCP server on 127.0.0.2 that takes one connection and keeps what it got, as it
    comes, until the connection's end (``ended``). Once its first bytes came it sends
    ``answer`` (by default the start of a TLS server's); ``b""``: it closes instead;
    ``None``: it never sends. ``probe``: after the end it sends on, a byte every 50 ms for
    up to 5 s, until one is refused (``refused``): the proxy's socket is closed, not only
    shut for writing (then it takes them)."""

    def __init__(self, answer: bytes | None = SERVER_HELLO, *, probe: bool = False) -> None:
        self.answer = answer
        self.probe = probe
        self.sock = socket.create_server(("127.0.0.2", 0))
        self.port = int(self.sock.getsockname()[1])
        self.got = b""
        self.ended = threading.Event()
        self.refused = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError), self.sock.accept()[0] as conn:
            answer = self.answer
            while chunk := conn.recv(65536):
                self.got += chunk
                if answer == b"":
                    break
                if answer is not None:
                    conn.sendall(answer)
                    answer = None
            if self.probe:
                self._probe(conn)
        self.ended.set()

    def _probe(self, conn: socket.socket) -> None:
        for _ in range(100):
            try:
                conn.sendall(b"?")
            except OSError:  # reset: the proxy's end is closed
                self.refused.set()
                return
            time.sleep(0.05)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)


@contextlib.contextmanager
def _spliced(
    server: Counting, records: list[EgressRecord], answer_timeout_s: float | None = None
) -> Iterator[tuple[EgressProxy, socket.socket]]:
    """A proxy that splices tunnels to ``server`` (raw.test), telling ``records``, and a
    tunnel through it; once done, the proxy closed and the server's connection ended."""
    proxy = EgressProxy(_policy(server), observer=records.append)
    if answer_timeout_s is not None:
        proxy.tunnels.answer_timeout_s = answer_timeout_s
    port = _loop.call(proxy.start_tcp())
    try:
        raw, head = _tunnel(port, f"raw.test:{server.port}")
        with raw:
            assert head.startswith(b"HTTP/1.1 200"), head
            yield proxy, raw
    finally:
        _loop.call(proxy.close())
        server.ended.wait(10)
        server.close()


def _ended(records: list[EgressRecord]) -> EgressRecord:
    """A spliced tunnel's record as it ended, after the one told as it opened."""
    opened, ended = records
    assert (opened.phase, ended.phase, ended.tunnel) == ("open", "end", opened.tunnel), records
    return ended


def _until_closed(raw: socket.socket, timeout_s: float = 5.0) -> tuple[bytes, bool]:
    """What came back through the tunnel, and whether the proxy closed it within ``timeout_s``."""
    raw.settimeout(timeout_s)
    got = bytearray()
    try:
        while chunk := raw.recv(65536):
            got += chunk
    except TimeoutError:
        return bytes(got), False
    except ConnectionResetError:  # closed with the client's bytes unread
        pass
    return bytes(got), True


def _send_on(raw: socket.socket, data: bytes) -> None:
    """``data`` into the tunnel, as far as the proxy takes it (it may have closed the tunnel)."""
    with contextlib.suppress(OSError):
        raw.sendall(data)


@pytest.mark.parametrize("apart", [False, True], ids=["one-send", "after-the-records-went"])
def test_plain_text_after_a_client_hello_never_reaches_the_server(apart: bool) -> None:
    """A real ClientHello for the CONNECT host, a TLS record, then a Redis inline command,
    to a server that answered as TLS servers do: the command never reaches it, the tunnel
    is closed and its record says why. Sent after the records reached the server, those
    went and it did not; sent with them, in one read of the proxy's, nothing of that read
    went. Before, only the first record was checked and the command went through."""
    server = Counting()
    records: list[EgressRecord] = []
    tls = _client_hello("raw.test") + _record(23, b"\x17" * 40)
    with _spliced(server, records) as (_, raw):
        if apart:
            raw.sendall(tls)
            wait_for(lambda: len(server.got) == len(tls), what="the TLS records to reach the server")
            raw.sendall(PLAIN)
        else:
            raw.sendall(tls + PLAIN)
        answer, closed = _until_closed(raw)
    assert PLAIN not in server.got and server.got in ((tls,) if apart else (b"", tls))
    assert closed and answer == (SERVER_HELLO if server.got else b"")  # the server answers a hello
    tunnel = _ended(records)
    assert (tunnel.method, tunnel.rule, tunnel.status) == ("CONNECT", "tls (records)", 200)
    assert "no TLS record" in tunnel.reason and tunnel.bytes_out == len(server.got)


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (b"-ERR unknown command\r\n", "no TLS"),  # a Redis: it reads the hello as a line
        (_client_hello("raw.test"), "no TLS"),  # an echo: a ClientHello back is no ServerHello
        (b"", "closed without answering"),
        (None, "did not answer the TLS ClientHello in 0.5 s"),
    ],
    ids=["an-error-line", "an-echo", "closes", "silent"],
)
def test_a_server_that_does_not_answer_as_tls_gets_the_client_hello_and_nothing_more(
    answer: bytes | None, why: str
) -> None:
    """A line-based server on an allowed port (a Redis, SMTP, memcached) gets a real
    ClientHello, then records whose header is made up and whose body is a command, then
    ``QUIT``: it gets the hello and nothing more, its answer goes nowhere, the tunnel is
    closed and its record says why. Before, the client's framing alone was checked: the
    made-up header went through, the server took it for a junk line, and ran the next."""
    server = Counting(answer)
    records: list[EgressRecord] = []
    hello = _client_hello("raw.test")
    with _spliced(server, records, answer_timeout_s=0.5) as (_, raw):
        raw.sendall(hello)
        wait_for(lambda: server.got, what="the hello to reach the server")
        _send_on(raw, FAKE_RECORD * 3 + b"QUIT")
        back, closed = _until_closed(raw)
    assert server.got == hello and back == b"" and closed
    tunnel = _ended(records)
    assert (tunnel.rule, tunnel.status, tunnel.bytes_out, tunnel.bytes_in) == (
        "tls (server)",
        200,
        len(hello),
        0,
    )
    assert why in tunnel.reason


def test_what_the_client_sends_before_the_server_answers_waits_unread_and_charged() -> None:
    """Bytes a client sends after its hello, before the server answered (TLS 1.3 early
    data; or anything), are not read: they wait in the client's stream, charged to the
    sandbox's buffer budget and no more than its own cap, then in the kernel's buffers.
    Nothing of them reaches a server that never answers, and closing gives them back."""
    server = Counting(None)
    records: list[EgressRecord] = []
    hello = _client_hello("raw.test")
    with _spliced(server, records, answer_timeout_s=3.0) as (proxy, raw):
        raw.sendall(hello)
        wait_for(lambda: server.got, what="the hello to reach the server")
        raw.settimeout(0.5)
        with contextlib.suppress(TimeoutError):  # until the kernel's buffers too are full
            for _ in range(256):
                raw.sendall(_record(23, b"e" * 16384))
        wait_for(lambda: proxy.gate.buffers.held >= _streams.CHUNK, what="the client's stream to fill")
        held = proxy.gate.buffers.held
        assert held <= _streams.CHUNK + 2 * _streams.MIN_READ, held  # its cap, a read, the hello
        assert server.got == hello
        back, closed = _until_closed(raw)
        assert back == b"" and closed
        wait_for(lambda: proxy.gate.buffers.held == 0, what="the held bytes given back", timeout_s=5)
    assert server.got == hello
    assert "did not answer the TLS ClientHello in 3 s" in _ended(records).reason


def test_a_record_header_a_read_ends_inside_waits_for_the_rest_of_it() -> None:
    """After a TLS server answered: the start of a header goes on only with the rest of it,
    and ``QUIT`` at a record's end (a command to a server that reads lines) closes the
    tunnel at once, unsent. Before, both went at once, and the tunnel stayed open."""
    server = Counting()
    records: list[EgressRecord] = []
    hello, record = _client_hello("raw.test"), _record(23, b"x" * 40)
    with _spliced(server, records) as (_, raw):
        raw.sendall(hello)
        assert raw.recv(len(SERVER_HELLO), socket.MSG_WAITALL) == SERVER_HELLO
        raw.sendall(record[:3])
        time.sleep(0.3)
        assert server.got == hello  # the header's start waits
        raw.sendall(record[3:])
        wait_for(lambda: server.got == hello + record, what="the whole record to reach the server")
        raw.sendall(b"QUIT")
        back, closed = _until_closed(raw)
    assert server.got == hello + record and back == b"" and closed
    tunnel = _ended(records)
    assert (tunnel.rule, tunnel.bytes_out) == ("tls (records)", len(hello + record))


async def _reset_then_close(raw: socket.socket, proxy: EgressProxy, turns: int) -> None:
    """The client's connection reset, then ``turns`` turns of the proxy's loop, then its close."""
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    raw.close()
    for _ in range(turns):
        await asyncio.sleep(0)
    await proxy.close()


def test_a_closed_proxy_closes_a_spliced_tunnels_server_connection_whenever_it_cuts_it() -> None:
    """``close`` cuts a spliced tunnel in whatever turn of the loop it comes after the client
    went away: the splice's cleanup too, while it waits for its pumps to end. The connection
    to the server is closed all the same. Before, a cut there skipped the close: the server's
    connection stayed open, and its socket was left to the garbage collector (an unclosed
    transport's ``ResourceWarning``, in whatever test ran then)."""
    hello = _client_hello("raw.test")
    for turns in range(16):
        server = Counting(probe=True)
        with _spliced(server, []) as (proxy, raw):
            raw.sendall(hello)
            assert raw.recv(len(SERVER_HELLO), socket.MSG_WAITALL) == SERVER_HELLO
            _loop.call(_reset_then_close(raw, proxy, turns))
        assert server.refused.is_set(), f"the server's connection outlived the proxy ({turns} turns)"


@pytest.mark.parametrize("version", ["TLSv1_2", "TLSv1_3"])
def test_a_real_tls_server_is_reached_through_a_spliced_tunnel(tmp_path: Path, version: str) -> None:
    """A TLS session of either version with a real server (its own certificate: the proxy
    splices, it opens nothing) carries an upload of 4 MiB and its answer."""
    size = 4 * 1024 * 1024
    with servers(tmp_path) as local:
        records: list[EgressRecord] = []
        proxy = EgressProxy(local.policy(credentials=()), observer=records.append)
        ctx = ssl.create_default_context(cafile=str(local.ca_file))
        ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion[version]
        port = _loop.call(proxy.start_tcp())
        try:
            raw, head = _tunnel(port, f"api.test:{local.https_port}")
            assert head.startswith(b"HTTP/1.1 200"), head
            with ctx.wrap_socket(raw, server_hostname="api.test") as tls:
                assert tls.version() == version.replace("_", ".")
                tls.sendall(b"POST /upload HTTP/1.1\r\nHost: api.test\r\nContent-Length: %d\r\n\r\n" % size)
                tls.sendall(b"u" * size)
                answer = bytearray()
                while not answer.endswith(b" bytes") and (chunk := tls.recv(65536)):
                    answer += chunk
        finally:
            _loop.call(proxy.close())
        assert local.https_seen.received == [size]
    assert answer.startswith(b"HTTP/1.") and answer.endswith(b"got %d bytes" % size), answer[-200:]
    tunnel = _ended(records)
    assert (tunnel.method, tunnel.sni, tunnel.status) == ("CONNECT", "api.test", 200)
    assert tunnel.bytes_out > size and tunnel.bytes_in > len(answer)


def _framed(stream: bytes, pieces: list[int]) -> tuple[list[bytes], str | None]:
    """``stream`` given to one ``Records`` in pieces of these sizes (the rest as the last):
    what it let go of each, and why it stopped, if it did."""
    records = Records()

    async def frame() -> tuple[list[bytes], str | None]:
        out: list[bytes] = []
        at = 0
        for size in [*pieces, len(stream)]:
            try:
                out.append(await records.framed(stream[at : at + size]))
            except NotTLS as err:
                return out, str(err)
            at += size
            if at >= len(stream):
                break
        return out, None

    return _loop.call(frame())


def _problems(stream: bytes, pieces: list[int]) -> str | None:
    return _framed(stream, pieces)[1]


def test_tls_records_are_followed_across_reads_however_they_are_cut() -> None:
    """Records span reads and a header may be split between two: cut at every place, a
    stream of records passes whole, and a header that is no record's is found where it comes."""
    stream = (
        _client_hello("raw.test") + _record(20, b"\x01") + _record(23, b"x" * MAX_RECORD) + _record(21, b"ab")
    )
    for cut in range(1, len(stream), 7):
        out, problem = _framed(stream, [cut])
        assert problem is None and b"".join(out) == stream, cut
    assert _framed(stream, [1] * 200)[1] is None  # byte by byte through the hello's header
    for bad in (
        _record(24, b"x"),
        b"GET / HTTP/1.1\r\n",
        _record(23, b""),
        _record(23, b"x" * (MAX_RECORD + 1)),
    ):
        for cut in (1, 3, 5, len(stream) - 2, len(stream) + 2):
            assert _problems(stream + bad, [cut]) is not None, (bad[:8], cut)


def test_a_header_a_read_ends_inside_goes_on_only_whole() -> None:
    """A read that ends inside a header lets go of what comes before it; the header goes
    with the read that completes it. A start already wrong (``QUIT``) stops at once."""
    record = _record(23, b"x" * 10)
    for cut in range(1, 5):
        assert _framed(record * 2, [len(record) + cut]) == ([record, record], None)
        assert _framed(record, [cut]) == ([b"", record], None)
    for start in (b"Q", b"QUIT", b"\x17\x02"):
        assert _framed(record + start, [len(record) + len(start)])[1] is not None, start
