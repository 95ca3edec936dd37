"""One tenant's long sandbox calls leave the server to the others: a tenant runs at most its
``running_calls`` at once (each holds a server thread), one more is refused at once (429), and
another tenant's calls are answered meanwhile."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from tests.conftest import require_tier, wait_for
from tests.integration.service_env import Server, Tokens, embedded_server

pytestmark = [pytest.mark.process]

CAP = 3  # acme's running_calls in the tenants file: small, so holding all of them is cheap


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens, Path]]:
    require_tier("process")
    with embedded_server(tmp_path_factory.mktemp("service"), storage_mb=64, running_calls=CAP) as running:
        yield running


def _sandbox(server: Server, token: str) -> str:
    made = httpx2.post(
        f"{server.url}/v1/sandboxes", headers={"Authorization": f"Bearer {token}"}, json={"tier": "process"},
        timeout=60,
    )  # fmt: skip
    assert made.status_code == 201, made.text
    sandbox_id: str = made.json()["id"]
    return sandbox_id


def _streamed_sleep(server: Server, token: str, sandbox_id: str) -> socket.socket:
    """A streamed ``sleep`` whose response has begun (200): it holds one of the tenant's calls."""
    body = json.dumps({"cmd": ["sleep", "60"], "timeout_s": 90, "stream": True}).encode()
    conn = socket.create_connection(("127.0.0.1", server.port))
    conn.settimeout(20)
    conn.sendall(
        f"POST /v1/sandboxes/{sandbox_id}/commands HTTP/1.1\r\nHost: test\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    head = conn.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head
    return conn


def test_a_tenant_at_its_running_calls_is_refused_at_once_and_others_are_answered(
    service: tuple[Server, Tokens, Path],
) -> None:
    server, tokens, _ = service
    acme = {"Authorization": f"Bearer {tokens.acme}"}
    other = {"Authorization": f"Bearer {tokens.other}"}
    acme_box, other_box = _sandbox(server, tokens.acme), _sandbox(server, tokens.other)
    held = [_streamed_sleep(server, tokens.acme, acme_box) for _ in range(CAP)]
    try:
        # one more of acme's, streamed or not, is refused at once: a typed 429, no wait
        for stream in (True, False):
            started = time.monotonic()
            refused = httpx2.post(
                f"{server.url}/v1/sandboxes/{acme_box}/commands", headers=acme, timeout=10,
                json={"cmd": ["true"], "stream": stream},
            )  # fmt: skip
            assert time.monotonic() - started < 2.0
            assert refused.status_code == 429, refused.text
            problem = refused.json()
            assert problem["error"] == "QuotaExceeded" and problem["quota"] == "running_calls", problem
            assert problem["limit"] == CAP and problem["used"] == CAP, problem
        # a file op is a call too
        listed = httpx2.get(f"{server.url}/v1/sandboxes/{acme_box}/files", headers=acme, timeout=10)
        assert listed.status_code == 429, listed.text
        # the other tenant is answered meanwhile
        started = time.monotonic()
        mine = httpx2.get(f"{server.url}/v1/sandboxes", headers=other, timeout=10)
        assert mine.status_code == 200 and [s["id"] for s in mine.json()] == [other_box], mine.text
        ran = httpx2.post(
            f"{server.url}/v1/sandboxes/{other_box}/commands", headers=other, timeout=10,
            json={"cmd": ["echo", "hi"]},
        )  # fmt: skip
        assert ran.status_code == 200 and ran.json()["stdout"] == "hi\n", ran.text
        assert time.monotonic() - started < 3.0
        # acme at its most may still stop what holds it: killing is not a call
        killed = httpx2.post(f"{server.url}/v1/sandboxes/{acme_box}/kill", headers=acme, timeout=30)
        assert killed.status_code == 200, killed.text
    finally:
        for conn in held:
            conn.close()

    # its calls ended, acme's places are given back
    def runs_again() -> bool:
        box = _sandbox(server, tokens.acme)
        try:
            ran = httpx2.post(
                f"{server.url}/v1/sandboxes/{box}/commands", headers=acme, json={"cmd": ["true"]}, timeout=30
            )
            return ran.status_code == 200
        finally:
            httpx2.delete(f"{server.url}/v1/sandboxes/{box}", headers=acme, timeout=30)

    wait_for(runs_again, what="acme's running calls to be given back", timeout_s=30, interval_s=0.5)
    for box, headers in ((acme_box, acme), (other_box, other)):
        httpx2.delete(f"{server.url}/v1/sandboxes/{box}", headers=headers, timeout=30)
