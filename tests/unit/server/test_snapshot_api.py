"""Snapshots through the service (the real application through httpx2's ASGI transport, real
SQLite, real snapshot stores, the shipped ``FakeBackend`` as the tier): a snapshot forks
sandboxes, a pause frees the live quota and a resume from another client brings the sandbox
back under its id, a tenant never reaches another's snapshots, the errors are the SDK's,
the trail records them, and a process that does not share the store says where it is."""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from stockade import exceptions as exc
from stockade.audit.events import EventKind
from stockade.client import AsyncClient, AsyncRemoteSandbox
from stockade.policy.schema import Policy
from stockade.sandbox.snapshots import SnapshotStore
from stockade.server.app import create_app
from stockade.server.context import ServiceConfig
from stockade.server.service import Service
from stockade.server.tenants import Quotas, Tenant, Tenants, new_token
from stockade.testing import FakeBackend
from stockade.types import NetworkPolicy, SnapshotKind


@dataclass(frozen=True)
class Up:
    service: Service
    client: Callable[[str], AsyncClient]
    acme: str
    other: str


TRUSTED = Policy.model_validate({"trust": {"level": "trusted"}})  # the process tier (a fake here)


def make_tenants(acme: Quotas) -> tuple[Tenants, str, str]:
    acme_token, acme_record = new_token("acme")
    other_token, other_record = new_token("other")
    tenants = Tenants(
        tenants={
            "acme": Tenant(id="acme", quotas=acme, policy=TRUSTED),
            "other": Tenant(id="other", policy=TRUSTED),
        },
        tokens={acme_record.id: acme_record, other_record.id: other_record},
    )
    return tenants, acme_token, other_token


@dataclass
class Services:
    """Services on one database (as API processes), each with its ASGI clients."""

    database: str
    tmp: Path
    backend: FakeBackend
    opened: list[Service]
    clients: list[AsyncClient]

    def start(self, tenants: Tenants, snapshot_dir: Path, url: str = "http://service") -> Service:
        config = ServiceConfig(
            tenants=tenants, database=self.database, temp_dir=self.tmp, snapshot_dir=snapshot_dir,
            advertise_url=url,
        )  # fmt: skip
        service = Service(config, backends=lambda tier: self.backend)
        self.opened.append(service)
        return service

    def client(self, service: Service, token: str) -> AsyncClient:
        transport = httpx2.ASGITransport(app=create_app(service))
        client = AsyncClient("http://service", token, transport=transport)
        self.clients.append(client)
        return client


@pytest.fixture
async def services(tmp_path: Path) -> AsyncIterator[Services]:
    made = Services(
        database=f"sqlite:///{tmp_path / 'service.db'}", tmp=tmp_path, backend=FakeBackend(tier="process"),
        opened=[], clients=[],
    )  # fmt: skip
    try:
        yield made
    finally:
        for client in made.clients:
            await client.aclose()
        for service in made.opened:
            service.close()


@pytest.fixture
def up(services: Services, tmp_path: Path) -> Up:
    tenants, acme, other = make_tenants(Quotas(sandboxes=1, snapshot_mb=64))
    service = services.start(tenants, tmp_path / "snapshots")
    return Up(service=service, client=lambda token: services.client(service, token), acme=acme, other=other)


async def test_a_snapshot_starts_sandboxes_that_each_have_its_files(up: Up) -> None:
    client = up.client(up.acme)
    sbx = await AsyncRemoteSandbox.create("process", client=client, labels={"job": "prep"})
    await sbx.files.write("data/input.txt", "prepared")
    snap = await sbx.snapshot()
    assert snap.id.startswith("snap-") and snap.kind is SnapshotKind.FILES and snap.tier == "process"
    assert snap.source == sbx.id and snap.store == "http://service"  # the service keeps it
    await sbx.files.write("data/input.txt", "changed after")
    await sbx.close()
    for given in (snap, snap.id):  # the value, or its id
        async with await AsyncRemoteSandbox.create(client=client, snapshot=given) as fork:
            assert fork.id != sbx.id and fork.tier == "process"
            assert await fork.files.read("data/input.txt") == "prepared"
            assert await fork.files.read_range("data/input.txt", 3, 3) == b"par"
            assert fork.info["labels"] == {"job": "prep"} and "snapshot" in fork.info["tier_reason"]
            await fork.files.write("data/input.txt", "mine")
    listed = await client.snapshots()
    assert [(s["id"], s["source"], s["paused"]) for s in listed] == [(snap.id, sbx.id, None)]
    await client.delete_snapshot(snap)
    with pytest.raises(exc.SnapshotNotFound):
        await AsyncRemoteSandbox.create(client=client, snapshot=snap.id)


async def test_a_pause_frees_the_live_quota_and_another_client_resumes_it(up: Up) -> None:
    first, second = up.client(up.acme), up.client(up.acme)
    sbx = await AsyncRemoteSandbox.create("process", client=first)
    await sbx.files.write("notes.txt", "before the night")
    with pytest.raises(exc.QuotaExceeded) as full:  # a quota of one live sandbox
        await AsyncRemoteSandbox.create("process", client=first)
    assert full.value.quota == "sandboxes"
    paused = await sbx.pause()
    assert paused.source == sbx.id and paused.kind is SnapshotKind.FILES
    assert await first.sandboxes() == []  # paused: not live, no share of the quota
    assert [(s["id"], s["paused"]) for s in await first.snapshots()] == [(paused.id, sbx.id)]
    async with await AsyncRemoteSandbox.create("process", client=first) as meanwhile:
        assert await meanwhile.files.exists("notes.txt") is False
        with pytest.raises(exc.QuotaExceeded):  # a resume needs its place back: it stays paused
            await AsyncRemoteSandbox.resume(sbx.id, client=second)
    back = await AsyncRemoteSandbox.resume(sbx.id, client=second)
    try:
        assert back.id == sbx.id and back.tier == "process"
        assert await back.files.read("notes.txt") == "before the night"
        assert [s["id"] for s in await second.sandboxes()] == [sbx.id]
        assert await second.snapshots() == []  # the pause's snapshot went with the resume
        with pytest.raises(exc.SnapshotNotFound, match="running, not paused"):
            await AsyncRemoteSandbox.resume(sbx.id, client=first)
    finally:
        await back.close()
    with pytest.raises(exc.SnapshotNotFound):  # one resume wins; a closed sandbox is no paused one
        await AsyncRemoteSandbox.resume(sbx.id, client=first)


async def test_another_tenant_finds_none_of_them(up: Up) -> None:
    acme, other = up.client(up.acme), up.client(up.other)
    sbx = await AsyncRemoteSandbox.create("process", client=acme)
    snap = await sbx.snapshot()
    with pytest.raises(exc.ResourceNotFound):  # their sandbox: 404, as any
        await AsyncRemoteSandbox(other, sbx.info).snapshot()
    paused = await sbx.pause()
    for attempt in (
        lambda: AsyncRemoteSandbox.create(client=other, snapshot=snap.id),
        lambda: AsyncRemoteSandbox.resume(sbx.id, client=other),
        lambda: other.delete_snapshot(paused.id),
        lambda: other.http.request("GET", f"/v1/snapshots/{snap.id}"),
    ):
        with pytest.raises(exc.SnapshotNotFound) as missing:
            await attempt()
        assert missing.value.problem["status"] == 404  # type: ignore[attr-defined]
    assert await other.snapshots() == []
    unknown = "snap-" + "0" * 32
    with pytest.raises(exc.SnapshotNotFound) as never:  # the same answer as for one that never was
        await AsyncRemoteSandbox.create(client=acme, snapshot=unknown)
    assert never.value.problem["title"] == "No such snapshot"  # type: ignore[attr-defined]
    back = await AsyncRemoteSandbox.resume(sbx.id, client=acme)  # still theirs to resume
    await back.close()


async def test_errors_are_the_sdk_s_problems_and_name_no_server_folder(up: Up, tmp_path: Path) -> None:
    client = up.client(up.acme)
    async with await AsyncRemoteSandbox.create("process", client=client) as sbx:
        with pytest.raises(exc.LimitNotEnforceable) as memory:
            await sbx.snapshot(memory=True)
        assert memory.value.problem["status"] == 422  # type: ignore[attr-defined]
        await sbx.files.write("a.txt", "x")
        snap = await sbx.snapshot()
    for obj in (tmp_path / "snapshots" / "acme" / "objects").iterdir():
        obj.chmod(0o600)
        obj.write_bytes(b"tampered")
    with pytest.raises(exc.SnapshotCorrupt) as corrupt:
        await AsyncRemoteSandbox.create(client=client, snapshot=snap)
    assert corrupt.value.problem["status"] == 422  # type: ignore[attr-defined]
    assert str(tmp_path) not in str(corrupt.value)
    response = await client.http._client.post("/v1/sandboxes", json={"snapshot": "latest"})
    assert response.status_code == 422 and response.json()["field"] == "snapshot"


async def test_a_full_snapshot_quota_is_refused_as_a_quota(services: Services, tmp_path: Path) -> None:
    tenants, acme, _ = make_tenants(Quotas(snapshot_mb=0))
    client = services.client(services.start(tenants, tmp_path / "snapshots"), acme)
    async with await AsyncRemoteSandbox.create("process", client=client) as sbx:
        await sbx.files.write("a.txt", "x" * 10_000)
        with pytest.raises(exc.QuotaExceeded) as full:
            await sbx.snapshot()
    assert (full.value.quota, full.value.limit) == ("snapshot_mb", 0)
    assert full.value.problem["status"] == 429  # type: ignore[attr-defined]
    assert await client.snapshots() == []


async def test_a_snapshot_larger_than_the_room_left_is_refused_as_a_quota(
    services: Services, tmp_path: Path
) -> None:
    # The store had room when asked, the snapshot did not fit it: a 500 ("not taken"), since
    # the refused snapshot was gone from the store by the time the error was read.
    tenants, acme, _ = make_tenants(Quotas(snapshot_mb=1))
    client = services.client(services.start(tenants, tmp_path / "snapshots"), acme)
    async with await AsyncRemoteSandbox.create("process", client=client) as sbx:
        await sbx.files.write("a.bin", os.urandom(2 << 20))
        with pytest.raises(exc.QuotaExceeded) as full:
            await sbx.snapshot()
    assert (full.value.quota, full.value.limit) == ("snapshot_mb", 1)
    assert await client.snapshots() == []


async def test_the_tenant_s_trail_records_taking_and_restoring(up: Up) -> None:
    client = up.client(up.acme)
    sbx = await AsyncRemoteSandbox.create("process", client=client)
    snap = await sbx.snapshot()
    paused = await sbx.pause()
    back = await AsyncRemoteSandbox.resume(sbx.id, client=client)
    await back.close()
    log = up.service.audit.get(up.service.tenants.tenants["acme"])
    log.flush()
    events = [e for e in log.store.events(run_id=sbx.id) if e.kind.value.startswith("snapshot")]
    taken = [e.attributes.get("op") for e in events if e.kind is EventKind.SNAPSHOT_TAKE]
    assert taken == ["snapshot", "pause"]
    assert [e.attributes.get("snapshot_id") for e in events] == [snap.id, paused.id, paused.id]
    assert [e.kind for e in events][-1] is EventKind.SNAPSHOT_RESTORE  # the resume, under the same id
    # the tenant's trail names its store, never the host's folder it is in
    root = str(up.service.snapshots.store(up.service.tenants.tenants["acme"]).root)
    assert all(root not in json.dumps(e.attributes) for e in events)
    assert {e.attributes.get("store") for e in events if e.kind is EventKind.SNAPSHOT_TAKE} == {"tenant:acme"}
    assert (await client.verify_audit())["ok"] is True


async def test_processes_that_do_not_share_the_store_say_where_a_snapshot_is(
    services: Services, tmp_path: Path
) -> None:
    tenants, acme, _ = make_tenants(Quotas())
    a = services.start(tenants, tmp_path / "store-a", url="http://10.1.1.1:8080")
    apart = services.start(tenants, tmp_path / "store-b", url="http://10.1.1.2:8080")
    shared = services.start(tenants, tmp_path / "store-a", url="http://10.1.1.3:8080")
    on_a = services.client(a, acme)
    sbx = await AsyncRemoteSandbox.create("process", client=on_a)
    await sbx.files.write("f.txt", "from a")
    snap = await sbx.snapshot()
    await sbx.pause()
    with pytest.raises(exc.SnapshotNotFound, match=r"http://10\.1\.1\.1:8080.*does not share"):
        await AsyncRemoteSandbox.create(client=services.client(apart, acme), snapshot=snap.id)
    with pytest.raises(exc.SnapshotNotFound, match=r"snapshot-dir"):
        await AsyncRemoteSandbox.resume(sbx.id, client=services.client(apart, acme))
    on_shared = services.client(shared, acme)
    async with await AsyncRemoteSandbox.create(client=on_shared, snapshot=snap.id) as fork:
        assert await fork.files.read("f.txt") == "from a"
    back = await AsyncRemoteSandbox.resume(sbx.id, client=on_shared)
    assert await back.files.read("f.txt") == "from a"
    await back.close()


async def test_a_kept_allowlist_the_policy_no_longer_gives_starts_and_resumes_nowhere(
    services: Services, tmp_path: Path
) -> None:
    """A snapshot keeps the network its sandbox had; a start from it and a resume judge it
    again by the policy as it is now. Once the operator stops giving the host's loopback
    (its ``allow_addresses``), a kept allowlist naming ``127.0.0.1`` is refused on both
    ways back, as a new sandbox asking for it is."""
    token, record = new_token("acme")

    def tenants(network: dict[str, object]) -> Tenants:
        policy = Policy.model_validate({"trust": {"level": "trusted"}, "network": network})
        acme = Tenant(id="acme", quotas=Quotas(sandboxes=2, snapshot_mb=64), policy=policy)
        return Tenants(tenants={"acme": acme}, tokens={record.id: record})

    before = services.start(
        tenants({"enabled": True, "allow_addresses": ["127.0.0.0/8"]}), tmp_path / "snaps"
    )
    loopback = NetworkPolicy(allow_hosts=("127.0.0.1:6443",))
    sbx = await AsyncRemoteSandbox.create("process", network=loopback, client=services.client(before, token))
    snap = await sbx.snapshot()
    await sbx.pause()
    after = services.start(tenants({"enabled": True}), tmp_path / "snaps")  # the whole network, no more
    client = services.client(after, token)
    attempts: list[Callable[[], Awaitable[AsyncRemoteSandbox]]] = [
        lambda: AsyncRemoteSandbox.create("process", network=loopback, client=client),
        lambda: AsyncRemoteSandbox.create(client=client, snapshot=snap.id),
        lambda: AsyncRemoteSandbox.resume(sbx.id, client=client),
    ]
    for attempt in attempts:
        with pytest.raises(exc.PolicyDenied) as denied:
            await attempt()
        assert denied.value.rule == "network.allow_hosts" and "127.0.0.1" in str(denied.value)
    assert await client.sandboxes() == []


def as_memory(store: SnapshotStore, snapshot_id: str, ref: tuple[str, str]) -> str:
    """The snapshot made again as one of memory (the fake keeps files only): what the service
    decides from its kind, its tier and the rules it was taken under."""
    kept = store.load(snapshot_id)
    saved = store.save(
        kind=SnapshotKind.MEMORY, tier=kept.snapshot.tier, source=kept.snapshot.source,
        spec=kept.spec, blobs=kept.blobs, ref=ref,
    )  # fmt: skip
    return saved.id


async def test_a_memory_snapshot_under_a_policy_changed_since_is_refused_naming_the_change(
    services: Services, tmp_path: Path
) -> None:
    """A memory snapshot's supervisor and kernel hold the rules its sandbox was started with:
    restored under the policy's new ones, it enforced the old while it reported the new (an
    attack ran ``whoami`` its tenant's policy now denies). A start from it and a resume are
    refused, naming what changed; the paused sandbox stays paused, and under the policy it
    was taken with it comes back."""
    token, record = new_token("acme")

    def tenants(commands: dict[str, object]) -> Tenants:
        policy = Policy.model_validate({"trust": {"level": "trusted"}, "commands": commands})
        acme = Tenant(id="acme", quotas=Quotas(sandboxes=2, snapshot_mb=64), policy=policy)
        return Tenants(tenants={"acme": acme}, tokens={record.id: record})

    first = tenants({})
    before = services.start(first, tmp_path / "snaps")
    store = before.snapshots.store(first.tenants["acme"])
    sbx = await AsyncRemoteSandbox.create("process", client=services.client(before, token))
    memory = as_memory(store, (await sbx.snapshot()).id, ("kept", ""))
    paused = await sbx.pause()
    store.set_ref("paused", sbx.id, as_memory(store, paused.id, ("kept", "")))
    after = services.start(tenants({"deny": ["whoami"]}), tmp_path / "snaps")
    client = services.client(after, token)
    with pytest.raises(exc.SnapshotIncompatible, match=r"policy has changed since \(deny \('whoami',\)"):
        await AsyncRemoteSandbox.create(client=client, snapshot=memory)
    with pytest.raises(exc.SnapshotIncompatible, match="it stays paused"):
        await AsyncRemoteSandbox.resume(sbx.id, client=client)
    assert await client.sandboxes() == []
    again = services.client(services.start(tenants({}), tmp_path / "snaps"), token)
    async with await AsyncRemoteSandbox.create(client=again, snapshot=memory):
        pass
    async with await AsyncRemoteSandbox.resume(sbx.id, client=again):
        pass


async def test_a_memory_snapshot_whose_hosts_the_policy_narrowed_since_is_refused(
    services: Services, tmp_path: Path
) -> None:
    """A memory snapshot's egress proxy holds the network its sandbox was started with: the
    policy's methods, ports and rates for its hosts then. Judged again, only a host no longer
    allowed was refused; one still allowed came back with the old rules (POST where the
    policy now lets only GET). A start and a resume are refused, naming the network; under
    the policy it was taken with it comes back."""
    token, record = new_token("acme")

    def tenants(methods: list[str], rate: int = 600) -> Tenants:
        network = {"allow": [{"host": "pypi.org", "methods": methods}], "max_requests_per_minute": rate}
        policy = Policy.model_validate({"trust": {"level": "trusted"}, "network": network})
        acme = Tenant(id="acme", quotas=Quotas(sandboxes=2, snapshot_mb=64), policy=policy)
        return Tenants(tenants={"acme": acme}, tokens={record.id: record})

    first = tenants(["GET", "POST"])
    before = services.start(first, tmp_path / "snaps")
    store = before.snapshots.store(first.tenants["acme"])
    pypi = NetworkPolicy(allow_hosts=("pypi.org",))
    sbx = await AsyncRemoteSandbox.create("process", network=pypi, client=services.client(before, token))
    memory = as_memory(store, (await sbx.snapshot()).id, ("kept", ""))
    paused = await sbx.pause()
    store.set_ref("paused", sbx.id, as_memory(store, paused.id, ("kept", "")))
    methods = "network hosts pypi.org ports 80,443 methods GET, not pypi.org ports 80,443 methods GET,POST"
    narrowed = {
        methods: tenants(["GET"]),
        "network max_requests_per_minute 60, not 600": tenants(["GET", "POST"], 60),
    }
    for change, policy in narrowed.items():
        client = services.client(services.start(policy, tmp_path / "snaps"), token)
        with pytest.raises(exc.SnapshotIncompatible, match=re.escape(f"policy has changed since ({change})")):
            await AsyncRemoteSandbox.create(client=client, snapshot=memory)
        with pytest.raises(exc.SnapshotIncompatible, match=r"network.*it stays paused"):
            await AsyncRemoteSandbox.resume(sbx.id, client=client)
        assert await client.sandboxes() == []
    again = services.client(services.start(tenants(["GET", "POST"]), tmp_path / "snaps"), token)
    async with await AsyncRemoteSandbox.create(client=again, snapshot=memory):
        pass
    async with await AsyncRemoteSandbox.resume(sbx.id, client=again):
        pass

    # on another tier its memory stays behind: its files come back with the network as it is now
    kept = store.load(memory)
    elsewhere = store.save(
        kind=SnapshotKind.MEMORY, tier="microvm", source=kept.snapshot.source, spec=kept.spec,
        blobs=kept.blobs, ref=("kept", ""),
    ).id  # fmt: skip
    client = services.client(services.start(tenants(["GET"]), tmp_path / "snaps"), token)
    async with await AsyncRemoteSandbox.create("process", client=client, snapshot=elsewhere):
        started = services.backend.specs[-1].network
        assert [rule.methods for rule in started.host_rules] == [("GET",)]
