"""Several API processes on one database, the logic alone (real SQLite, the real application
through httpx2's ASGI transport, no sandbox started): processes found dead are buried, their
sandboxes answer "gone" and their quota is free; a live peer that does not answer is 503."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from stockade.runs.lease import owner_token
from stockade.server.app import create_app
from stockade.server.context import ServiceConfig
from stockade.server.service import Service
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore
from stockade.server.tenants import Quotas, Tenant, Tenants, new_token
from tests.conftest import in_forked_child

ELSEWHERE = "another-boot-id/4026531836/4242/123456/0badc0de"  # a process of another machine


def dead_owner() -> str:
    """The owner token of a process of this machine that has exited."""
    # a fork, not a new interpreter: the same proof (its pid ended) without importing stockade
    # again (3 s a token under load)
    return str(in_forked_child(owner_token))


def reserve(store: ServiceStore, sandbox_id: str, owner: str, tenant: str = "acme") -> None:
    store.reserve_sandbox(
        sandbox_id=sandbox_id, tenant=tenant, owner=owner, tier="process", cpus=1.0, memory_mb=256,
        quotas=Quotas(),
    )  # fmt: skip


@pytest.fixture
def database(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'service.db'}"


@pytest.fixture
def store(database: str) -> Iterator[ServiceStore]:
    opened = ServiceStore(open_database(database))
    yield opened
    opened.close()


@dataclass(frozen=True)
class Up:
    service: Service
    http: httpx2.AsyncClient
    acme: str
    other: str


@pytest.fixture
async def up(database: str, tmp_path: Path) -> AsyncIterator[Up]:
    acme, acme_record = new_token("acme")
    other, other_record = new_token("other")
    tenants = Tenants(
        tenants={"acme": Tenant(id="acme"), "other": Tenant(id="other")},
        tokens={acme_record.id: acme_record, other_record.id: other_record},
    )
    service = Service(ServiceConfig(tenants=tenants, database=database, temp_dir=tmp_path))
    transport = httpx2.ASGITransport(app=create_app(service))
    try:
        async with httpx2.AsyncClient(transport=transport, base_url="http://service") as http:
            yield Up(service=service, http=http, acme=acme, other=other)
    finally:
        service.close()


CODE = {"code": "1"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_node_beats_until_it_is_buried(store: ServiceStore) -> None:
    store.register_node("me", "http://10.0.0.1:8080", "key")
    assert store.beat("me")
    reserve(store, "sbx_a", "me")
    assert store.bury("me") == 1
    assert not store.beat("me")  # found dead by a peer: it must stand down
    assert store.nodes() == [] and store.sandboxes() == []


def test_where_a_sandbox_is_live_killed_lost_or_never(store: ServiceStore) -> None:
    store.register_node("owner", "http://10.0.0.1:8080", "key")
    reserve(store, "sbx_live", "owner")
    reserve(store, "sbx_killed", "owner")
    store.end_sandbox("sbx_killed", "killed")
    live = store.locate("sbx_live")
    assert live is not None and live.tenant == "acme" and live.ended is None
    assert live.node is not None and live.node.url == "http://10.0.0.1:8080"
    killed = store.locate("sbx_killed")
    assert killed is not None and killed.ended == "killed" and killed.node is not None
    assert [r.sandbox_id for r in store.sandboxes()] == ["sbx_live"]  # a killed one holds no quota
    assert store.locate("sbx_never") is None
    store.bury("owner")
    for sandbox_id in ("sbx_live", "sbx_killed"):
        lost = store.locate(sandbox_id)
        assert lost is not None and lost.ended == "lost" and lost.node is None
    store.purge_ended(time.time_ns() + 1)
    assert store.locate("sbx_live") is None  # remembered for a while, then not found


def test_deleting_forgets_a_killed_sandbox(store: ServiceStore) -> None:
    reserve(store, "sbx_k", "owner")
    store.end_sandbox("sbx_k", "killed")
    store.release_sandbox("sbx_k")
    assert store.locate("sbx_k") is None


def test_a_starting_process_buries_the_dead_and_spares_the_live(store: ServiceStore, database: str) -> None:
    dead = dead_owner()
    store.register_node(dead, "http://127.0.0.1:1", "k1")
    reserve(store, "sbx_dead1", dead)
    reserve(store, "sbx_dead2", dead)
    store.register_node(ELSEWHERE, "http://10.9.9.9:8080", "k2")  # beating: alive, wherever it is
    reserve(store, "sbx_far", ELSEWHERE)
    reserve(store, "sbx_orphan", "owner-that-never-registered")
    tenants = Tenants(tenants={"acme": Tenant(id="acme")}, tokens={})
    service = Service(ServiceConfig(tenants=tenants, database=database))
    try:
        assert [r.sandbox_id for r in store.sandboxes()] == ["sbx_far"]
        assert {n.owner for n in store.nodes()} == {ELSEWHERE, service.sandboxes.owner}
        for sandbox_id in ("sbx_dead1", "sbx_dead2", "sbx_orphan"):
            placement = store.locate(sandbox_id)
            assert placement is not None and placement.ended == "lost"
        # a node of another machine silent past its time is dead too
        store.db.write([("UPDATE svc_nodes SET beat_ns = 0 WHERE owner = ?", [(ELSEWHERE,)])])
        assert service.sandboxes.sweep() == [ELSEWHERE]
        assert store.sandboxes() == []
    finally:
        service.close()
    assert service.sandboxes.owner not in {n.owner for n in store.nodes()}  # gone cleanly


async def test_a_sandbox_of_a_dead_process_answers_gone_to_its_tenant_only(up: Up) -> None:
    store = up.service.store
    dead = dead_owner()
    store.register_node(dead, "http://127.0.0.1:1", "k")
    reserve(store, "sbx_" + "a" * 32, dead)
    path = "/v1/sandboxes/sbx_" + "a" * 32
    for method, suffix in (("GET", ""), ("POST", "/code"), ("DELETE", "")):
        gone = await up.http.request(method, path + suffix, headers=bearer(up.acme), json=CODE)
        assert gone.status_code == 410, gone.text
        assert gone.json()["error"] == "SandboxGone" and gone.json()["id"] == "sbx_" + "a" * 32
        assert gone.headers["content-type"] == "application/problem+json"
        theirs = await up.http.request(method, path + suffix, headers=bearer(up.other), json=CODE)
        assert theirs.status_code == 404 and theirs.json()["error"] == "ResourceNotFound"
    assert store.sandboxes() == []  # its quota is free
    assert (await up.http.get("/v1/sandboxes/sbx_" + "b" * 32, headers=bearer(up.acme))).status_code == 404
    assert (await up.http.get(path)).status_code == 401  # no token: nothing said about it


async def test_a_live_peer_that_does_not_answer_is_503_to_retry(up: Up) -> None:
    store = up.service.store
    store.register_node(ELSEWHERE, "http://127.0.0.1:9", "k")  # beating, but nobody listens there
    reserve(store, "sbx_" + "c" * 32, ELSEWHERE)
    response = await up.http.get("/v1/sandboxes/sbx_" + "c" * 32, headers=bearer(up.acme))
    assert response.status_code == 503 and response.json()["error"] == "ServiceUnavailable"
    assert response.json()["retryable"] is True and response.headers["retry-after"] == "2"
    assert [r.sandbox_id for r in store.sandboxes()] == ["sbx_" + "c" * 32]  # not buried on a hunch
    listed = await up.http.get("/v1/sandboxes", headers=bearer(up.acme))
    assert listed.status_code == 200 and listed.json() == []  # a peer that cannot answer lists nothing


def test_the_advertised_address_is_the_listening_one_or_the_machines_name() -> None:
    import socket

    from stockade.server.serving import advertised

    assert advertised("127.0.0.1", 8080) == "http://127.0.0.1:8080"
    assert advertised("::1", 8080) == "http://[::1]:8080"
    assert advertised("0.0.0.0", 9000) == f"http://{socket.getfqdn()}:9000"
