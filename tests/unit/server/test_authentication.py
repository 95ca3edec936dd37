"""Authentication and the tenant's rate limit in front of every route: the real application
(``create_app``) on a real SQLite database, called in this process through httpx2's ASGI
transport. No sandbox is started: each request here is refused, or only lists."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from stockade.server.context import ServiceConfig
from stockade.server.service import Service
from stockade.server.tenants import Tenant, Tenants, new_token
from tests.unit.server._asgi import asgi_client, bearer


@dataclass(frozen=True)
class Setup:
    service: Service
    acme: str
    other: str


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    acme, acme_record = new_token("acme")
    other, other_record = new_token("other")
    tenants = Tenants(
        tenants={"acme": Tenant(id="acme", rate_per_minute=3), "other": Tenant(id="other")},
        tokens={acme_record.id: acme_record, other_record.id: other_record},
    )
    config = ServiceConfig(
        tenants=tenants, database=f"sqlite:///{tmp_path / 'service.db'}", temp_dir=tmp_path
    )
    service = Service(config)
    try:
        yield Setup(service=service, acme=acme, other=other)
    finally:
        service.close()


@pytest.fixture
async def http(setup: Setup) -> AsyncIterator[httpx2.AsyncClient]:
    async with asgi_client(setup.service) as client:
        yield client


async def test_no_token_a_wrong_one_or_another_scheme_is_401_before_any_work(
    http: httpx2.AsyncClient, setup: Setup
) -> None:
    wrong = setup.acme[:-4] + ("AAAA" if not setup.acme.endswith("AAAA") else "BBBB")
    for headers in ({}, {"Authorization": ""}, {"Authorization": "Bearer "}, {"Authorization": "Basic YTpi"},
                    {"Authorization": f"Token {setup.acme}"}, bearer(wrong), bearer("stk_x")):  # fmt: skip
        for method, path in (("GET", "/v1/sandboxes"), ("POST", "/v1/sandboxes"), ("GET", "/v1/runs"),
                             ("POST", "/v1/runs"), ("DELETE", "/v1/sandboxes/sbx_1")):  # fmt: skip
            response = await http.request(method, path, headers=headers, json={"tier": "process"})
            assert response.status_code == 401, (headers, path, response.text)
            assert response.headers["content-type"] == "application/problem+json"
            assert response.headers["www-authenticate"] == 'Bearer realm="stockade"'
            assert response.json()["error"] == "AuthenticationError"
    assert setup.service.store.sandboxes() == [] and setup.service.store.runs("acme") == []


async def test_a_good_token_is_let_in_and_the_scheme_is_case_insensitive(
    http: httpx2.AsyncClient, setup: Setup
) -> None:
    assert (await http.get("/v1/sandboxes", headers=bearer(setup.other))).json() == []
    lower = {"Authorization": f"bearer {setup.other}"}
    assert (await http.get("/v1/runs", headers=lower)).status_code == 200
    assert (await http.get("/healthz")).json()["ok"] is True  # the one route without a token


async def test_the_tenants_rate_limit_answers_429_with_retry_after(
    http: httpx2.AsyncClient, setup: Setup
) -> None:
    for _ in range(3):
        assert (await http.get("/v1/sandboxes", headers=bearer(setup.acme))).status_code == 200
    limited = await http.get("/v1/sandboxes", headers=bearer(setup.acme))
    assert limited.status_code == 429 and limited.json()["error"] == "RateLimited"
    assert int(limited.headers["retry-after"]) >= 1 and limited.json()["retryable"] is True
    # another tenant has its own window; bad tokens naming nobody spend nobody's
    assert (await http.get("/v1/sandboxes", headers=bearer(setup.other))).status_code == 200
    assert (await http.get("/v1/sandboxes", headers=bearer(setup.acme + "x"))).status_code == 401


async def test_another_tenants_ids_and_missing_ones_are_answered_alike(
    http: httpx2.AsyncClient, setup: Setup
) -> None:
    for path in ("/v1/sandboxes/sbx_00000000000000000000000000000000", "/v1/runs/0123"):
        response = await http.get(path, headers=bearer(setup.other))
        assert response.status_code == 404 and response.json()["error"] == "ResourceNotFound"


async def test_a_request_a_peer_forwarded_is_not_counted_twice(
    http: httpx2.AsyncClient, setup: Setup
) -> None:
    # the peer that forwarded it counted it against the tenant's rate; a guessed key counts here
    peer = {**bearer(setup.acme), "x-stockade-hop": setup.service.sandboxes.hop_key}
    for _ in range(5):
        assert (await http.get("/v1/sandboxes", headers=peer)).status_code == 200
    guessed = {**bearer(setup.acme), "x-stockade-hop": "guess"}
    statuses = [(await http.get("/v1/sandboxes", headers=guessed)).status_code for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
