"""A kill answered while a run ran ends that run "killed", on SQLite and on PostgreSQL: the
end (or the pause) its worker writes afterwards finds the switch pulled, and a decision for a
request of a run that ended is refused. (A kill answered "running" as a resumed run started
was followed by the approved action and "success"; a decision was accepted for a run killed
a moment before.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import exceptions as exc
from stockade.policy.approval import ApprovalRequest, Choice
from stockade.server.state.approvals import DatabaseApprovals
from stockade.server.state.kills import DatabaseKillSource
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServiceStore]:
    url = (
        f"sqlite:///{tmp_path / 'svc.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    made = ServiceStore(open_database(url))
    try:
        yield made
    finally:
        made.close()


def running(store: ServiceStore, run_id: str) -> None:
    spec: dict[str, object] = {"task": "t", "scripted": ["done"]}
    assert store.add_run(run_id=run_id, tenant="acme", role="dev", spec=spec, labels={}, max_active=10)
    assert store.set_status(run_id, "running", worker="w", started=True)


def test_a_kill_pulled_before_a_runs_end_is_written_ends_it_killed(store: ServiceStore) -> None:
    running(store, "r1")
    kills = DatabaseKillSource(store)
    assert kills.pull("r1", "incident 7")
    kills.clear("r1")  # the run's watch is over: its switch stays for the end written next
    # its worker writes the end its agent reached, which it finished after the kill
    assert store.set_status("r1", "success", only_from=("running",), killed_if_pulled=True)
    row = store.run("r1")
    assert row is not None and (row.status, row.error) == ("killed", "incident 7"), row
    assert kills.reason_now("r1") is None  # the switch went with the run's end


def test_a_run_that_ended_before_the_kill_pulls_nothing(store: ServiceStore) -> None:
    running(store, "r1")
    assert store.set_status("r1", "success", only_from=("running",), killed_if_pulled=True)
    kills = DatabaseKillSource(store)
    assert not kills.pull("r1", "too late")  # the kill answers "success": what happened
    assert kills.reason_now("r1") is None
    row = store.run("r1")
    assert row is not None and row.status == "success", row


def test_a_run_pausing_after_its_kill_ends_killed(store: ServiceStore) -> None:
    running(store, "r1")
    approvals = DatabaseApprovals(store)
    approvals.submit(
        ApprovalRequest(run_id="r1", action="run `rm -r x`", rule="commands.approve", reason="r")
    )
    assert DatabaseKillSource(store).pull("r1", "stop")
    store.pause("r1", error="waiting for an approval")
    row = store.run("r1")
    assert row is not None and (row.status, row.error) == ("killed", "stop"), row


def test_a_switch_for_a_run_the_service_does_not_have_is_pulled_and_cleared_as_before(
    store: ServiceStore,
) -> None:
    kills = DatabaseKillSource(store)
    assert kills.pull("local-run", "stop")  # a local run watching the service's database
    assert kills.reason_now("local-run") == "stop"
    kills.clear("local-run")
    assert kills.reason_now("local-run") is None


def test_a_decision_for_a_request_of_a_run_that_ended_is_refused(store: ServiceStore) -> None:
    running(store, "r1")
    approvals = DatabaseApprovals(store)
    request = ApprovalRequest(run_id="r1", action="run `rm -r x`", rule="commands.approve", reason="r")
    approvals.submit(request)
    assert store.pause("r1", error="waiting for an approval")
    # killed where it waited, between the API's look at the run ("paused") and the decision
    assert store.set_status("r1", "killed", error="stop", only_from=("paused",))
    with pytest.raises(exc.RunConflict, match="ended \\(killed\\)"):
        approvals.decide("r1", request.id, Choice.APPROVED, by="api-token/t")
    assert [r["status"] for r in approvals.requests("r1")] == ["pending"]  # nothing recorded
