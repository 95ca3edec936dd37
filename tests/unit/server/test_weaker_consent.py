"""Weaker enforcement through the service (the real application through httpx2's ASGI
transport, real SQLite and snapshot stores, a fake tier that holds ptys only by the host's
shared limit, as the process tier without root): a request's ``allow_weaker`` asks, the
operator's tenants file decides, at every door a sandbox comes in by: created, started from
a snapshot, resumed from a pause."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest

from stockade import exceptions as exc
from stockade.client import AsyncClient, AsyncRemoteSandbox
from stockade.policy.schema import Policy
from stockade.sandbox.base import SandboxSpec
from stockade.server.app import create_app
from stockade.server.context import ServiceConfig
from stockade.server.service import Service
from stockade.server.tenants import Quotas, Tenant, Tenants, new_token
from stockade.testing import FakeBackend, FakeInstance

TRUSTED = Policy.model_validate({"trust": {"level": "trusted"}})  # the process tier (a fake here)
PTYS = "ptys: bounded only by the host's kernel.pty.max, shared (no root)"


class SharedPtys(FakeBackend):
    """A tier whose host bounds a sandbox's ptys only by its own limit, shared by every tenant."""

    def start(self, spec: SandboxSpec) -> FakeInstance:
        if not spec.allow_weaker:
            raise exc.LimitNotEnforceable("ptys need root", setting="ptys", fix="pass allow_weaker=True")
        instance = super().start(spec)
        instance.enforcement = dataclasses.replace(instance.enforcement, weakened=(PTYS,))
        return instance


class HoldsAll(FakeBackend):
    """A tier whose host holds every setting as asked (root, cgroups, a local engine)."""

    def start(self, spec: SandboxSpec) -> FakeInstance:
        instance = super().start(spec)
        instance.enforcement = dataclasses.replace(instance.enforcement, weakened=())
        return instance


class Door:
    """API processes on one database and snapshot folder, each with the operator's table of
    the moment: acme (one live sandbox at most) allowed to accept weaker enforcement, or not."""

    def __init__(self, tmp: Path, backend: FakeBackend) -> None:
        self.tmp, self.backend = tmp, backend
        self.token, self.record = new_token("acme")
        self.services: list[Service] = []
        self.clients: list[AsyncClient] = []

    def client(self, *, allowed: bool) -> AsyncClient:
        acme = Tenant(id="acme", policy=TRUSTED, quotas=Quotas(sandboxes=1), allow_weaker=allowed)
        config = ServiceConfig(
            tenants=Tenants(tenants={"acme": acme}, tokens={self.record.id: self.record}),
            database=f"sqlite:///{self.tmp / 'service.db'}", temp_dir=self.tmp,
            snapshot_dir=self.tmp / "snapshots", advertise_url="http://service",
        )  # fmt: skip
        service = Service(config, backends=lambda tier: self.backend)
        self.services.append(service)
        client = AsyncClient(
            "http://service", self.token, transport=httpx2.ASGITransport(app=create_app(service))
        )
        self.clients.append(client)
        return client

    async def close(self) -> None:
        for client in self.clients:
            await client.aclose()
        for service in self.services:
            service.close()


@pytest.fixture
async def shared_ptys(tmp_path: Path) -> AsyncIterator[Door]:
    door = Door(tmp_path, SharedPtys(tier="process"))
    yield door
    await door.close()


async def test_a_request_alone_never_weakens_a_sandbox(shared_ptys: Door) -> None:
    client = shared_ptys.client(allowed=False)
    for _ in range(2):  # refused, its share of the quota (one sandbox) given back each time
        with pytest.raises(exc.PolicyDenied) as refused:
            await AsyncRemoteSandbox.create("process", allow_weaker=True, client=client)
        assert refused.value.problem["status"] == 403  # type: ignore[attr-defined]
        assert refused.value.rule == "tenants.acme.allow_weaker"
        assert "allow_weaker = true under [tenants.acme]" in str(refused.value) and "ptys" in str(
            refused.value
        )
    assert shared_ptys.backend.instances == []  # refused by the tier before anything started
    assert await client.sandboxes() == []
    with pytest.raises(exc.LimitNotEnforceable) as unasked:  # not asked: the tier's own refusal
        await AsyncRemoteSandbox.create("process", client=client)
    assert "allow_weaker = true under [tenants.acme]" in unasked.value.fix  # where asking counts


async def test_the_operators_consent_and_the_requests_give_a_weaker_sandbox(shared_ptys: Door) -> None:
    client = shared_ptys.client(allowed=True)
    async with await AsyncRemoteSandbox.create("process", allow_weaker=True, client=client) as sbx:
        assert sbx.info["enforcement"]["weakened"] == [PTYS]


async def test_where_nothing_is_weaker_the_requests_consent_is_moot(tmp_path: Path) -> None:
    door = Door(tmp_path, HoldsAll(tier="process"))
    try:
        client = door.client(allowed=False)
        async with await AsyncRemoteSandbox.create("process", allow_weaker=True, client=client) as sbx:
            assert sbx.info["enforcement"]["weakened"] == []
    finally:
        await door.close()


async def test_a_snapshot_or_a_pause_keeps_no_consent_the_operator_took_back(shared_ptys: Door) -> None:
    """A sandbox started from a snapshot, or resumed, comes with the allow_weaker it was taken
    with: the tenants file as it is now decides, and a refused resume leaves it paused."""
    before = shared_ptys.client(allowed=True)
    sbx = await AsyncRemoteSandbox.create("process", allow_weaker=True, client=before)
    snap = await sbx.snapshot()
    await sbx.pause()
    now = shared_ptys.client(allowed=False)  # the operator took the consent back
    with pytest.raises(exc.PolicyDenied) as forked:
        await AsyncRemoteSandbox.create(client=now, snapshot=snap.id)
    with pytest.raises(exc.PolicyDenied) as resumed:
        await AsyncRemoteSandbox.resume(sbx.id, client=now)
    assert forked.value.rule == resumed.value.rule == "tenants.acme.allow_weaker"
    assert await now.sandboxes() == []
    assert [s["paused"] for s in await now.snapshots()].count(sbx.id) == 1  # still paused
    back = await AsyncRemoteSandbox.resume(sbx.id, client=before)  # where it is allowed: back
    assert back.info["enforcement"]["weakened"] == [PTYS]
    await back.close()
