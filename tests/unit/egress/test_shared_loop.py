"""One sandbox cannot take from the others what every sandbox's proxy shares: the event loop
thread they all run on (``egress/_loop.py``) and the host process's memory.

* A request head is bounded in lines before h11 parses any (``HEAD_LINES``): 12,500
  one-line headers within the 64 KiB cap took 14-31 ms of the shared loop each.
* A sandbox past its rate has its requests refused before they are read, and the
  connection closed: a flood of refused requests costs no parsing.
* What a sandbox's connections hold (received, not yet passed on) is bounded as a whole:
  past ``max_buffered`` they all stop reading, however many connections it holds.
* A sandbox's connections are accepted within a budget (a burst, then so many a second),
  and at most ``MAX_CONNECTIONS`` are held at once: past either they wait in its own
  socket's backlog, not on the loop nor in the host's descriptors.
"""

from __future__ import annotations

import contextlib
import gc
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stockade.egress import EgressProxy, NetworkPolicy, _loop
from stockade.egress._streams import Plain
from stockade.egress.proxy import ACCEPT_BURST, ACCEPTS_PER_S, ACCEPTS_PER_TURN, MAX_CONNECTIONS
from stockade.types import EgressRecord
from tests.conftest import wait_for

HEAD_LINES = 256  # a request head's lines at most (``_feed.HEAD_LINES``)
DENIED = b"GET http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\n\r\n"


class Scripted:
    """A client connection whose bytes are all there at once: ``on_send`` runs at the
    proxy's first answer (the proxy's side of a ``Stream``, without a socket)."""

    def __init__(self, data: bytes, on_send: Callable[[], None] | None = None) -> None:
        self.data = data
        self.sent = bytearray()
        self.on_send = on_send

    async def recv(self) -> bytes:
        data, self.data = self.data, b""
        return data

    async def send(self, data: bytes) -> None:
        self.sent += data
        then, self.on_send = self.on_send, None
        if then is not None:
            then()

    def release(self) -> None:
        pass  # nothing it hands out is held on its side

    def close(self) -> None:
        pass

    def gone(self) -> bool:
        return False

    def statuses(self) -> list[int]:
        return [int(s) for s in re.findall(rb"HTTP/1\.1 (\d{3}) ", bytes(self.sent))]


def served(policy: NetworkPolicy, *clients: Scripted) -> list[EgressRecord]:
    """Each client served by one proxy, in turn, to its end; the records, in order."""
    records: list[EgressRecord] = []
    proxy = EgressProxy(policy, observer=records.append)

    async def serve() -> None:
        for client in clients:
            await proxy.exchange.serve(client, tunnel=None)

    try:
        _loop.call(serve())
    finally:
        _loop.call(proxy.close())
    return records


def head(lines: int) -> bytes:
    """A request to a host no rule allows, whose head has ``lines`` lines (``a:b`` headers)."""
    return b"GET http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\n" + b"a:b\r\n" * (lines - 3) + b"\r\n"


def test_a_head_of_too_many_lines_is_a_431_before_it_is_parsed() -> None:
    """1,000 lines in 6 KB: far within the 64 KiB cap, but a 431, never judged (h11 would
    have made 1,000 headers of it first). A head within the lines is judged as before."""
    many, few = Scripted(head(1000)), Scripted(head(HEAD_LINES))
    records = served(NetworkPolicy(), many, few)
    assert many.statuses() == [431] and b"more than 256 lines" in many.sent
    assert few.statuses() == [403]
    assert [(r.status, r.rule) for r in records] == [(431, "request (size)"), (403, "allow (no rule)")]


class Trickle(Scripted):
    """A client that sends ``data`` a few bytes at a time; how many reads the proxy made."""

    def __init__(self, data: bytes) -> None:
        super().__init__(b"")
        self.pieces = [data[i : i + 7] for i in range(0, len(data), 7)]
        self.reads = 0

    async def recv(self) -> bytes:
        self.reads += 1
        return self.pieces.pop(0) if self.pieces else b""


def test_a_head_of_too_many_lines_in_pieces_is_refused_as_its_lines_come() -> None:
    """Lines counted across reads too: refused before the head ended."""
    client = Trickle(head(HEAD_LINES + 50))
    served(NetworkPolicy(), client)
    assert client.statuses() == [431] and client.pieces


def test_past_its_rate_a_request_is_refused_on_its_first_bytes_unread() -> None:
    """A sandbox past its rate: the next request is a 429 as soon as it begins, its head
    never read (it was read to its end, and parsed, before the 429)."""
    first, second = Scripted(DENIED), Trickle(head(200))
    records = served(NetworkPolicy(max_requests_per_minute=1), first, second)
    assert first.statuses() == [403] and second.statuses() == [429]
    assert second.reads == 1
    assert (records[-1].status, records[-1].rule) == (429, "max_requests_per_minute")


def test_request_heads_count_against_the_bytes_per_minute() -> None:
    """Refused requests' heads are bytes the sandbox sent too: past the budget, a 429."""
    big = head(200)  # about 1.1 KB
    clients = [Scripted(big) for _ in range(5)]
    served(NetworkPolicy(max_bytes_per_minute=len(big) * 5 // 2), *clients)
    assert [c.statuses() for c in clients] == [[403], [403], [403], [429], [429]]


# -- the connections a sandbox opens --------------------------------------------------------

CHURNER = """
import socket, sys, time
path, seconds = sys.argv[1], float(sys.argv[2])
count, start = 0, time.monotonic()
while time.monotonic() - start < seconds:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(seconds)  # a connect() waits while the proxy's backlog is full
    try:
        sock.connect(path)
        count += 1
    except OSError:
        pass
    sock.close()
print(count, time.monotonic() - start)
"""


def unix_connection(path: str) -> socket.socket | None:
    """A connection to ``path``; ``None`` while its backlog is full."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(10)
    try:
        sock.connect(path)
    except BlockingIOError:
        sock.close()
        return None
    return sock


def denied_answer(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(DENIED.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n", 1))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_a_sandbox_that_churns_connections_gets_its_budget_of_accepts_and_no_more(tmp_path: Path) -> None:
    """A process opens and closes connections to one sandbox's socket at full speed, sending
    nothing (no request: the per-minute limits never see them). Every accepted connection
    costs the loop all sandboxes share a task: accepted as fast as they came (7.7k a second
    in an outside test), they made another sandbox's requests 20-40 times slower. Now the
    churner's connects are what the budget accepts (a burst, then ``ACCEPTS_PER_S`` a second)
    and what its own backlog holds; the other sandbox is served meanwhile, and the churned
    one again once it stops."""
    churned, neighbour = EgressProxy(NetworkPolicy()), EgressProxy(NetworkPolicy())
    path = str(tmp_path / "proxy.sock")
    _loop.call(churned.start(path))
    port = _loop.call(neighbour.start_tcp())
    try:
        churner = subprocess.Popen(
            [sys.executable, "-c", CHURNER, path, "1.5"], stdout=subprocess.PIPE, text=True
        )
        answers = [denied_answer(port) for _ in range(20)]
        out, _ = churner.communicate(timeout=60)
        connects, seconds = int(out.split()[0]), float(out.split()[1])
        backlog = MAX_CONNECTIONS + 1  # Linux queues one past a Unix socket's backlog
        assert connects <= ACCEPT_BURST + ACCEPTS_PER_S * seconds + ACCEPTS_PER_TURN + backlog, (
            f"{connects} connects in {seconds:.2f} s"
        )
        assert all(a.startswith(b"HTTP/1.1 403 ") for a in answers)
        # The listener rested, then took up again: the churner's backlog is drained, a
        # connect finds room (refused at once while it is full: a socket with a timeout).
        sock = wait_for(lambda: unix_connection(path), what="room in the churned socket's backlog")
        assert sock is not None
        with sock:
            sock.sendall(DENIED)
            assert sock.recv(65536).startswith(b"HTTP/1.1 403 ")
    finally:
        _loop.call(churned.close())
        _loop.call(neighbour.close())


def test_a_burst_of_connections_within_the_budget_is_accepted_at_once() -> None:
    """A package manager opens 30-50 connections at once: within the burst, none waits."""
    proxy = EgressProxy(NetworkPolicy(max_requests_per_minute=1000))
    port = _loop.call(proxy.start_tcp())
    clients = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(48)]
    try:
        for sock in clients:
            sock.sendall(DENIED)
        assert all(sock.recv(65536).startswith(b"HTTP/1.1 403 ") for sock in clients)
    finally:
        for sock in clients:
            sock.close()
        _loop.call(proxy.close())


def test_connections_past_the_limit_wait_in_the_backlog_and_are_served_in_turn() -> None:
    """A sandbox opens more connections at once than its proxy holds (``MAX_CONNECTIONS``,
    as the host's descriptors for it): those past them wait in its socket's backlog,
    unanswered and open, and each is served once one before it has ended. Before, each was
    accepted and answered 503 at once: of 200 connections, 69 failed."""
    proxy = EgressProxy(NetworkPolicy(max_requests_per_minute=1000))
    port = _loop.call(proxy.start_tcp())
    request = DENIED.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n", 1)
    try:
        with contextlib.ExitStack() as held:
            clients = [
                held.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
                for _ in range(MAX_CONNECTIONS + 72)
            ]
            clients[-1].sendall(request)
            clients[-1].settimeout(1)
            with pytest.raises(TimeoutError):  # neither answered nor closed: it waits its turn
                clients[-1].recv(65536)
            clients[-1].settimeout(10)
            answers = []
            for sock in clients:
                if sock is not clients[-1]:
                    sock.sendall(request)
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
                answers.append(answer.split(b"\r\n", 1)[0])
                sock.close()  # its end lets the next one in
        assert set(answers) == {answers[0]} and answers[0].startswith(b"HTTP/1.1 403 "), sorted(set(answers))
    finally:
        _loop.call(proxy.close())


# -- the memory a sandbox's connections hold -------------------------------------------------


class Flooding:
    """A local server that takes connections, each in a thread of its own (``_answer``), and
    sends each without end what it was made with until stopped or closed."""

    def __init__(self, chunk: bytes) -> None:
        self.chunk = chunk
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._serve, daemon=True)]
        self.threads[0].start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.threads.append(threading.Thread(target=self._answer, args=(conn,), daemon=True))
            self.threads[-1].start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            self._flood(conn)

    def _flood(self, conn: socket.socket) -> None:
        conn.settimeout(0.05)
        while not self.stop.is_set():
            try:
                conn.send(self.chunk)
            except TimeoutError:
                continue
            except OSError:  # the proxy closed it
                return

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes its accept
        self.sock.close()
        for thread in list(self.threads):
            thread.join(10)


class Stalled(Flooding):
    """A server that sends without end and never reads (its receive buffer kept small); its
    first bytes begin a TLS ServerHello, as a tunnel's server must answer."""

    def __init__(self) -> None:
        super().__init__(b"\x16\x03\x03\x40\x00\x02" + b"x" * (65536 - 6))

    def _answer(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        super()._answer(conn)


@pytest.fixture
def stalled() -> Iterator[Stalled]:
    server = Stalled()
    try:
        yield server
    finally:
        server.close()


def hello() -> bytes:
    """A TLS ClientHello for ``svc.test`` (what a tunnel must begin with)."""
    obj = ssl.create_default_context().wrap_bio(
        ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname="svc.test"
    )
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


# What a tunnel's client sends after its hello: TLS records (application data), 64 KiB and a little.
RECORDS = (b"\x17\x03\x03\x40\x00" + b"y" * 16384) * 4


def held_by_streams() -> tuple[int, int, int]:
    """(bytes held, streams open, streams not reading) over every open stream of the proxies
    in this process: received and not yet read, and written and not yet sent."""

    async def look() -> tuple[int, int, int]:
        held = count = paused = 0
        for obj in gc.get_objects():
            if isinstance(obj, Plain) and obj.transport is not None and not obj.transport.is_closing():
                held += len(obj._data) + obj.transport.get_write_buffer_size()
                count += 1
                paused += obj._reading_paused
        return held, count, paused

    return _loop.call(look())


def test_tunnels_where_neither_side_reads_hold_at_most_the_sandboxs_budget(stalled: Stalled) -> None:
    """Eight tunnels to a server that sends and never reads, from a client that sends and
    never reads: once every stream stopped reading, what the proxy holds is its budget (1 MiB
    here) and a little; each stream's own cap alone let them hold ~0.9 MiB per tunnel. Once
    they close, the budget is whole again."""
    budget = 1024 * 1024
    policy = NetworkPolicy(
        allow_hosts=(f"svc.test:{stalled.port}",), resolve={"svc.test": ("127.0.0.1",)},
        allow_addresses=("127.0.0.1/32",),
    )  # fmt: skip
    proxy = EgressProxy(policy, max_buffered=budget)
    port = _loop.call(proxy.start_tcp())
    clients: list[socket.socket] = []
    stop = threading.Event()
    try:
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"CONNECT svc.test:%d HTTP/1.1\r\nHost: svc.test\r\n\r\n" % stalled.port)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            sock.sendall(hello())
            clients.append(sock)

        def send() -> None:
            left = [memoryview(RECORDS) for _ in clients]  # each tunnel's records, sent on where cut
            for sock in clients:
                sock.settimeout(0.01)
            while not stop.is_set():
                for i, sock in enumerate(clients):
                    with contextlib.suppress(OSError):
                        left[i] = left[i][sock.send(left[i]) :] or memoryview(RECORDS)

        threading.Thread(target=send, daemon=True).start()

        def stopped() -> tuple[int, int, int] | None:
            found = held_by_streams()
            return found if found[1] >= 8 and found[2] == found[1] else None

        state = wait_for(stopped, what="every stream of the tunnels to stop reading", timeout_s=60)
        assert state is not None
        held, streams, _ = state
        assert held <= budget + streams * 68 * 1024, (held, streams)  # and a transport's 64 KiB each
        stop.set()
        for sock in clients:
            sock.close()
        wait_for(lambda: proxy.gate.buffers.held == 0, what="the tunnels' bytes given back", timeout_s=30)
    finally:
        stop.set()
        for sock in clients:
            sock.close()
        _loop.call(proxy.close())


def test_a_tunnel_whose_client_left_while_its_server_stopped_reading_gives_its_bytes_back(
    stalled: Stalled,
) -> None:
    """The pump toward a server that no longer reads waits on it; the client leaving (a
    reset) ended the other way only, and that pump waited for ever, holding the sandbox's
    buffer budget with it (CI run 164: 30 s and still held)."""
    policy = NetworkPolicy(
        allow_hosts=(f"svc.test:{stalled.port}",), resolve={"svc.test": ("127.0.0.1",)},
        allow_addresses=("127.0.0.1/32",),
    )  # fmt: skip
    proxy = EgressProxy(policy, max_buffered=1024 * 1024)
    port = _loop.call(proxy.start_tcp())
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"CONNECT svc.test:%d HTTP/1.1\r\nHost: svc.test\r\n\r\n" % stalled.port)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(hello())
        sock.settimeout(0.2)
        with contextlib.suppress(TimeoutError):  # until the proxy stops taking: its writes wait
            while True:
                sock.sendall(RECORDS)
        wait_for(lambda: proxy.gate.buffers.held > 0, what="the proxy to hold the tunnel's bytes")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # a reset
        sock.close()
        wait_for(lambda: proxy.gate.buffers.held == 0, what="the tunnel's bytes given back", timeout_s=5)
    finally:
        _loop.call(proxy.close())


BODY = b"x" * 65536  # what ``Endless`` sends, made once: the test measures the proxy's memory


class Endless(Flooding):
    """An HTTP server whose every answer is a body of 1 GiB, sent as fast as it is taken, once
    ``requests`` requests have come: a sandbox's budget spent stops its proxy reading from every
    one of its connections, so an answer that began early could keep a later request from ever
    reaching the server (CI 169)."""

    def __init__(self, requests: int) -> None:
        self.expected, self.arrived = requests, 0
        self.arrival = threading.Lock()
        self.all_in = threading.Event()
        super().__init__(BODY)

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                more = conn.recv(4096)
                if not more:
                    return
                head += more
            with self.arrival:
                self.arrived += 1
                if self.arrived >= self.expected:
                    self.all_in.set()
            self.all_in.wait(10)
            with contextlib.suppress(OSError):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (1 << 30))
            self._flood(conn)

    def close(self) -> None:
        self.all_in.set()
        super().close()


def test_answers_nobody_reads_hold_at_most_the_sandboxs_budget_all_copies_included() -> None:
    """Sixteen requests for a fast answer of 1 GiB whose client never reads: the proxy's
    memory grows (tracemalloc: every copy, not only what its budget counts) by the budget
    (1 MiB here) and a little per connection. Before, the budget counted a connection's
    unread bytes and its paused writes only: the copies on the way between (the read passed
    on, h11's piece, the body joined) were ~0.75 MiB per connection more, 13 MiB here."""
    budget, connections = 1024 * 1024, 16
    server = Endless(requests=connections)
    policy = NetworkPolicy(
        allow_hosts=(f"up.test:{server.port}",), resolve={"up.test": ("127.0.0.1",)},
        allow_addresses=("127.0.0.1/32",),
    )  # fmt: skip
    proxy = EgressProxy(policy, max_buffered=budget)
    port = _loop.call(proxy.start_tcp())
    clients: list[socket.socket] = []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(connections):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"GET http://up.test:%d/big HTTP/1.1\r\nHost: up.test\r\n\r\n" % server.port)
            clients.append(sock)
        # Asked of the server, not of the proxy's streams (a look through every object of the
        # process, on the proxy's loop). In CI runs 169 and 170 not every request had come
        # within 10 s (cause not found; never alone): past 30 s the answers of those that came
        # flow all the same (``Endless``), and the bound must hold for them.
        server.all_in.wait(30)
        assert server.arrived >= 1, "no request reached the server"
        grown = 0
        deadline = time.monotonic() + 3  # the answers keep coming: the most held while they do
        while time.monotonic() < deadline:
            grown = max(grown, tracemalloc.get_traced_memory()[0] - before)
            time.sleep(0.01)
        # and a little per connection (its objects, a socket's write buffer under its mark),
        # and the loop thread's one receive buffer (256 KiB, made at its first read)
        assert grown <= budget + 256 * 1024 + connections * 64 * 1024, f"{grown / 2**20:.1f} MiB held"
    finally:
        tracemalloc.stop()
        for sock in clients:
            sock.close()
        _loop.call(proxy.close())
        server.close()
