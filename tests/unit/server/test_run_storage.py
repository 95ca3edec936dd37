"""What a run keeps in the service's database counts against its tenant's ``storage_mb``
(``ServiceStore`` and ``RunStore`` on one real SQLite file): its spec from its submission, its
run store rows from when it stops; a run that ended is erased whole, its bytes free."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import exceptions as exc
from stockade.agent.state import RunState
from stockade.models.messages import UserMessage
from stockade.runs.store import RunStore
from stockade.server.context import ServiceConfig
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore
from stockade.server.tenants import Tenants
from stockade.types import MiB


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[ServiceStore, RunStore]]:
    url = f"sqlite:///{tmp_path / 'service.db'}"
    runs = RunStore(open_database(url), namespace="runs")
    service = ServiceStore(open_database(url), runs=runs.ns)
    yield service, runs
    service.close()
    runs.close()


def spec_of(size: int) -> dict[str, object]:
    """A spec whose JSON is about ``size`` bytes (a scripted model's unused turns)."""
    return {"task": "t", "scripted": ["done", "x" * size]}


def submit(service: ServiceStore, run_id: str, spec: dict[str, object], *, max_bytes: int = MiB) -> bool:
    return service.add_run(
        run_id=run_id, tenant="acme", role=None, spec=spec, labels={}, max_active=100, max_bytes=max_bytes
    )


def test_a_runs_spec_counts_and_one_past_the_quota_is_refused(stores: tuple[ServiceStore, RunStore]) -> None:
    service, _ = stores
    assert submit(service, "r1", spec_of(600 * 1024))
    assert service.stored_bytes("acme") == len(json.dumps(spec_of(600 * 1024)))
    with pytest.raises(exc.QuotaExceeded) as full:
        submit(service, "r2", spec_of(600 * 1024))
    assert full.value.quota == "storage_mb" and full.value.limit == 1.0
    assert "this run's spec" in str(full.value) and "DELETE /v1/runs/ID" in str(full.value)
    assert service.run("r2") is None and service.stored_bytes("other") == 0
    # another tenant's storage is its own
    assert service.add_run(run_id="o1", tenant="other", role=None, spec=spec_of(600 * 1024), labels={},
                           max_active=100, max_bytes=MiB)  # fmt: skip


def test_a_stopped_runs_rows_in_the_run_store_count(stores: tuple[ServiceStore, RunStore]) -> None:
    service, runs = stores
    assert submit(service, "r1", {"task": "t"})
    spec = service.stored_bytes("acme")
    assert service.set_status("r1", "running", started=True)
    lease = runs.claim("r1", new=True)
    state = RunState(run_id="r1", task="t", system="s", model_name="scripted")
    state.messages.append(UserMessage(content="é" * 100_000))  # 2 bytes each in UTF-8
    runs.save(state)
    lease.release()
    assert service.stored_bytes("acme") == spec  # measured when it stops, not as it goes
    assert service.set_status("r1", "success")
    assert service.stored_bytes("acme") - spec >= 200_000  # bytes, not characters
    assert service.run_bytes("r1") == service.stored_bytes("acme")


def test_only_a_run_that_ended_is_forgotten_and_its_bytes_with_it(
    stores: tuple[ServiceStore, RunStore],
) -> None:
    service, _ = stores
    assert submit(service, "r1", spec_of(600 * 1024))
    assert not service.forget_run("r1")  # queued
    assert service.set_status("r1", "running", started=True) and not service.forget_run("r1")
    assert service.set_status("r1", "killed", error="enough")
    assert service.forget_run("r1")
    assert service.run("r1") is None and service.stored_bytes("acme") == 0
    assert not service.forget_run("r1")
    assert submit(service, "r2", spec_of(600 * 1024))  # room again


def test_runs_submitted_before_their_bytes_were_kept_count_once_the_service_restarts(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'service.db'}"
    service = ServiceStore(open_database(url))
    assert submit(service, "r1", spec_of(1000))
    service.db.write([("DELETE FROM svc_run_bytes", [()])])  # as a database of an older version
    assert service.stored_bytes("acme") == 0
    service.close()
    again = ServiceStore(open_database(url))
    try:
        assert again.stored_bytes("acme") == len(json.dumps(spec_of(1000)))
    finally:
        again.close()


def test_the_runs_due_for_erasure_are_those_that_ended_before_the_cutoff(
    stores: tuple[ServiceStore, RunStore],
) -> None:
    service, _ = stores
    for run_id in ("r1", "r2", "r3"):
        assert submit(service, run_id, {"task": "t"})
    assert service.set_status("r2", "success") and service.set_status("r1", "killed")
    cutoff = time.time_ns()
    assert service.set_status("r3", "running", started=True)  # running: never due
    assert [r.run_id for r in service.ended_runs("acme", before_ns=cutoff, limit=10)] == ["r2", "r1"]
    assert [r.run_id for r in service.ended_runs("acme", before_ns=cutoff, limit=1)] == ["r2"]
    assert service.ended_runs("acme", before_ns=cutoff - 10**12, limit=10) == []
    assert service.ended_runs("other", before_ns=cutoff, limit=10) == []


def test_a_retention_is_positive_days() -> None:
    with pytest.raises(exc.ConfigurationError, match="keep_runs_days"):
        ServiceConfig(tenants=Tenants(tenants={}, tokens={}), keep_runs_days=0)


def test_a_live_page_learns_a_runs_newest_event_however_many_came(
    stores: tuple[ServiceStore, RunStore], tmp_path: Path
) -> None:
    """What the viewer's live page polls: the newest seq of the run past the one it shows (it
    read up to 500 whole rows to name the 500th), none where nothing came."""
    from stockade.audit import AuditLog, EventKind, SQLiteStore

    service, _ = stores
    with SQLiteStore(tmp_path / "service.db", namespace="t_acme") as audit:
        log = AuditLog(audit, flush_interval_s=None)
        for i in range(600):
            log.record(EventKind.TOOL_CALL, run_id="r1" if i % 3 else "r2")
        log.close()
        newest = max(row.seq for row in audit.rows(run_id="r1"))
    assert service.audit_last_seq("t_acme", "r1", 0) == newest
    assert service.audit_last_seq("t_acme", "r1", newest) is None
    assert service.audit_last_seq("t_acme", "nope", 0) is None
