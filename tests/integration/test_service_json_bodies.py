"""A JSON body inside the service's caps cannot make it hold many times its size: the real
server (``stockade serve``), its peak resident memory (VmHWM) read from /proc around each
request.

A tenant sent ``{"cmd": ["a", "a", ...]}``: 15.5 MiB of JSON, 4 million one-character
arguments, under the 16 MiB request cap and its ``bodies_mb``. The argv was parsed, validated,
checked, audited and framed, each layer a copy of 4 million pointers, before the sandbox's
channel refused it: each such request took ~35 s and 300 MB of the server's, and eight at
once 2.6 GB, while another tenant's commands waited. Nested empty values (``[[], [], ...]``)
made ``json.loads`` alone hold ~25 times the body. Both are refused now from the body's bytes,
before anything parses them: the problem says so (no sandbox or layer saw them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from stockade.client import Client, RemoteSandbox
from tests.conftest import require_tier
from tests.integration.service_env import Server, Tokens, embedded_server

pytestmark = [pytest.mark.process]

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens, Path]]:
    require_tier("process")
    with embedded_server(tmp_path_factory.mktemp("service"), storage_mb=64) as running:
        yield running


@pytest.fixture(scope="module")
def sandbox_id(service: tuple[Server, Tokens, Path]) -> Iterator[str]:
    server, tokens, _ = service
    with (
        Client(server.url, tokens.acme) as client,
        RemoteSandbox.create(tier="process", client=client) as made,
    ):
        assert made.commands.run("true").exit_code == 0
        yield made.id


def peak_rss(server: Server) -> int:
    status = Path(f"/proc/{server.pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def post_json(server: Server, token: str, path: str, body: bytes) -> tuple[httpx2.Response, int]:
    """The answer, and how much the server's peak memory grew while it took the body."""
    Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # its peak, from here on
    before = peak_rss(server)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    response = httpx2.post(server.url + path, headers=headers, content=body, timeout=120)
    return response, peak_rss(server) - before


ONE_CHAR_ARGV = b'{"cmd": [' + b",".join([b'"a"'] * (int(15.5 * MiB) // 4)) + b'], "timeout_s": 5}'
EMPTY_LISTS = b'{"cmd": "true", "envs": {"A": "b"}, "stdin": [' + b"[]," * (15 * MiB // 3) + b"[]]}"


@pytest.mark.parametrize("body", [ONE_CHAR_ARGV, EMPTY_LISTS], ids=["one-char-argv", "empty-lists"])
def test_a_body_of_millions_of_values_is_refused_before_it_is_parsed(
    service: tuple[Server, Tokens, Path], sandbox_id: str, body: bytes
) -> None:
    server, tokens, _ = service
    response, grown = post_json(server, tokens.acme, f"/v1/sandboxes/{sandbox_id}/commands", body)
    assert response.status_code == 422, response.text[:500]
    # the body as it arrives, joined, and counted: ~3 times its size (it was 20)
    assert grown < 4 * len(body), f"the server's peak grew by {grown / MiB:.0f} MiB for {len(body) / MiB:.1f}"
    problem = response.json()
    assert problem["field"] == "body" and "JSON values" in problem["detail"], problem


def test_an_argv_longer_than_the_kernel_runs_is_refused_by_the_schema(
    service: tuple[Server, Tokens, Path], sandbox_id: str
) -> None:
    """Few enough values to be parsed, more arguments than any exec takes (233,016): the
    schema's 422 names ``cmd``, and the sandbox never sees it."""
    server, tokens, _ = service
    body = b'{"cmd": [' + b",".join([b'"a"'] * 250_000) + b"]}"
    response, grown = post_json(server, tokens.acme, f"/v1/sandboxes/{sandbox_id}/commands", body)
    assert response.status_code == 422, response.text[:500]
    assert response.json()["field"] == "cmd.argv", response.text[:500]
    assert grown < 16 * MiB, f"the server's peak grew by {grown / MiB:.0f} MiB"


def test_a_command_as_large_as_the_kernel_takes_still_runs(
    service: tuple[Server, Tokens, Path], sandbox_id: str
) -> None:
    """The limits refuse only what could never run: 100,000 arguments are 100,000 arguments."""
    server, tokens, _ = service
    body = b'{"cmd": ["sh", "-c", "echo $#", "sh", ' + b",".join([b'"a"'] * 100_000) + b"]}"
    response, _ = post_json(server, tokens.acme, f"/v1/sandboxes/{sandbox_id}/commands", body)
    assert response.status_code == 200, response.text[:500]
    assert response.json()["stdout"] == "100000\n"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/commands", b'{"cmd": [' + b",".join([b"1"] * 233_000) + b"]}"),  # 466 KB
        ("", b'{"envs": {' + b",".join(b'"V%d": 1' % i for i in range(170_000)) + b"}}"),
        ("", b"{" + b",".join(b'"field%d": 1' % i for i in range(100_000)) + b"}"),
    ],
    ids=["argv-of-numbers", "envs-of-numbers", "unknown-fields"],
)
def test_a_body_of_many_wrong_values_is_one_short_answer(
    service: tuple[Server, Tokens, Path], sandbox_id: str, path: str, body: bytes
) -> None:
    """Each wrong item was an error of its own: 233,000 of them took ~3 s of the event loop
    (another tenant's GET waited 1.7 s, 8 s with 4 at once), +296 MiB of the server's peak
    memory and a 27 MB answer (the envs: 194 MiB, 19 MB; the fields: 81 MiB, 15 MB). Now one
    answer of ~500 bytes names the first and counts the rest; the peak grows by what the body
    parses into (5-21 MiB)."""
    server, tokens, _ = service
    route = f"/v1/sandboxes/{sandbox_id}{path}" if path else "/v1/sandboxes"
    response, grown = post_json(server, tokens.acme, route, body)
    assert response.status_code == 422, response.text[:500]
    assert len(response.content) < 10_000, f"an answer of {len(response.content):,} bytes"
    assert len(response.json()["errors"]) <= 20
    assert grown < 48 * MiB, f"the server's peak grew by {grown / MiB:.0f} MiB for {len(body) / 1000:.0f} KB"
