"""One tenant's long sandbox calls leave the server to the others: a tenant runs at most its
``running_calls`` at once (each holds a server thread), one more is refused at once (429), and
another tenant's calls are answered meanwhile. A call whose client goes is stopped in the
sandbox, and its place given back, long before its own deadline."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from stockade import exceptions as exc
from tests.conftest import require_tier, wait_for, wait_for_async
from tests.integration.service_env import Server, Tokens, embedded_server

pytestmark = [pytest.mark.process]

CAP = 3  # acme's running_calls in the tenants file: small, so holding all of them is cheap


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens, Path]]:
    require_tier("process")
    with embedded_server(
        tmp_path_factory.mktemp("service"), storage_mb=64, acme_quotas={"running_calls": CAP}
    ) as running:
        yield running


def _sandbox(server: Server, token: str) -> str:
    made = httpx2.post(
        f"{server.url}/v1/sandboxes", headers={"Authorization": f"Bearer {token}"}, json={"tier": "process"},
        timeout=60,
    )  # fmt: skip
    assert made.status_code == 201, made.text
    sandbox_id: str = made.json()["id"]
    return sandbox_id


def _streamed_sleep(server: Server, token: str, sandbox_id: str, *, route: str = "commands") -> socket.socket:
    """A streamed ``sleep`` whose response has begun (200): it holds one of the tenant's calls."""
    conn = _try_streamed_sleep(server, token, sandbox_id, route=route)
    assert conn is not None, "refused: the tenant's running calls are all taken"
    return conn


def _try_streamed_sleep(
    server: Server, token: str, sandbox_id: str, *, route: str = "commands"
) -> socket.socket | None:
    """The same, or None when the tenant's running calls are all taken (429)."""
    sleep = {"cmd": ["sleep", "61"]} if route == "commands" else {"code": "import time; time.sleep(61)"}
    body = json.dumps({**sleep, "timeout_s": 90, "stream": True}).encode()
    conn = socket.create_connection(("127.0.0.1", server.port))
    conn.settimeout(20)
    conn.sendall(
        f"POST /v1/sandboxes/{sandbox_id}/{route} HTTP/1.1\r\nHost: test\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    head = conn.recv(4096)
    if head.startswith(b"HTTP/1.1 429"):
        conn.close()
        return None
    assert head.startswith(b"HTTP/1.1 200"), head
    return conn


def _all_places(server: Server, token: str, sandbox_id: str) -> list[socket.socket] | None:
    """CAP streamed sleeps at once, or None (each opened closed again) while a place is still
    held: a cut call gives its place back once its thread returns, after its process died."""
    opened: list[socket.socket] = []
    for _ in range(CAP):
        conn = _try_streamed_sleep(server, token, sandbox_id)
        if conn is None:
            for held in opened:
                held.close()
            return None
        opened.append(conn)
    return opened


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


def _sleeping(server: Server, token: str, sandbox_id: str) -> int | None:
    """How many ``sleep 61`` the sandbox runs (the line the pattern is on is not one); None
    while the tenant's running calls are all taken (calls whose clients just went are stopped
    once the service notices, a moment later)."""
    count = (
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -cx 'sleep 6[1] '"
    )
    ran = httpx2.post(
        f"{server.url}/v1/sandboxes/{sandbox_id}/commands", headers={"Authorization": f"Bearer {token}"},
        json={"cmd": ["sh", "-c", count]}, timeout=30,
    )  # fmt: skip
    if ran.status_code == 429 and ran.json().get("quota") == "running_calls":
        return None
    assert ran.status_code == 200, ran.text
    return int(ran.json()["stdout"].strip() or 0)


def test_a_call_whose_client_goes_is_stopped_in_the_sandbox_which_stays(
    service: tuple[Server, Tokens, Path],
) -> None:
    server, tokens, _ = service
    acme = {"Authorization": f"Bearer {tokens.acme}"}
    box = _sandbox(server, tokens.acme)
    try:
        # streamed, a command and code; and one not streamed whose client gives up after a second
        held = [
            _streamed_sleep(server, tokens.acme, box),
            _streamed_sleep(server, tokens.acme, box, route="code"),
        ]
        wait_for(
            lambda: _sleeping(server, tokens.acme, box) == 1, what="the streamed sleep to start", timeout_s=20
        )
        with pytest.raises(httpx2.TimeoutException):
            httpx2.post(
                f"{server.url}/v1/sandboxes/{box}/commands", headers=acme, timeout=1.0,
                json={"cmd": ["sleep", "61"], "timeout_s": 90},
            )  # fmt: skip
        for conn in held:
            conn.close()
        # stopped in the sandbox long before their minute, and their places given back
        wait_for(
            lambda: _sleeping(server, tokens.acme, box) == 0, what="the sleeps to be stopped", timeout_s=20
        )
        # all CAP places are given back (the code's sleep is not one `_sleeping` counts)
        again = wait_for(
            lambda: _all_places(server, tokens.acme, box), what="all places given back", timeout_s=30
        )
        for conn in again or ():
            conn.close()
        wait_for(
            lambda: _sleeping(server, tokens.acme, box) == 0, what="the sleeps to be stopped", timeout_s=20
        )
        # the sandbox is the tenant's still, files and all
        wrote = httpx2.put(
            f"{server.url}/v1/sandboxes/{box}/files/content", headers=acme, params={"path": "kept.txt"},
            content=b"kept", timeout=30,
        )  # fmt: skip
        assert wrote.status_code == 200, wrote.text
        ran = httpx2.post(f"{server.url}/v1/sandboxes/{box}/commands", headers=acme,
                          json={"cmd": ["cat", "kept.txt"]}, timeout=30)  # fmt: skip
        assert ran.status_code == 200 and ran.json()["stdout"] == "kept", ran.text
    finally:
        httpx2.delete(f"{server.url}/v1/sandboxes/{box}", headers=acme, timeout=30)


async def test_the_sdks_cancelled_call_and_timed_out_call_are_stopped_on_the_service(
    service: tuple[Server, Tokens, Path],
) -> None:
    from stockade.client import AsyncClient, Client

    server, tokens, _ = service
    async with AsyncClient(server.url, tokens.acme) as client:
        sbx = await client.sandbox("process")
        try:
            # a task awaiting a command, cancelled: the command stops in the sandbox
            for streamed in (False, True):
                printed: list[str] = []
                task = asyncio.create_task(
                    sbx.commands.run(
                        ["sleep", "61"], timeout_s=90, on_stdout=printed.append if streamed else None
                    )
                )
                await wait_for_async(
                    lambda: _sleeping(server, tokens.acme, sbx.id) == 1,
                    what="the sleep to start",
                    interval_s=0.2,
                )
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await wait_for_async(
                    lambda: _sleeping(server, tokens.acme, sbx.id) == 0,
                    what="the cancelled sleep to be stopped",
                    timeout_s=20,
                    interval_s=0.2,
                )
            # the sync SDK's call that times out on the client's side: stopped too
            with (
                Client(server.url, tokens.acme, timeout_s=1.0) as impatient,
                pytest.raises(exc.StockadeError),
            ):
                impatient.http.request(
                    "POST", f"/v1/sandboxes/{sbx.id}/commands", json={"cmd": ["sleep", "61"], "timeout_s": 90}
                )
            await wait_for_async(
                lambda: _sleeping(server, tokens.acme, sbx.id) == 0,
                what="the timed-out sleep to be stopped",
                timeout_s=20,
                interval_s=0.2,
            )
            assert (await sbx.commands.run(["echo", "still here"])).stdout == "still here\n"
        finally:
            await sbx.close()
