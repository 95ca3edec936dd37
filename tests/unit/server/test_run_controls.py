"""The service's run controls, through the real application (``create_app``) on a real SQLite
database, called in this process through httpx2's ASGI transport: a kill-all of a tenant's
live runs (the token's own tenant; another, or every one, for an admin token), ``stockade kill
--all --target <the service's database>``, the resume of a run its breaker stopped, and the
tenant's limits in the service's window (the API's counter apart from the runs' actions).

Runs here are agents of the SDK (``build_agent`` with the shipped fakes) watching the service's
database for their kill switch, as the service's runner makes them; runs submitted through the
API go to an executor that only records them."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import pytest
from typer.testing import CliRunner

from stockade.agent import RunResult, RunStatus
from stockade.assembly import AgentConfig, build_agent
from stockade.audit import AuditLog, MemoryStore
from stockade.cli.main import app
from stockade.models import ScriptedModel, tool_call
from stockade.policy.approval import ApprovalRequest
from stockade.policy.schema import Policy, TrustRules
from stockade.runtime.clock import ManualClock
from stockade.runtime.killswitch import KillSwitch, kill_all, kill_source_for
from stockade.runtime.limits import LocalWindow, OnLimit, RateLimit
from stockade.sandbox.ops import RunCommand
from stockade.server.context import ServiceConfig
from stockade.server.run_views import PENDING_SHOWN
from stockade.server.schemas import RunSubmit
from stockade.server.service import Service
from stockade.server.state.kills import DatabaseKillSource
from stockade.server.state.rows import RunRow
from stockade.server.state.store import ServiceStore
from stockade.server.tenants import Tenant, Tenants, new_token, parse_token
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.tools import Toolset, shell
from stockade.types import CommandResult, Limits, Trust
from tests.conftest import wait_for
from tests.unit.server._asgi import asgi_client, bearer
from tests.unit.server.test_request_bodies import OLD_CLIENTS_DEFAULT


@dataclass
class Recorded:
    """An executor that keeps what it is asked to run (nothing runs)."""

    submitted: list[tuple[str, str]] = field(default_factory=list)

    def submit(self, run_id: str, *, reason: str = "submitted") -> None:
        self.submitted.append((run_id, reason))

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Setup:
    service: Service
    executor: Recorded
    database: str
    acme: str
    admin: str
    other: str


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    acme, acme_record = new_token("acme")
    admin, admin_record = new_token("ops", admin=True)  # an operator's token
    other, other_record = new_token("other")
    tenants = Tenants(
        tenants={
            "acme": Tenant(id="acme", rate_per_minute=3),
            "other": Tenant(id="other"),
            "ops": Tenant(id="ops"),
        },
        tokens={r.id: r for r in (acme_record, admin_record, other_record)},
    )
    database = f"sqlite:///{tmp_path / 'service.db'}"
    executor = Recorded()
    service = Service(ServiceConfig(tenants=tenants, database=database, temp_dir=tmp_path), executor=executor)
    try:
        yield Setup(
            service=service, executor=executor, database=database, acme=acme, admin=admin, other=other
        )
    finally:
        service.close()


@pytest.fixture
async def http(setup: Setup) -> AsyncIterator[httpx2.AsyncClient]:
    async with asgi_client(setup.service) as client:
        yield client


@pytest.fixture
def switches(setup: Setup) -> Iterator[dict[str, KillSwitch]]:
    """Live runs of acme (two), other (one) and of no tenant's (a mark written before tenants),
    each watching the service's database as a worker's run does."""
    source = DatabaseKillSource(setup.service.store, poll_s=0.0)
    made = {
        run_id: KillSwitch(run_id, [source], poll_s=0.01, tenant=tenant)
        for run_id, tenant in (("acme-1", "acme"), ("acme-2", "acme"), ("other-1", "other"), ("old-1", None))
    }
    watches = [switch.watch() for switch in made.values()]
    for watch in watches:
        watch.__enter__()
    try:
        yield made
    finally:
        for watch in watches:
            watch.__exit__(None, None, None)


def killed(switches: dict[str, KillSwitch]) -> list[str]:
    return sorted(run_id for run_id, switch in switches.items() if switch.killed)


async def test_a_kill_all_stops_the_live_runs_of_the_tokens_tenant_only(
    http: httpx2.AsyncClient, setup: Setup, switches: dict[str, KillSwitch]
) -> None:
    response = await http.post("/v1/runs/kill", headers=bearer(setup.acme), json={"reason": "breach"})
    assert response.status_code == 200, response.text
    found = response.json()["killed"]
    assert sorted((r["run_id"], r["tenant"]) for r in found) == [("acme-1", "acme"), ("acme-2", "acme")]
    assert all(r["where"].startswith("pid ") for r in found)
    wait_for(lambda: killed(switches) == ["acme-1", "acme-2"], what="acme's runs to see the kill")
    assert switches["acme-1"]._reason == "breach"
    time.sleep(0.1)  # the others poll too: nothing reaches them
    assert killed(switches) == ["acme-1", "acme-2"]
    log = setup.service.audit.get(setup.service.tenants.tenants["acme"])
    log.flush()
    kills = [e for e in log.store.events() if e.kind.value == "kill_switch"]
    assert sorted(e.run_id for e in kills) == ["acme-1", "acme-2"]
    parsed = parse_token(setup.acme)
    assert parsed is not None
    # the token's id, as it is (written "token:ID", the redactor took it for a secret's assignment)
    assert all(e.attributes["scope"] == "all" and e.actor == f"human:api-token/{parsed[0]}" for e in kills)


async def test_only_an_admin_token_names_another_tenant_or_all(
    http: httpx2.AsyncClient, setup: Setup, switches: dict[str, KillSwitch]
) -> None:
    for body in ({"tenant": "other"}, {"all_tenants": True}):
        refused = await http.post("/v1/runs/kill", headers=bearer(setup.acme), json=body)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"] == "PolicyDenied" and refused.json()["rule"] == "tokens.admin"
    both = await http.post(
        "/v1/runs/kill", headers=bearer(setup.admin), json={"tenant": "x", "all_tenants": True}
    )
    assert both.status_code == 422 and both.json()["field"] == "tenant"
    unknown = await http.post("/v1/runs/kill", headers=bearer(setup.admin), json={"tenant": "nobody"})
    assert unknown.status_code == 404
    assert killed(switches) == [] and DatabaseKillSource(setup.service.store).reason("other-1") is None
    other = await http.post("/v1/runs/kill", headers=bearer(setup.admin), json={"tenant": "other"})
    assert [r["run_id"] for r in other.json()["killed"]] == ["other-1"]
    wait_for(lambda: killed(switches) == ["other-1"], what="other's run to see the kill")
    every = await http.post("/v1/runs/kill", headers=bearer(setup.admin), json={"all_tenants": True})
    assert sorted(r["run_id"] for r in every.json()["killed"]) == ["acme-1", "acme-2", "old-1", "other-1"]
    wait_for(lambda: len(killed(switches)) == 4, what="every run to see the kill")


async def test_a_kill_all_ends_the_tenants_waiting_runs_before_a_worker_takes_them(
    http: httpx2.AsyncClient, setup: Setup
) -> None:
    async def submit(token: str) -> str:
        made = await http.post("/v1/runs", headers=bearer(token), json={"task": "t", "scripted": ["done"]})
        assert made.status_code == 202, made.text
        return str(made.json()["run_id"])

    queued = [await submit(setup.acme), await submit(setup.acme)]
    other = await submit(setup.other)
    store = setup.service.store
    assert store.set_status(queued[1], "paused", only_from=("queued",))  # waiting for an approval
    response = await http.post("/v1/runs/kill", headers=bearer(setup.acme), json={"reason": "breach"})
    assert response.status_code == 200, response.text
    found = {r["run_id"]: r["where"] for r in response.json()["killed"]}
    assert found == {queued[0]: "queued", queued[1]: "paused"}
    for run_id in queued:  # ended where they were: no worker can take them up
        row = store.run(run_id)
        assert row is not None and row.status == "killed" and row.error == "breach"
    assert (store.run(other) or pytest.fail("gone")).status == "queued"
    log = setup.service.audit.get(setup.service.tenants.tenants["acme"])
    log.flush()
    assert sorted(e.run_id for e in log.store.events() if e.kind.value == "kill_switch") == sorted(queued)


class TakenMeanwhile(ServiceStore):
    """A store whose waiting runs a worker takes up just after they are read."""

    def waiting_runs(self, tenant: str | None = None) -> list[RunRow]:
        found = super().waiting_runs(tenant)
        for row in found:
            assert self.set_status(row.run_id, "running", only_from=("queued",))
        return found


def test_a_run_taken_up_while_a_kill_all_ends_it_has_its_switch_pulled(setup: Setup) -> None:
    store = TakenMeanwhile(setup.service.store.db)
    assert store.add_run(run_id="acme-q", tenant="acme", role=None, spec={}, labels={}, max_active=10)
    source = DatabaseKillSource(store, poll_s=0.0)
    ended = source.end_waiting("breach", tenant="acme")
    assert [(r.run_id, r.where) for r in ended] == [("acme-q", "started meanwhile")]
    assert source.reason("acme-q") == "breach"  # its worker's switch stops it
    assert (store.run("acme-q") or pytest.fail("gone")).status == "running"


def test_stockade_kill_all_ends_the_waiting_runs_of_a_services_database(setup: Setup) -> None:
    store = setup.service.store
    for run_id, tenant in (("acme-q", "acme"), ("other-q", "other")):
        assert store.add_run(run_id=run_id, tenant=tenant, role=None, spec={}, labels={}, max_active=10)
    target = ["--target", setup.database]
    done = CliRunner().invoke(app, ["kill", "--all", "--tenant", "acme", *target, "--reason", "breach"])
    assert done.exit_code == 0, done.output
    assert (
        "run acme-q ended (queued, tenant acme)" in done.output
        and "1 run(s) of tenant acme stopped" in done.output
    )
    assert (store.run("acme-q") or pytest.fail("gone")).status == "killed"
    assert (store.run("other-q") or pytest.fail("gone")).status == "queued"
    again = CliRunner().invoke(app, ["kill", "--all", "--tenant", "acme", *target])
    assert again.exit_code == 1 and "no live or waiting run of tenant acme" in again.output


def slow(op: RunCommand) -> CommandResult:
    time.sleep(0.02)
    return CommandResult(exit_code=0, stdout="", stderr="", duration_s=0.02)


def start_run(database: str, tenant: str, run_id: str, results: dict[str, RunResult]) -> threading.Thread:
    """An agent that would go on for a long while, its kill switch in the service's database."""
    config = AgentConfig(
        model=ScriptedModel([tool_call("shell", {"command": "sleep 0.02"})] * 5000 + ["done"]),
        policy=Policy(trust=TrustRules(level=Trust.TRUSTED)),
        backend=FakeBackend(MemoryWorkspace(commands=slow), tier="process"),
        audit=AuditLog(MemoryStore()),
        tools=Toolset([shell]),
        kill_target=database,
        anomaly=False,
        tenant=tenant,
    )

    def run() -> None:
        with build_agent(config) as agent:
            results[run_id] = agent.run_sync("loop", run_id=run_id)

    thread = threading.Thread(target=run, name=f"run-{run_id}")
    thread.start()
    return thread


def test_stockade_kill_all_reaches_the_runs_watching_a_services_database(setup: Setup) -> None:
    source = kill_source_for(setup.database)
    assert isinstance(source, DatabaseKillSource)
    results: dict[str, RunResult] = {}
    threads = [start_run(setup.database, t, f"{t}-1", results) for t in ("acme", "other")]
    try:
        wait_for(lambda: len(source.live_runs()) == 2, what="two live runs")
        assert "tenant acme" in (source.live("acme-1") or "")
        target = ["--target", setup.database]
        done = CliRunner().invoke(app, ["kill", "--all", "--tenant", "acme", *target, "--reason", "breach"])
        assert done.exit_code == 0, done.output
        assert "1 run(s) of tenant acme stopped" in done.output
        threads[0].join(timeout=10)
        assert results["acme-1"].status == RunStatus.KILLED and "breach" in (results["acme-1"].error or "")
        assert threads[1].is_alive() and [r.run_id for r in source.live_runs()] == ["other-1"]
        one = CliRunner().invoke(app, ["kill", "other-1", *target])
        assert one.exit_code == 0, one.output
        threads[1].join(timeout=10)
        assert results["other-1"].status == RunStatus.KILLED
        assert source.live_runs() == []
    finally:
        kill_all(source, "test cleanup")
        for thread in threads:
            thread.join(timeout=10)


async def test_a_broken_run_is_resumed_by_a_person_and_nothing_else_is(
    http: httpx2.AsyncClient, setup: Setup
) -> None:
    store = setup.service.store
    for run_id, tenant, status in (
        ("b-1", "other", "broken"),
        ("s-1", "other", "success"),
        ("a-1", "acme", "broken"),
    ):
        store.add_run(run_id=run_id, tenant=tenant, role=None, spec={"task": "t", "scripted": ["done"]},
                      labels={}, max_active=10)  # fmt: skip
        store.set_status(run_id, status)
    resumed = await http.post("/v1/runs/b-1/resume", headers=bearer(setup.other))
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["status"] == "queued" and setup.executor.submitted == [("b-1", "resumed")]
    again = await http.post("/v1/runs/b-1/resume", headers=bearer(setup.other))  # queued now, not broken
    assert again.status_code == 409 and "only a broken run" in again.json()["detail"]
    finished = await http.post("/v1/runs/s-1/resume", headers=bearer(setup.other))
    assert finished.status_code == 409
    theirs = await http.post("/v1/runs/a-1/resume", headers=bearer(setup.other))
    assert theirs.status_code == 404  # another tenant's run is not found, as a missing one
    assert setup.executor.submitted == [("b-1", "resumed")]
    log = setup.service.audit.get(setup.service.tenants.tenants["other"])
    log.flush()
    [note] = [e for e in log.store.events() if e.kind.value == "note"]
    assert note.run_id == "b-1" and note.attributes["action"] == "resume"


async def test_the_api_and_the_runs_actions_count_apart_in_the_tenants_window(
    http: httpx2.AsyncClient, setup: Setup, tmp_path: Path
) -> None:
    for _ in range(3):  # acme's rate of 3 a minute, spent on API calls
        assert (await http.get("/v1/runs", headers=bearer(setup.acme))).status_code == 200
    assert (await http.get("/v1/runs", headers=bearer(setup.acme))).status_code == 429
    # a run of acme, in the service's window, as the runner builds it: its actions still fit
    model = ScriptedModel([tool_call("shell", {"command": "echo hi"})] * 3 + ["done"])
    config = AgentConfig(
        model=model, policy=Policy(trust=TrustRules(level=Trust.TRUSTED)),
        backend=FakeBackend(MemoryWorkspace(), tier="process"), audit=AuditLog(MemoryStore()),
        tools=Toolset([shell]), kill_target=str(tmp_path / "kill"), anomaly=False, tenant="acme",
        rate_per_minute=3, on_rate_limit=OnLimit.STOP, limits_window=setup.service.limits.window,
    )  # fmt: skip
    with build_agent(config) as agent:
        assert (await agent.run("echo", run_id="r-1")).status == RunStatus.SUCCESS
        # ... and now the tenant's actions are spent too: the next run's first one is refused
        assert (await agent.run("echo", run_id="r-2")).status == RunStatus.BUDGET


def test_a_window_given_is_shared_by_agents_and_wins_over_a_redis_url(tmp_path: Path) -> None:
    clock = ManualClock()
    window = LocalWindow(clock)

    def run(run_id: str) -> tuple[RunStatus, int]:
        backend = FakeBackend(MemoryWorkspace(), tier="process")
        config = AgentConfig(
            model=ScriptedModel([tool_call("shell", {"command": "echo hi"})] * 2 + ["done"]),
            policy=Policy(trust=TrustRules(level=Trust.TRUSTED)), backend=backend,
            audit=AuditLog(MemoryStore()), tools=Toolset([shell]), kill_target=str(tmp_path / "kill"),
            anomaly=False, tenant="acme", rate_per_minute=3, rate_period_s=10.0, on_rate_limit=OnLimit.STOP,
            limits_window=window, limits_redis_url="redis://127.0.0.1:1/0",  # never reached
            clock=clock,
        )  # fmt: skip
        with build_agent(config) as agent:
            status = agent.run_sync("echo", run_id=run_id).status
        return status, sum(1 for i in backend.instances for op in i.ops if isinstance(op, RunCommand))

    assert run("w-1") == (RunStatus.SUCCESS, 2)
    assert run("w-2") == (RunStatus.BUDGET, 1)  # two agents, one window: 3 actions per 10 s
    clock.advance(10.0)  # the window is the tenant's rate_period_s
    assert run("w-3") == (RunStatus.SUCCESS, 2)
    assert RateLimit(per_minute=3, window=window, name="api").take("tenant:acme").allowed


def test_a_kill_all_pulls_the_switch_of_a_run_whose_worker_fell_silent(setup: Setup) -> None:
    """ "running" in the service's table, no fresh live mark: its worker died, and the broker
    hands the run to another, which resumes it. No mark listed it, so a kill-all missed it and
    it went on with two more calls; its switch is pulled, and the resume meets it."""
    store = setup.service.store
    assert store.add_run(run_id="acme-r", tenant="acme", role=None, spec={}, labels={}, max_active=10)
    assert store.set_status("acme-r", "running", worker="a-dead-worker", started=True)
    source = DatabaseKillSource(store, poll_s=0.0)
    ended = source.end_waiting("breach", tenant="acme")
    assert [(r.run_id, r.where) for r in ended] == [("acme-r", "its worker silent")]
    assert source.reason("acme-r") == "breach"


async def test_a_run_from_an_older_client_is_queued_and_its_stored_spec_starts(
    http: httpx2.AsyncClient, setup: Setup
) -> None:
    body = {"task": "t", "scripted": ["done"], "sandbox_limits": OLD_CLIENTS_DEFAULT}
    made = await http.post("/v1/runs", headers=bearer(setup.acme), json=body)
    assert made.status_code == 202, made.text
    run_id = str(made.json()["run_id"])
    assert setup.executor.submitted == [(run_id, "submitted")]
    # as the runner's _prepare reads it on a worker: the spec kept as sent, 65,536 files and all
    stored = RunSubmit.model_validate(setup.service.store.run_spec(run_id) or {})
    assert stored.sandbox_limits is not None and stored.sandbox_limits.inodes == 65536
    assert stored.sandbox_limits.build() == Limits()


async def test_a_tenant_verifies_its_whole_trail_one_at_a_time(
    http: httpx2.AsyncClient, setup: Setup
) -> None:
    """Verifying the whole trail reads every event of it (4 at once on a 500,000-event trail
    took 18.5 s each, both cores busy): while one runs, the tenant's next is refused with a
    Retry-After; another tenant's goes on, and the tenant's own once the first answered."""
    checks = setup.service.trail_checks
    with checks.hold("other", who="the first request"):
        refused = await http.get("/v1/audit/verify", headers=bearer(setup.other))
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        assert "one at a time" in refused.json()["detail"]
        assert (await http.get("/v1/audit/verify", headers=bearer(setup.admin))).status_code == 200
    answered = await http.get("/v1/audit/verify", headers=bearer(setup.other))
    assert answered.status_code == 200 and answered.json()["ok"] is True
    assert not checks.held("other")


async def test_a_runs_json_shows_its_latest_pending_requests_and_the_approvals_route_pages_them(
    http: httpx2.AsyncClient, setup: Setup
) -> None:
    """One run's 2,000 pending requests made every GET of it 8.3 MB, and its approvals 8.4 MB.
    The run shows the latest few with how many wait; its approvals come a page at a time."""
    # other: acme's tokens may make 3 calls a minute
    made = await http.post("/v1/runs", headers=bearer(setup.other), json={"task": "t", "scripted": ["done"]})
    run_id = str(made.json()["run_id"])
    actions = [f"run `rm -r x{i}`" for i in range(50)]
    for action in actions:
        setup.service.approvals.submit(
            ApprovalRequest(run_id=run_id, action=action, rule="rm -r", reason="r")
        )
    run = (await http.get(f"/v1/runs/{run_id}", headers=bearer(setup.other))).json()
    assert run["pending_count"] == 50
    assert [r["action"] for r in run["pending_approvals"]] == actions[::-1][:PENDING_SHOWN]  # latest first
    pages = []
    for offset in (0, 20, 40):
        page = await http.get(
            f"/v1/runs/{run_id}/approvals",
            headers=bearer(setup.other),
            params={"offset": offset, "limit": 20},
        )
        assert page.status_code == 200, page.text
        pages += page.json()
    assert [r["action"] for r in pages] == actions  # oldest first, each once
    too_many = await http.get(
        f"/v1/runs/{run_id}/approvals", headers=bearer(setup.other), params={"limit": 5000}
    )
    assert too_many.status_code == 422 and too_many.json()["field"] == "limit"


async def test_a_kill_of_a_run_whose_worker_died_ends_it_at_once(
    setup: Setup, http: httpx2.AsyncClient
) -> None:
    store = setup.service.store
    for run_id in ("alive", "orphan"):
        assert store.add_run(run_id=run_id, tenant="acme", role=None, spec={}, labels={}, max_active=10)
        assert store.set_status(run_id, "running", worker="w1", started=True)
    lease = setup.service.run_store.claim("alive", new=True)  # its worker runs it
    try:
        live = await http.post("/v1/runs/alive/kill", headers=bearer(setup.acme), json={"reason": "stop"})
        assert live.status_code == 200 and live.json()["status"] == "running"  # its switch stops it
        assert setup.service.kills.reason("alive") == "stop"
    finally:
        lease.release()
    # no process holds it: before, "running", then "killed" ~25 s later, once a worker had
    # started a fresh sandbox only to find the switch
    dead = await http.post("/v1/runs/orphan/kill", headers=bearer(setup.acme), json={"reason": "stop"})
    assert dead.status_code == 200 and dead.json()["status"] == "killed", dead.json()
    row = store.run("orphan")
    assert row is not None and row.status == "killed" and row.error == "stop"
    assert store.holds("acme") == []
