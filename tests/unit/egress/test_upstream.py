"""The proxy's connections to servers, kept between one sandbox's requests (egress/_upstream.py).

A server of the test's own on 127.0.0.4 counts the connections it accepts and which are
still open, and answers with keep-alive unless told to close without saying so.
"""

from __future__ import annotations

import http.server
import statistics
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from stockade.egress import EgressProxy, NetworkPolicy, _loop
from stockade.egress._upstream import Pool
from stockade.types import EgressRecord
from tests.conftest import wait_for

ADDRESS = "127.0.0.4"


class Counting(http.server.ThreadingHTTPServer):
    daemon_threads = True
    accepted = 0
    open = 0
    close_silently = False  # end each connection after its answer, without "Connection: close"
    # What a connection's second request gets: "" an answer, "drop" none (the connection is
    # closed unanswered, as by a server's idle timeout racing the request), "408" that status.
    on_second = ""
    requests = 0


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Counting

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        self.server.accepted += 1
        self.server.open += 1

    def finish(self) -> None:
        super().finish()
        self.server.open -= 1

    def _answer(self) -> None:
        self.server.requests += 1
        self.served = getattr(self, "served", 0) + 1
        if self.served == 2 and self.server.on_second == "drop":
            self.close_connection = True
            return
        if self.served == 2 and self.server.on_second == "408":
            self.send_response(408)
            self.send_header("Content-Length", "0")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else f"{self.command} {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if self.server.close_silently:
            self.close_connection = True

    do_GET = do_POST = _answer


@pytest.fixture
def server() -> Iterator[Counting]:
    httpd = Counting((ADDRESS, 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


class Proxy:
    """One sandbox's proxy, on a TCP port, with its records."""

    def __init__(self, server: Counting) -> None:
        self.port = server.server_address[1]
        policy = NetworkPolicy(
            allow_hosts=(f"up.test:{self.port}",),
            allow_addresses=(f"{ADDRESS}/32",),
            resolve={"up.test": (ADDRESS,)},
        )
        self.records: list[EgressRecord] = []
        self.proxy = EgressProxy(policy, observer=self.records.append)
        url = f"http://127.0.0.1:{_loop.call(self.proxy.start_tcp())}"
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": url}))

    def get(self, path: str, data: bytes | None = None, method: str | None = None) -> bytes:
        """One request on a new client connection (as urllib makes them)."""
        request = urllib.request.Request(f"http://up.test:{self.port}{path}", data=data, method=method)
        with self.opener.open(request, timeout=10) as answer:
            body: bytes = answer.read()
        return body

    def close(self) -> None:
        _loop.call(self.proxy.close())


@pytest.fixture
def proxies(server: Counting) -> Iterator[list[Proxy]]:
    made = [Proxy(server), Proxy(server)]
    try:
        yield made
    finally:
        for proxy in made:
            proxy.close()


def test_a_sandboxs_requests_to_one_server_share_a_connection_and_each_is_recorded(
    server: Counting, proxies: list[Proxy]
) -> None:
    proxy = proxies[0]
    bodies = [proxy.get(f"/page/{i}") for i in range(3)]
    assert bodies == [f"GET /page/{i}".encode() for i in range(3)]
    assert server.accepted == 1
    wait_for(lambda: len(proxy.records) == 3, what="a record of each request")  # made after the answer
    assert [(r.path, r.status, r.bytes_in) for r in proxy.records] == [
        (f"/page/{i}", 200, len(bodies[i])) for i in range(3)
    ]


def test_no_connection_is_shared_between_sandboxes(server: Counting, proxies: list[Proxy]) -> None:
    for proxy in proxies:
        proxy.get("/a")
        proxy.get("/b")
    assert server.accepted == 2


def test_a_request_with_a_body_gets_a_connection_of_its_own(server: Counting, proxies: list[Proxy]) -> None:
    proxy = proxies[0]
    proxy.get("/first")
    assert proxy.get("/upload", data=b"x" * 100) == b"x" * 100
    assert server.accepted == 2  # the body never goes over a kept connection (it could not be sent twice)
    wait_for(lambda: len(proxy.records) == 2, what="a record of each request")
    assert proxy.records[-1].bytes_out == 100


def test_a_connection_the_server_closed_is_replaced_without_the_client_noticing(
    server: Counting, proxies: list[Proxy]
) -> None:
    server.close_silently = True
    proxy = proxies[0]
    assert [proxy.get(f"/{i}") for i in range(4)] == [f"GET /{i}".encode() for i in range(4)]
    assert server.accepted == 4
    wait_for(lambda: len(proxy.records) == 4, what="a record of each request")
    assert [r.status for r in proxy.records] == [200] * 4  # one record per request, retries or not


def test_kept_connections_close_when_idle_and_when_the_sandbox_ends(
    server: Counting, proxies: list[Proxy]
) -> None:
    first, second = proxies
    first.proxy.exchange.upstreams = Pool(idle_s=0.2)
    first.get("/a")
    wait_for(lambda: server.open == 0, what="the idle connection closed after idle_s", timeout_s=5)
    second.get("/b")
    assert server.open == 1
    second.close()
    wait_for(lambda: server.open == 0, what="the kept connection closed with its proxy", timeout_s=5)
    assert len(second.proxy.exchange.upstreams) == 0


def test_a_kept_connection_waits_for_no_delayed_ack(server: Counting, proxies: list[Proxy]) -> None:
    """The test's server writes an answer's head and body apart, with Nagle on (as
    http.server does): on a kept connection whose ACKs the kernel delays, the body would
    wait 40 ms for the head's ACK. The proxy asks for quick ACKs: no request waits that."""
    proxy = proxies[0]
    took = []
    for _ in range(9):
        started = time.perf_counter()
        proxy.get("/quick")
        took.append(time.perf_counter() - started)
    assert server.accepted == 1
    assert statistics.median(took) < 0.030, took


@pytest.mark.parametrize("second", ["drop", "408"])
def test_a_kept_connection_the_server_ends_as_it_is_used_is_replaced_once(
    server: Counting, proxies: list[Proxy], second: str
) -> None:
    """The server ends a kept connection just as the proxy sends on it (it closes it
    unanswered, or says 408): the request goes again, on a new connection, and the client
    sees one answer; the trail one request."""
    server.on_second = second
    proxy = proxies[0]
    assert proxy.get("/one") == b"GET /one"
    assert proxy.get("/two") == b"GET /two"
    assert server.accepted == 2 and server.requests == 3
    wait_for(lambda: len(proxy.records) == 2, what="a record of each request")
    assert [(r.path, r.status) for r in proxy.records] == [("/one", 200), ("/two", 200)]


def test_a_post_never_goes_over_a_kept_connection(server: Counting, proxies: list[Proxy]) -> None:
    """Not idempotent: were the kept connection closed under it, it could not be sent again."""
    server.on_second = "drop"
    proxy = proxies[0]
    proxy.get("/one")
    assert proxy.get("/form", data=b"", method="POST") == b"POST /form"
    assert server.accepted == 2 and server.requests == 2
