"""What a service run costs while it waits for its turn (``Runner.execute``, on a real SQLite
database, never reaching a sandbox): a run waiting for room in its tenant's quota is asked
about every few seconds, and each ask looks at the quota, not at its spec (up to the request
cap, parsed once); a run waiting for its tenant's rate window, sent again before the window has
room, waits on without starting anything."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import exceptions as exc
from stockade.server.run_waits import DEFERRED, QUOTA_POLL_S
from stockade.server.runner import Runner
from stockade.server.tenants import Tenant
from tests.integration.service_env import runner_on_sqlite, write_tenants


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[Runner]:
    path, _ = write_tenants(tmp_path, sandboxes=1, acme_rate="rate_per_minute = 2\n")
    with runner_on_sqlite(path, tmp_path) as made:
        yield made


def acme(runner: Runner) -> Tenant:
    return runner.config.tenants.current().tenants["acme"]


def submit(runner: Runner, run_id: str, spec: dict[str, object]) -> None:
    assert runner.store.add_run(run_id=run_id, tenant="acme", role="dev", spec=spec, labels={}, max_active=10)


def test_a_run_waiting_for_room_in_its_quota_is_asked_about_without_its_spec(runner: Runner) -> None:
    tenant = acme(runner)
    runner.store.reserve_sandbox(sandbox_id="s1", tenant="acme", owner="api", tier="process", cpus=0.1,
                                 memory_mb=16, quotas=tenant.quotas)  # fmt: skip
    submit(runner, "r1", {"task": "t", "scripted": ["x" * 1_000_000, "done"]})
    for _ in range(3):
        with pytest.raises(exc.QuotaExceeded):
            runner.execute("r1", tenant)
    row = runner.store.run("r1")
    assert row is not None and row.status == "queued" and "quota" in (row.error or "")
    # the spec changes under it (it cannot through the API): the asks do not read it again ...
    runner.store.db.write([("UPDATE svc_runs SET spec = ? WHERE run_id = ?", [('{"task": 5}', "r1")])])
    for _ in range(3):
        with pytest.raises(exc.QuotaExceeded):
            runner.execute("r1", tenant)
    # ... the run reads it when it has room
    runner.store.release_sandbox("s1")
    outcome = runner.execute("r1", tenant)
    assert outcome.status == "error" and "task" in (outcome.error or "")
    assert runner.store.holds("acme") == []


def test_a_run_waiting_for_its_window_sent_early_waits_on_holding_nothing(runner: Runner) -> None:
    tenant = acme(runner)
    submit(runner, "r2", {"task": "t", "scripted": ["done"]})
    why = f"{DEFERRED} rate window (2 actions per minute reached for 'tenant:acme'); again in 60 s"
    runner.store.set_status("r2", "queued", error=why)
    actions = runner.limits.actions(tenant)
    assert actions is not None
    for _ in range(2):  # the tenant's other runs took the window
        assert actions.take("tenant:acme").allowed
    with pytest.raises(exc.RunDeferred) as deferred:
        runner.execute("r2", tenant)
    assert deferred.value.retry_after is not None and 1.0 <= deferred.value.retry_after <= 60.0
    row = runner.store.run("r2")
    assert row is not None and (row.status, row.error, row.attempts) == ("queued", why, 0)
    assert runner.store.holds("acme") == []


def test_a_tenants_backlog_waiting_for_its_quota_asks_at_a_pace_its_sandboxes_set(runner: Runner) -> None:
    """acme has 1 sandbox. With no more runs queued than that, a run asks again every 2 s; with
    a backlog, every run asks as much less often (all at the same pace, so none gains by being
    young), up to 30 s: 1,000 queued runs ask ~33 times a second, not 500 (the workers' cores
    spent on asks an attack measured)."""
    tenant = acme(runner)
    submit(runner, "r0", {"task": "t", "scripted": ["done"]})
    assert runner.quota_wait_s(tenant) == QUOTA_POLL_S
    for i in range(1, 6):
        submit(runner, f"r{i}", {"task": "t", "scripted": ["done"]})
    assert runner.quota_wait_s(tenant) == 6 * QUOTA_POLL_S  # before: 2 s for each of the 6
    for i in range(6, 40):
        runner.store.add_run(run_id=f"r{i}", tenant="acme", role="dev", spec={}, labels={}, max_active=100)
    assert runner.quota_wait_s(tenant) == 30.0  # capped: a freed sandbox is taken within 30 s


def test_a_run_that_cannot_start_ends_saying_which_error_as_the_loop_does(runner: Runner) -> None:
    submit(runner, "r3", {"task": "t", "model": "scripted:turns.json"})  # the server's files: refused
    outcome = runner.execute("r3", acme(runner))
    row = runner.store.run("r3")
    assert outcome.status == "error" and row is not None and row.status == "error"
    assert (row.error or "").startswith("InvalidArgument: scripted:FILE names a file"), row.error
