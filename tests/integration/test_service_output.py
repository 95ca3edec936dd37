"""A command's output through the service: it is held in the API process, so the tenants file
caps each sandbox's ``output_bytes`` (16 MiB unless set, refused above at creation), and a
streamed command whose client reads nothing holds at most ``STREAM_BUFFER_CHARS`` of it
waiting: the rest is left out of the stream, the gap marked, and the result still has all."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from stockade import Limits
from stockade import exceptions as exc
from stockade.client import Client, RemoteSandbox
from stockade.server.streamed import STREAM_BUFFER_CHARS
from tests.conftest import require_tier, wait_for
from tests.integration.service_env import Server, Tokens, embedded_server

pytestmark = [pytest.mark.process]

MiB = 1024 * 1024
CEILING = 16 * MiB  # a tenant's output_bytes ceiling when its tenants file sets none


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens, Path]]:
    require_tier("process")
    with embedded_server(tmp_path_factory.mktemp("service"), storage_mb=64) as running:
        yield running


@pytest.fixture
def sbx(service: tuple[Server, Tokens, Path]) -> Iterator[RemoteSandbox]:
    server, tokens, _ = service
    limits = Limits(memory_mb=512, output_bytes=CEILING, timeout_s=120)
    with (
        Client(server.url, tokens.acme) as client,
        RemoteSandbox.create(tier="process", limits=limits, client=client) as made,
    ):
        yield made


def test_a_sandbox_asking_more_output_than_its_tenants_ceiling_is_refused(
    service: tuple[Server, Tokens, Path],
) -> None:
    server, tokens, _ = service
    with Client(server.url, tokens.acme) as client, pytest.raises(exc.QuotaExceeded) as refused:
        RemoteSandbox.create(tier="process", limits=Limits(output_bytes=4 << 30), client=client)
    assert refused.value.quota == "output_bytes" and refused.value.limit == CEILING
    # on the wire: the typed problem a memory_mb over the tenant's whole quota gets
    response = httpx2.post(
        f"{server.url}/v1/sandboxes",
        headers={"Authorization": f"Bearer {tokens.acme}"},
        json={"tier": "process", "limits": {"output_bytes": CEILING + 1}},
    )
    assert response.status_code == 429, response.text
    problem = response.json()
    assert problem["error"] == "QuotaExceeded" and problem["quota"] == "output_bytes"
    # a run's sandbox as well, refused when submitted
    with Client(server.url, tokens.acme) as client, pytest.raises(exc.QuotaExceeded) as run:
        client.runs.submit("big", scripted=["done"], sandbox_limits=Limits(output_bytes=CEILING + 1))
    assert run.value.quota == "output_bytes"


def unread_stream(server: Server, token: str, sandbox_id: str, cmd: str) -> socket.socket:
    """A streamed command whose client reads nothing (its receive buffer small)."""
    body = json.dumps({"cmd": cmd, "stream": True, "timeout_s": 120}).encode()
    conn = socket.create_connection(("127.0.0.1", server.port))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)
    conn.sendall(
        f"POST /v1/sandboxes/{sandbox_id}/commands HTTP/1.1\r\nHost: test\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    return conn


def ndjson_lines(conn: socket.socket) -> list[dict[str, object]]:
    """Everything the response holds, read to its end (chunked transfer decoded)."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * MiB)  # to read the rest quickly
    conn.settimeout(60)
    raw = bytearray()
    while chunk := conn.recv(1 << 20):
        raw += chunk
    head, _, chunked = bytes(raw).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    body, rest = bytearray(), chunked
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body += rest[:size]
        rest = rest[size + 2 :]
    return [json.loads(line) for line in body.splitlines()]


def test_a_streamed_command_whose_client_reads_nothing_holds_a_bounded_backlog(
    service: tuple[Server, Tokens, Path], sbx: RemoteSandbox
) -> None:
    server, tokens, _ = service
    each = 12 * MiB  # on stdout and on stderr: 24 MiB, far more than the backlog the server keeps
    assert 2 * each > 8 * STREAM_BUFFER_CHARS
    cmd = (
        f"head -c {each} /dev/zero | tr '\\0' a; head -c {each} /dev/zero | tr '\\0' b >&2; "
        "touch /workspace/done"
    )
    conn = unread_stream(server, tokens.acme, sbx.id, cmd)
    try:
        wait_for(lambda: sbx.files.exists("done"), what="the command to print everything", timeout_s=60)
        time.sleep(1)  # its last pieces through the host's channel to the stream
        lines = ndjson_lines(conn)
    finally:
        conn.close()
    streamed = {"stdout": 0, "stderr": 0}
    skipped = {"stdout": 0, "stderr": 0}
    for line in lines[:-1]:
        kind = str(line["type"])
        if kind == "skipped":
            skipped["stdout"] += int(str(line["stdout"]))
            skipped["stderr"] += int(str(line["stderr"]))
        else:
            streamed[kind] += len(str(line["data"]))
    # what reached the client while it read nothing: the backlog kept, and the kernel's
    # socket buffers (a few MiB); the rest was left out, and said so
    assert sum(skipped.values()) >= 2 * each - 10 * MiB, (streamed, skipped)
    # ... and the result has all of it, not truncated
    last = lines[-1]
    assert last["type"] == "result", last
    result = last["result"]
    assert isinstance(result, dict)
    assert result["stdout"] == "a" * each and result["stderr"] == "b" * each
    assert not result["truncated"]
    assert streamed["stdout"] + skipped["stdout"] == each
    assert streamed["stderr"] + skipped["stderr"] == each


def vm_hwm(server: Server) -> int:
    """The server process's peak resident memory so far, in bytes."""
    status = Path(f"/proc/{server.pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def test_commands_at_once_hold_at_most_their_output_bytes_each(
    service: tuple[Server, Tokens, Path], sbx: RemoteSandbox
) -> None:
    """Not streamed: each command's stdout and stderr are cut at output_bytes (the tenant's
    ceiling at most), whatever the command prints, however many run at once."""
    server, _, _ = service
    printed = 3 * CEILING  # on each of stdout and stderr, by each command
    cmd = f"head -c {printed} /dev/zero | tr '\\0' a; head -c {printed} /dev/zero | tr '\\0' b >&2"
    before = vm_hwm(server)
    results = []

    def run() -> None:
        results.append(sbx.commands.run(cmd, timeout_s=120))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3
    for result in results:
        assert result.truncated and result.stdout_bytes == printed and result.stderr_bytes == printed
        assert len(result.stdout) < CEILING + 200 and result.stdout.startswith("a" * CEILING)
        assert len(result.stderr) < CEILING + 200 and result.stderr.startswith("b" * CEILING)
    # 3 commands x 2 streams x 16 MiB, held a few times over (bytes, text, JSON): not 288 MiB x that
    assert vm_hwm(server) - before < 600 * MiB
