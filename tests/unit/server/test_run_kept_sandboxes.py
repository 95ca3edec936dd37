"""The sandbox a paused run kept in its tenant's snapshot store (``run/<id>``, listed nowhere,
counted against ``snapshot_mb``) goes once the run ends for good, however it ends: killed
(``POST /v1/runs/{id}/kill``, a kill-all), deleted (``DELETE /v1/runs/{id}``, the retention),
ended by a worker, or by ``stockade kill --all`` on the service's database (which knows no
snapshot folder: the service drops it at its start, its sweeps, and before a snapshot of the
tenant). A run that waits keeps its own. And a run that goes on is held to its tenant's
ceilings as they are now.

Through the real application on a real SQLite database and real snapshot stores (the run's
snapshot written as a tier writes it); runs submitted go to an executor that only records them."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest
from typer.testing import CliRunner

from stockade.cli.main import app
from stockade.runs.snapshots import ref_name
from stockade.sandbox._snapshot_files import MiB
from stockade.sandbox.snapshots import SnapshotStore
from stockade.server.context import ServiceConfig
from stockade.server.runner import Runner
from stockade.server.service import Service
from stockade.server.tenants import Quotas, Tenant, Tenants, new_token
from stockade.types import SnapshotKind
from tests.unit.server._asgi import asgi_client, bearer
from tests.unit.server.test_run_controls import Recorded


@dataclass(frozen=True)
class Setup:
    service: Service
    config: ServiceConfig
    database: str
    acme: str


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    acme, record = new_token("acme")
    tenants = Tenants(
        tenants={"acme": Tenant(id="acme", quotas=Quotas(snapshot_mb=10))}, tokens={record.id: record}
    )
    database = f"sqlite:///{tmp_path / 'service.db'}"
    config = ServiceConfig(tenants=tenants, database=database, temp_dir=tmp_path)
    service = Service(config, executor=Recorded())
    try:
        yield Setup(service=service, config=config, database=database, acme=acme)
    finally:
        service.close()


@pytest.fixture
async def http(setup: Setup) -> AsyncIterator[httpx2.AsyncClient]:
    async with asgi_client(setup.service) as client:
        yield client


def acme_store(setup: Setup) -> SnapshotStore:
    return setup.service.snapshots.store(setup.service.tenants.tenants["acme"])


def keep_sandbox(setup: Setup, run_id: str, mib: int = 3) -> None:
    """The run's sandbox kept as ``RunSnapshots.keep`` keeps it when the run pauses."""
    store = acme_store(setup)
    taken = store.save(
        kind=SnapshotKind.FILES, tier="process", source="sbx-1", spec={},
        blobs={"workspace": store.add_bytes(os.urandom(mib * MiB))},
    )  # fmt: skip
    store.set_ref("run", ref_name(run_id), taken.id, run=run_id)


def kept(setup: Setup) -> list[str]:
    """The runs whose sandbox acme's store keeps, and it holds nothing else."""
    store = acme_store(setup)
    runs = sorted((store.ref("run", name) or {}).get("run", "") for name, _ in store.refs("run"))
    assert store.size() <= len(runs) * 3 * MiB + MiB, "objects of a run let go stayed"
    return runs


def paused_run(setup: Setup, spec: dict[str, object] | None = None) -> str:
    """A run of acme paused for an approval, its sandbox kept."""
    run_id = uuid.uuid4().hex
    store = setup.service.store
    added = store.add_run(
        run_id=run_id, tenant="acme", role=None, spec={"task": "t", "scripted": ["done"], **(spec or {})},
        labels={}, max_active=10,
    )  # fmt: skip
    assert added and store.set_status(run_id, "paused", only_from=("queued",))
    keep_sandbox(setup, run_id)
    return run_id


async def test_a_paused_run_killed_lets_its_sandbox_go_and_deleted_leaves_nothing(
    http: httpx2.AsyncClient, setup: Setup
) -> None:
    one, two = paused_run(setup), paused_run(setup)
    assert kept(setup) == sorted([one, two])
    killed = await http.post(f"/v1/runs/{one}/kill", headers=bearer(setup.acme), json={"reason": "no"})
    assert killed.json()["status"] == "killed"
    assert kept(setup) == [two]  # the other still waits: its own stays
    assert (await http.delete(f"/v1/runs/{one}", headers=bearer(setup.acme))).status_code == 204
    assert kept(setup) == [two]


async def test_a_kill_all_lets_the_sandboxes_of_the_runs_it_ends_go(
    http: httpx2.AsyncClient, setup: Setup
) -> None:
    paused_run(setup)
    paused_run(setup)
    response = await http.post("/v1/runs/kill", headers=bearer(setup.acme), json={"reason": "breach"})
    assert len(response.json()["killed"]) == 2
    assert kept(setup) == [] and acme_store(setup).size() == 0


async def test_a_run_ended_by_the_cli_loses_its_sandbox_on_delete_or_to_the_service(
    http: httpx2.AsyncClient, setup: Setup
) -> None:
    """``stockade kill --all`` knows the database, not the snapshot folder: the run's sandbox
    stays until the run is deleted, a snapshot of the tenant needs room, a sweep, or a start."""
    runs = [paused_run(setup) for _ in range(3)]
    done = CliRunner().invoke(app, ["kill", "--all", "--tenant", "acme", "--target", setup.database])
    assert done.exit_code == 0, done.output
    assert kept(setup) == sorted(runs)
    assert (await http.delete(f"/v1/runs/{runs[0]}", headers=bearer(setup.acme))).status_code == 204
    assert kept(setup) == sorted(runs[1:])  # a deleted run is erased, its sandbox too
    # 6 MiB of a 10 MiB quota kept for runs that ended: before a snapshot of the tenant, they go
    snapshots, tenant = setup.service.snapshots, setup.service.tenants.tenants["acme"]
    assert snapshots.check_room(tenant).size() == 0 and kept(setup) == []
    keep_sandbox(setup, runs[1])
    setup.service.retention.sweep()
    assert kept(setup) == []
    keep_sandbox(setup, runs[2])
    keep_sandbox(setup, "never-the-services")
    setup.service.snapshots.collect()  # at the service's start
    assert kept(setup) == []


def test_the_services_sweeps_keep_the_sandbox_of_a_run_that_waits(setup: Setup) -> None:
    waits = paused_run(setup)
    setup.service.snapshots.collect()
    setup.service.retention.sweep()
    setup.service.snapshots.check_room(setup.service.tenants.tenants["acme"])
    assert kept(setup) == [waits]


def test_a_worker_that_finds_the_run_ended_lets_its_sandbox_go(setup: Setup) -> None:
    run_id = paused_run(setup)
    assert setup.service.store.set_status(run_id, "killed", only_from=("paused",))  # as the CLI does
    runner = Runner(setup.config, name="worker")
    try:
        assert runner.execute(run_id, setup.service.tenants.tenants["acme"]).status == "killed"
    finally:
        runner.close()
    assert kept(setup) == []


def test_a_run_that_goes_on_is_held_to_its_tenants_ceilings_as_they_are_now(setup: Setup) -> None:
    """Paused asking for 8 MiB of output; its tenant's ceiling lowered to 1 MiB meanwhile (a new
    submission asking as much is refused): decided, it does not go on with the 8 MiB either."""
    run_id = paused_run(setup, {"sandbox_limits": {"output_bytes": 8 * MiB}})
    assert setup.service.store.set_status(run_id, "queued", only_from=("paused",))  # its approval decided
    lowered = Tenant(id="acme", quotas=Quotas(snapshot_mb=10, output_bytes=MiB))
    runner = Runner(setup.config, name="worker")
    try:
        outcome = runner.execute(run_id, lowered)
    finally:
        runner.close()
    row = setup.service.store.run(run_id)
    assert row is not None and outcome.status == row.status == "error"
    assert row.error is not None
    assert "quotas as they are now" in row.error and f"output_bytes={8 * MiB}" in row.error, row.error
    assert kept(setup) == []  # it ended: its sandbox goes with it
