"""What the API process holds for a tenant's transfers in flight is its ``bodies_mb`` at most:
a response counts until its client has read it (a file's content, a packed folder, a call's
result), an upload's unpacked files while they are unpacked. A client that reads nothing
holds its tenant's share, never the host's memory or disk, and its next transfer past the
share is refused (429) until it reads or goes."""

from __future__ import annotations

import io
import json
import socket
import tarfile
from collections.abc import Iterator

import httpx2
import pytest

from tests.conftest import require_tier, wait_for
from tests.integration.service_env import Server, Tokens, embedded_server

pytestmark = [pytest.mark.process]

SHARE_MB = 8  # acme's bodies_mb
BIG = 7 * 1024 * 1024  # one transfer: two of them pass the share


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens]]:
    require_tier("process")
    folder = tmp_path_factory.mktemp("service")
    with embedded_server(folder, storage_mb=64, acme_quotas={"bodies_mb": SHARE_MB}) as (server, tokens, _):
        yield server, tokens


@pytest.fixture(scope="module")
def box(service: tuple[Server, Tokens]) -> Iterator[str]:
    server, tokens = service
    auth = {"Authorization": f"Bearer {tokens.acme}"}
    made = httpx2.post(f"{server.url}/v1/sandboxes", headers=auth, timeout=60,
                       json={"tier": "process", "limits": {"output_bytes": 8 * 1024 * 1024}})  # fmt: skip
    assert made.status_code == 201, made.text
    sandbox_id: str = made.json()["id"]
    wrote = httpx2.put(f"{server.url}/v1/sandboxes/{sandbox_id}/files/content", headers=auth,
                       params={"path": "d/big.bin"}, content=b"\x01" * BIG, timeout=60)  # fmt: skip
    assert wrote.status_code == 200, wrote.text
    yield sandbox_id
    httpx2.delete(f"{server.url}/v1/sandboxes/{sandbox_id}", headers=auth, timeout=30)


def _unread(
    server: Server, token: str, method: str, target: str, body: dict[str, object] | None = None
) -> socket.socket:
    """A request whose answer is left unread (a small receive window: the server keeps it)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    data = json.dumps(body).encode() if body is not None else b""
    sock.sendall(
        f"{method} {target} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    sock.settimeout(30)
    assert sock.recv(12) == b"HTTP/1.1 200", "the answer began"
    return sock


def _refused_for_share(answer: httpx2.Response) -> bool:
    return answer.status_code == 429 and answer.json().get("quota") == "bodies_mb"


@pytest.mark.parametrize(
    ("method", "route", "body"),
    [
        ("GET", "files/content?path=d/big.bin", None),
        ("GET", "archive?path=d", None),
        ("POST", "commands", {"cmd": ["sh", "-c", f"head -c {BIG} /dev/zero | tr '\\0' a"]}),
    ],
    ids=["file", "folder", "result"],
)
def test_an_unread_response_holds_its_tenants_share_until_its_client_goes(
    service: tuple[Server, Tokens], box: str, method: str, route: str, body: dict[str, object] | None
) -> None:
    server, tokens = service
    auth = {"Authorization": f"Bearer {tokens.acme}"}
    held = _unread(server, tokens.acme, method, f"/v1/sandboxes/{box}/{route}", body)
    try:
        # the same again is past the share while the first is unread: refused, whichever kind
        again = httpx2.request(method, f"{server.url}/v1/sandboxes/{box}/{route}", headers=auth, json=body,
                               timeout=60)  # fmt: skip
        assert _refused_for_share(again), again.text[:500]
        other = httpx2.get(f"{server.url}/v1/sandboxes", headers={"Authorization": f"Bearer {tokens.other}"},
                           timeout=30)  # fmt: skip
        assert other.status_code == 200  # another tenant's share is its own
    finally:
        held.close()

    def taken_again() -> bool:
        answered = httpx2.request(method, f"{server.url}/v1/sandboxes/{box}/{route}", headers=auth, json=body,
                                  timeout=60)  # fmt: skip
        return answered.status_code == 200

    wait_for(taken_again, what="the unread answer's share to be given back", timeout_s=20, interval_s=0.3)


def test_an_unread_streams_result_holds_its_tenants_share_once_its_call_ends(
    service: tuple[Server, Tokens], box: str
) -> None:
    """A streamed call's result line is all of its output again: counted from when the call
    ends (its place in running_calls given back) until the stream has sent it."""
    server, tokens = service
    auth = {"Authorization": f"Bearer {tokens.acme}"}
    cmd = {"cmd": ["sh", "-c", f"head -c {BIG} /dev/zero | tr '\\0' a"]}
    held = _unread(server, tokens.acme, "POST", f"/v1/sandboxes/{box}/commands", {**cmd, "stream": True})
    route = f"{server.url}/v1/sandboxes/{box}/commands"
    try:
        # once the streamed call has ended, its unread result holds the share: a call's result is refused
        wait_for(lambda: _refused_for_share(httpx2.post(route, headers=auth, json=cmd, timeout=60)),
                 what="the streamed result to be held", timeout_s=30, interval_s=0.3)  # fmt: skip
    finally:
        held.close()
    wait_for(lambda: httpx2.post(route, headers=auth, json=cmd, timeout=60).status_code == 200,
             what="the unread result's share to be given back", timeout_s=20, interval_s=0.3)  # fmt: skip


def test_an_unread_whole_answer_holds_its_tenants_share_too(service: tuple[Server, Tokens], box: str) -> None:
    """Any JSON answer, a listing here: counted from when it is sent until the socket has it."""
    server, tokens = service
    auth = {"Authorization": f"Bearer {tokens.acme}"}
    touch = "mkdir -p many && cd many && seq -f '%060g' 30000 | xargs touch"
    made = httpx2.post(f"{server.url}/v1/sandboxes/{box}/commands", headers=auth, timeout=60,
                       json={"cmd": ["sh", "-c", touch]})  # fmt: skip
    assert made.status_code == 200 and made.json()["exit_code"] == 0, made.text
    listed = httpx2.get(
        f"{server.url}/v1/sandboxes/{box}/files", headers=auth, params={"path": "many"}, timeout=60
    )
    assert listed.status_code == 200 and len(listed.json()) == 30000
    assert SHARE_MB * 1024 * 1024 / 2 < len(listed.content) < SHARE_MB * 1024 * 1024, len(listed.content)
    held = _unread(server, tokens.acme, "GET", f"/v1/sandboxes/{box}/files?path=many")
    try:
        again = httpx2.get(
            f"{server.url}/v1/sandboxes/{box}/files", headers=auth, params={"path": "many"}, timeout=60
        )
        assert _refused_for_share(again), again.text[:300]
    finally:
        held.close()

    def taken_again() -> bool:
        answered = httpx2.get(f"{server.url}/v1/sandboxes/{box}/files", headers=auth, params={"path": "many"},
                              timeout=60)  # fmt: skip
        return answered.status_code == 200

    wait_for(taken_again, what="the unread listing's share to be given back", timeout_s=20, interval_s=0.3)
    httpx2.delete(f"{server.url}/v1/sandboxes/{box}/files", headers=auth, params={"path": "many"}, timeout=60)


def _bomb(size: int) -> bytes:
    """A tar.xz of a few KB that unpacks into ``size`` bytes."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:xz") as tar:
        info = tarfile.TarInfo("zeros.bin")
        info.size = size
        tar.addfile(info, io.BytesIO(bytes(size)))
    return raw.getvalue()


def test_an_uploads_unpacked_files_count_against_its_tenants_share(service: tuple[Server, Tokens]) -> None:
    server, tokens = service
    auth = {"Authorization": f"Bearer {tokens.acme}"}
    bomb = _bomb(20 * 1024 * 1024)
    assert len(bomb) < 64 * 1024
    refused = httpx2.post(f"{server.url}/v1/workspaces", headers=auth, content=bomb, timeout=60)
    assert _refused_for_share(refused), refused.text
    assert "unpacking" in refused.json()["detail"]
    small = httpx2.post(f"{server.url}/v1/workspaces", headers=auth, content=_bomb(1024 * 1024), timeout=60)
    assert small.status_code == 201, small.text
    # another tenant, its share the default, takes the same archive
    other = httpx2.post(f"{server.url}/v1/workspaces", headers={"Authorization": f"Bearer {tokens.other}"},
                        content=bomb, timeout=60)  # fmt: skip
    assert other.status_code == 201, other.text
