"""What a client may hold of ``stockade serve`` before it says who it is, and for how long:
the real server (uvicorn) on a real socket, its limits made short by its options.

* A ``/v1`` request without a token the service knows is answered 401 from its headers, before
  a byte of its body is read, and its connection closed (a client without a token held ~15
  MiB of the server's memory per connection, for as long as it liked).
* A body has a deadline, for tenants too: a stalled one is 408 and its connection closed.
* A connection must send a request's head within the head timeout (idle ones, and heads sent a
  line at a time, held the server's file descriptors until it had none left).
* One address holds at most its share of the connection cap: one more from it is refused at
  once. At the cap, the connection that has waited longest for a request's head is closed for
  a new one, so a tenant gets in (connections from one address that sent heads a line a
  second, opened again as they were closed, held the cap and kept every tenant out).
* Requests pipelined on one connection whose answers are never read wait in the client's own
  socket: the server reads only ~64 KiB ahead of the request it answers (it took 855 MiB of them
  in 15 s, held until the connection closed). Connections that do so from several addresses
  give way at the cap to a tenant, as idle ones do (they held it: their heads had come, and the
  next answer waited for ever for room in the socket).
* A token a client puts in a request's query is never written to the access log (``GET
  /ui/login?key=stk_...`` was answered 200, and its line logged the token whole)."""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from tests.conftest import wait_for
from tests.integration.service_env import Server, Tokens, write_tenants

HEAD_TIMEOUT_S = 3.0
BODY_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 8
PER_ADDRESS = 4
MiB = 1024 * 1024
BODIES_MB = 4  # acme's request bodies held at once


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens]]:
    folder = tmp_path_factory.mktemp("service")
    tenants, tokens = write_tenants(folder, acme_quotas={"bodies_mb": BODIES_MB})
    limits = [
        "--head-timeout", str(HEAD_TIMEOUT_S), "--keep-alive-timeout", "1",
        "--max-connections", str(MAX_CONNECTIONS), "--max-connections-per-address", str(PER_ADDRESS),
        "--body-timeout", str(BODY_TIMEOUT_S), "--min-body-rate", "1024",
    ]  # fmt: skip
    server = Server(tenants, f"sqlite:///{folder / 'service.db'}", folder, extra=limits)
    try:
        yield server, tokens
    finally:
        server.stop()
    assert "Traceback" not in server.output(), server.output()[-3000:]


@contextlib.contextmanager
def connection(
    server: Server, *, timeout_s: float = 10.0, source: str = "127.0.0.1"
) -> Iterator[socket.socket]:
    """A connection to ``server`` from ``source`` (any of 127/8: this machine's on Linux)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout_s, (source, 0)) as sock:
        yield sock


def head(path: str, *, length: int | None, token: str | None = None) -> bytes:
    """A POST's head: its body ``length`` bytes long, or chunked (None)."""
    lines = [f"POST {path} HTTP/1.1", "Host: stockade", "Content-Type: application/json",
             f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"]  # fmt: skip
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer(sock: socket.socket) -> bytes:
    """All the server sends until it closes the connection (``socket.timeout`` if it does not)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def closed_within(sock: socket.socket, seconds: float) -> float:
    """How long the server took to close ``sock`` (it sends nothing meanwhile)."""
    started = time.monotonic()
    sock.settimeout(seconds)
    assert answer(sock) == b""
    return time.monotonic() - started


@pytest.mark.parametrize("token", [None, "stk_notatoken_0123456789abcdef"])
def test_a_request_without_a_known_token_is_refused_before_its_body_is_sent(
    service: tuple[Server, Tokens], token: str | None
) -> None:
    server, _ = service
    with connection(server) as sock:
        sock.sendall(head("/v1/sandboxes", length=15 * MiB, token=token))  # and not a byte of it
        refused = answer(sock)
    status, _, rest = refused.partition(b"\r\n")
    assert status == b"HTTP/1.1 401 Unauthorized"
    assert b"connection: close" in rest.lower()
    assert b'"error": "AuthenticationError"' in rest


def test_a_tenants_stalled_body_is_cut_with_408(service: tuple[Server, Tokens]) -> None:
    server, tokens = service
    with connection(server) as sock:
        started = time.monotonic()
        sock.sendall(head("/v1/sandboxes", length=MiB, token=tokens.acme) + b'{"tier": ')  # then nothing
        cut = answer(sock)
    assert cut.startswith(b"HTTP/1.1 408 ")
    assert b'"error": "RequestTimeout"' in cut
    assert time.monotonic() - started < BODY_TIMEOUT_S + 3


def test_a_connection_that_sends_nothing_is_closed_within_the_head_timeout(
    service: tuple[Server, Tokens],
) -> None:
    server, _ = service
    with connection(server) as sock:
        assert closed_within(sock, HEAD_TIMEOUT_S + 5) < HEAD_TIMEOUT_S + 2


def test_a_head_sent_a_line_at_a_time_is_closed_within_the_head_timeout(
    service: tuple[Server, Tokens],
) -> None:
    server, _ = service
    with connection(server) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: stockade\r\n")
        with contextlib.suppress(OSError):  # the server closes it meanwhile
            for n in range(int(HEAD_TIMEOUT_S * 4)):
                time.sleep(0.5)
                sock.sendall(f"X-Line-{n}: a\r\n".encode())
        sock.settimeout(HEAD_TIMEOUT_S + 5)
        with contextlib.suppress(ConnectionResetError):
            assert answer(sock) == b""
    assert time.monotonic() - started < HEAD_TIMEOUT_S + 2


def test_an_address_past_its_share_is_refused_and_idle_connections_give_way_to_a_tenant(
    service: tuple[Server, Tokens],
) -> None:
    server, tokens = service
    with contextlib.ExitStack() as held:
        # the cap, held by idle connections from two addresses, each its share
        idle = [
            held.enter_context(connection(server, source=source))
            for source in ["127.0.0.2"] * PER_ADDRESS + ["127.0.0.3"] * PER_ADDRESS
        ]
        with connection(server, timeout_s=2, source="127.0.0.2") as extra:
            refused = answer(extra)  # at once, asked nothing
        assert refused == b"" or refused.startswith(b"HTTP/1.1 503 "), refused
        # a tenant on another address gets in: the connection idle longest is closed for it
        with connection(server, source="127.0.0.4") as sock:
            lines = ["GET /v1/sandboxes HTTP/1.1", "Host: stockade", f"Authorization: Bearer {tokens.acme}"]
            sock.sendall(("\r\n".join([*lines, "Connection: close"]) + "\r\n\r\n").encode())
            assert answer(sock).startswith(b"HTTP/1.1 200 ")
        assert answer(idle[0]) == b""


def refused_for_bodies(answered: bytes) -> bool:
    status, _, rest = answered.partition(b"\r\n")
    return (
        status == b"HTTP/1.1 429 Too Many Requests"
        and b"connection: close" in rest.lower()
        and b'"quota": "bodies_mb"' in rest
    )


def test_a_tenants_bodies_held_at_once_are_capped_and_its_next_body_refused_from_its_headers(
    service: tuple[Server, Tokens],
) -> None:
    server, tokens = service
    with connection(server) as held:
        # one body declares 3 of acme's 4 MiB and comes slowly (its deadline is far off)
        held.sendall(head("/v1/sandboxes", length=3 * MiB, token=tokens.acme) + b" " * 65536)
        # the next that declares 2 MiB is refused from its headers, at once, not a byte read
        with connection(server) as sock:
            sock.sendall(head("/v1/sandboxes", length=2 * MiB, token=tokens.acme))
            assert refused_for_bodies(answer(sock))
        # one over the whole share is told so: it never fits
        with connection(server) as sock:
            sock.sendall(head("/v1/sandboxes", length=5 * MiB, token=tokens.acme))
            refused = answer(sock)
            assert refused_for_bodies(refused) and b"alone" in refused
        # another tenant's share is its own
        with connection(server) as sock:
            sock.sendall(head("/v1/sandboxes", length=2 * MiB, token=tokens.other) + b"x" * (2 * MiB))
            assert answer(sock).startswith(b"HTTP/1.1 400 ")
    # once the slow one has gone, acme's 2 MiB are taken (and found not to be JSON)

    def taken() -> bool:
        with connection(server) as sock:
            sock.sendall(head("/v1/sandboxes", length=2 * MiB, token=tokens.acme) + b"x" * (2 * MiB))
            return answer(sock).startswith(b"HTTP/1.1 400 ")

    wait_for(taken, what="acme's held body to be given back", timeout_s=10, interval_s=0.2)


def test_a_body_without_a_length_is_refused_once_it_passes_its_tenants_share(
    service: tuple[Server, Tokens],
) -> None:
    server, tokens = service
    chunk = b"x" * (256 * 1024)
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    answered = b""
    with connection(server) as sock:
        # a workspace upload takes 64 MiB; acme's share of bodies held at once is 4
        sock.sendall(head("/v1/workspaces", length=None, token=tokens.acme))
        sent = 0
        with contextlib.suppress(OSError):  # the server closes the connection, the rest unread
            while sent < 64 * MiB and not select.select([sock], [], [], 0.01)[0]:
                sock.sendall(framed)
                sent += len(chunk)
            answered = answer(sock)
    # refused once past the share, not at the upload's cap: what was sent is what the sockets'
    # buffers took past the refusal, and the answer, when the reset let it through, says why
    assert sent < 32 * MiB, sent
    assert not answered or refused_for_bodies(answered), answered[:300]


def rss(server: Server) -> int:
    status = Path(f"/proc/{server.pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_requests_pipelined_without_reading_the_answers_are_not_read_ahead_without_bound(
    service: tuple[Server, Tokens],
) -> None:
    server, tokens = service
    request = f"GET /v1/workspaces HTTP/1.1\r\nHost: stockade\r\nAuthorization: Bearer {tokens.acme}\r\n\r\n"
    block = request.encode() * 400
    before = rss(server)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the answers are never read
        sock.connect(("127.0.0.1", server.port))
        sock.setblocking(False)
        sent, until = 0, time.monotonic() + 4
        # the server took ~70 MiB a second of them, and held it until the connection closed
        while sent < 256 * MiB and time.monotonic() < until:
            try:
                sent += sock.send(block)
            except BlockingIOError:
                time.sleep(0.05)
        grown = rss(server) - before
        # what the sockets' buffers take, and what h11 holds of them at most
        assert sent < 32 * MiB, f"the server took {sent / MiB:.0f} MiB of requests from one connection"
        assert grown < 32 * MiB, f"the server's memory grew by {grown / MiB:.0f} MiB"
        # meanwhile, another connection is answered
        other = httpx2.get(server.url + "/v1/workspaces", headers={"Authorization": f"Bearer {tokens.acme}"})
        assert other.status_code == 200


def test_connections_that_pipeline_requests_and_read_no_answer_give_way_to_a_tenant(
    service: tuple[Server, Tokens],
) -> None:
    server, tokens = service
    pipelined = b"GET /openapi.json HTTP/1.1\r\nHost: stockade\r\n\r\n" * 128  # no token needed
    with contextlib.ExitStack() as held:
        # the cap, held from two addresses by connections whose answers are never read
        for source in ["127.0.0.2"] * PER_ADDRESS + ["127.0.0.3"] * PER_ADDRESS:
            sock = held.enter_context(socket.socket())
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.bind((source, 0))
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(pipelined)
        with httpx2.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {tokens.acme}"}, timeout=10
        ) as client:
            for _ in range(50):  # as a 503's retry-after asks
                status = client.get("/v1/sandboxes", headers={"Connection": "close"}).status_code
                if status != 503:
                    break
                time.sleep(0.1)
            assert status == 200


def test_a_token_in_a_query_is_never_written_to_the_access_log(service: tuple[Server, Tokens]) -> None:
    server, tokens = service
    with httpx2.Client(base_url=server.url, timeout=10) as client:
        assert client.get("/ui/login", params={"key": tokens.acme}).status_code == 200
        listed = client.get("/v1/runs", params={"limit": 5, "access_token": tokens.other},
                            headers={"Authorization": f"Bearer {tokens.acme}"})  # fmt: skip
        assert listed.status_code == 200
    wait_for(lambda: '"GET /v1/runs?limit=...&access_token=... HTTP/1.1" 200' in server.output(),
             what="the access lines")  # fmt: skip
    assert '"GET /ui/login?key=... HTTP/1.1" 200' in server.output()
    secrets = [token.rpartition("_")[2] for token in (tokens.acme, tokens.other)]
    assert not [secret for secret in secrets if secret in server.output()]
