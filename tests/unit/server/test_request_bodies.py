"""A request's body is bounded before anything parses it: the real application on a real
SQLite database, called in this process through httpx2's ASGI transport (which hands the
body to the app a chunk at a time, as a socket would). No sandbox is started."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import pytest

from stockade import exceptions as exc
from stockade.agent import RunLimits
from stockade.client._http import error_from
from stockade.server.app import create_app
from stockade.server.bodies import ANONYMOUS_BODY_BYTES
from stockade.server.context import ServiceConfig
from stockade.server.run_spec import run_limits
from stockade.server.schemas import RunLimitsIn, RunSubmit, SandboxCreate
from stockade.server.service import Service
from stockade.server.tenants import Tenant, Tenants, new_token
from stockade.types import Limits

CAP = 256 * 1024  # over ANONYMOUS_BODY_BYTES: a request outside /v1 has the smaller cap


@dataclass
class Sent:
    """A body sent in chunks, counting how many the server asked for."""

    chunks: int
    size: int = 16 * 1024
    taken: int = field(default=0)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.chunks):
            self.taken += 1
            yield b" " * self.size


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[Service, str]]:
    token, record = new_token("acme")
    tenants = Tenants(tenants={"acme": Tenant(id="acme")}, tokens={record.id: record})
    config = ServiceConfig(
        tenants=tenants, database=f"sqlite:///{tmp_path / 'service.db'}", temp_dir=tmp_path,
        max_request_bytes=CAP, max_file_bytes=4 * CAP,
    )  # fmt: skip
    service = Service(config)
    try:
        yield service, token
    finally:
        service.close()


@pytest.fixture
async def http(service: tuple[Service, str]) -> AsyncIterator[httpx2.AsyncClient]:
    transport = httpx2.ASGITransport(app=create_app(service[0]))
    headers = {"Authorization": f"Bearer {service[1]}", "Content-Type": "application/json"}
    async with httpx2.AsyncClient(transport=transport, base_url="http://service", headers=headers) as client:
        yield client


def too_large(response: httpx2.Response) -> exc.StockadeError:
    assert response.status_code == 413, response.text
    assert response.headers["content-type"] == "application/problem+json"
    return error_from(response.json(), response.status_code)


async def test_a_body_declared_over_the_cap_is_refused_before_a_byte_is_read(
    http: httpx2.AsyncClient, service: tuple[Service, str]
) -> None:
    body = Sent(chunks=400)  # 6.4 MB of JSON whitespace, declared
    response = await http.post(
        "/v1/sandboxes", content=body, headers={"Content-Length": str(400 * 16 * 1024)}
    )
    error = too_large(response)
    assert isinstance(error, exc.RequestTooLarge) and error.limit == CAP
    assert "6,553,600" in str(error) and "files/content" in str(error.fix)
    assert body.taken <= 1
    assert service[0].store.sandboxes() == []


async def test_a_body_that_says_nothing_of_its_size_is_cut_at_the_cap(http: httpx2.AsyncClient) -> None:
    for route in ("/v1/sandboxes", "/v1/runs", "/v1/sandboxes/sbx_x/commands", "/v1/sandboxes/sbx_x/code"):
        body = Sent(chunks=1000)  # 16 MB, chunked
        error = too_large(await http.post(route, content=body))
        assert isinstance(error, exc.RequestTooLarge), route
        assert body.taken <= CAP // body.size + 2, (route, body.taken)  # the rest never read


async def test_a_body_under_the_cap_reaches_its_route(http: httpx2.AsyncClient) -> None:
    response = await http.post("/v1/sandboxes", content=b'{"tier": "no-such-tier"}' + b" " * (CAP - 100))
    assert response.json()["error"] == "PolicyDenied", response.text  # judged by the route


async def test_a_files_own_route_keeps_its_own_cap(http: httpx2.AsyncClient) -> None:
    """A file's content passes the requests' cap (the files' is larger) and reaches its route
    (which reads it with its own cap, and here finds no such sandbox first)."""
    put = "/v1/sandboxes/sbx_missing/files/content?path=a.bin"
    response = await http.put(
        put, content=Sent(chunks=8), headers={"Content-Type": "application/octet-stream"}
    )
    assert response.json()["error"] == "ResourceNotFound", response.text


async def test_a_request_without_a_known_token_is_refused_before_a_byte_of_its_body_is_read(
    http: httpx2.AsyncClient,
) -> None:
    for authorization in ("", "Bearer stk_notatoken_0123456789abcdef"):
        body = Sent(chunks=10)  # 160 KiB, under the cap
        response = await http.post("/v1/sandboxes", content=body, headers={"Authorization": authorization})
        assert response.status_code == 401, response.text
        assert response.headers["connection"] == "close"
        assert isinstance(error_from(response.json(), 401), exc.AuthenticationError)
        assert body.taken <= 1, authorization  # httpx2 hands the first chunk over with the head


async def test_a_request_that_needs_no_token_takes_a_forms_body_no_more(http: httpx2.AsyncClient) -> None:
    body = Sent(chunks=100)  # 1.6 MB to the viewer's sign-in form, by anyone
    error = too_large(await http.post("/ui/login", content=body, headers={"Authorization": ""}))
    assert isinstance(error, exc.RequestTooLarge) and error.limit == ANONYMOUS_BODY_BYTES
    assert body.taken <= ANONYMOUS_BODY_BYTES // body.size + 2


async def test_a_runs_limits_are_judged_at_submission_as_its_start_would_judge_them(
    http: httpx2.AsyncClient, service: tuple[Service, str]
) -> None:
    for limits in ({"max_cost_usd": 1e13}, {"max_cost_usd": 1e300}, {"max_wall_s": 1e10}, {"max_steps": 0}):
        response = await http.post("/v1/runs", json={"task": "t", "scripted": ["done"], "limits": limits})
        assert response.status_code == 422, (limits, response.text)
        assert response.json()["field"] == f"limits.{next(iter(limits))}", response.text
    assert service[0].store.runs("acme") == []  # nothing queued, no place of the quota taken


# What a client from before 2026-12-06 sends for Limits(memory_mb=512): every field not None,
# so the inodes default of then (65,536, whatever memory_mb) too.
OLD_CLIENTS_DEFAULT = {
    "memory_mb": 512, "cpus": 1.0, "pids": 128, "timeout_s": 30.0, "inodes": 65536,
    "output_bytes": 1048576, "open_files": 16384, "ptys": 64,
}  # fmt: skip


def test_an_older_clients_default_file_count_is_taken_as_todays_default() -> None:
    asked = SandboxCreate.model_validate({"limits": OLD_CLIENTS_DEFAULT}).limits
    assert asked is not None and asked.build() == Limits()
    small = {**OLD_CLIENTS_DEFAULT, "memory_mb": 64, "disk_mb": 16}
    assert SandboxCreate.model_validate({"limits": small}).limits.build() == Limits(  # type: ignore[union-attr]
        memory_mb=64, disk_mb=16
    )
    purposeful = {**OLD_CLIENTS_DEFAULT, "inodes": 200_000}  # a count asked for on purpose: refused
    with pytest.raises(exc.InvalidArgument, match="raise memory_mb to at least"):
        SandboxCreate.model_validate({"limits": purposeful}).limits.build()  # type: ignore[union-attr]


def test_every_limit_the_api_takes_is_one_a_run_starts_with() -> None:
    highest = {
        name: next(m.le for m in info.metadata if getattr(m, "le", None) is not None)
        for name, info in RunLimitsIn.model_fields.items()
    }
    assert set(highest) == {"max_steps", "max_wall_s", "max_tokens", "max_cost_usd", "max_pending_approvals"}
    spec = RunSubmit.model_validate({"task": "t", "scripted": ["done"], "limits": highest})
    assert run_limits(spec) == RunLimits(**highest)


async def test_a_number_too_long_to_read_is_told_as_such(http: httpx2.AsyncClient) -> None:
    response = await http.post("/v1/sandboxes", content=b'{"idle_timeout_s": ' + b"9" * 5000 + b"}")
    assert response.status_code == 400, response.text
    assert "a JSON number of over 4,300 digits" in response.json()["detail"]
    deep = await http.post("/v1/sandboxes", content=b"[" * 100_000 + b"]" * 100_000)
    assert deep.status_code in (400, 422), deep.text  # told as too deep, or refused by its count
