"""What a tenant's runs keep in the service's database (their specs, their conversations and
tool outputs in the run store) counts against its ``storage_mb``, through a real ``stockade
serve`` (SQLite, runs in the server's process): a run that does not fit is refused, and a run
that ended is deleted whole, its bytes free, its id still taken, its audit trail intact."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from stockade import exceptions as exc
from stockade.client import Client, RemoteRun
from stockade.runs.store import RunStore
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore
from tests.conftest import require_tier, wait_for
from tests.integration.service_env import Server, Tokens, embedded_server, write_tenants

pytestmark = [pytest.mark.process]

# acme keeps at most 2 MiB; a spec of 1.2 MiB fits once
PAD = ["x" * 1000] * 1200
SLEEP = {"name": "run_code", "args": {"code": "import time; time.sleep(60)", "language": "python"}}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens, Path]]:
    require_tier("process")
    with embedded_server(tmp_path_factory.mktemp("storage"), storage_mb=2) as running:
        yield running


@pytest.fixture
def acme(service: tuple[Server, Tokens, Path]) -> Iterator[Client]:
    server, tokens, _ = service
    with Client(server.url, tokens.acme) as client:
        yield client


def kept(service: tuple[Server, Tokens, Path], run_id: str) -> int | None:
    """What the service counts of a run in its tenant's storage (spec and run store rows)."""
    store = ServiceStore(open_database(f"sqlite:///{service[2] / 'service.db'}"))
    try:
        return store.run_bytes(run_id)
    finally:
        store.close()


def finished(acme: Client, task: str, turns: list[object]) -> RemoteRun:
    run = acme.runs.submit(task, scripted=turns)
    assert run.wait(timeout_s=60).status == "success", run.info
    return run


def test_a_spec_past_the_tenants_storage_quota_is_refused(
    service: tuple[Server, Tokens, Path], acme: Client
) -> None:
    server, tokens, _ = service
    body = {"task": "big", "scripted": ["done", *PAD, *PAD]}  # 2.4 MiB: more than acme's whole 2 MiB
    with httpx2.Client(base_url=server.url, headers={"Authorization": f"Bearer {tokens.acme}"}) as http:
        refused = http.post("/v1/runs", json=body, timeout=60)
    assert refused.status_code == 429, refused.text
    problem = refused.json()
    assert problem["error"] == "QuotaExceeded" and problem["quota"] == "storage_mb", problem
    assert "this run's spec" in problem["detail"] and "DELETE /v1/runs/ID" in problem["detail"]
    assert all(r.info["task"] != "big" for r in acme.runs.list())  # nothing queued


def test_a_finished_runs_bytes_count_until_it_is_deleted(
    service: tuple[Server, Tokens, Path], acme: Client
) -> None:
    first = finished(acme, "first", ["done", *PAD])
    spec = len(json.dumps({"task": "first", "scripted": ["done", *PAD]}))
    assert (kept(service, first.id) or 0) >= spec
    with pytest.raises(exc.QuotaExceeded) as full:  # 1.2 MiB more does not fit beside it
        acme.runs.submit("second", scripted=["done", *PAD])
    assert full.value.quota == "storage_mb"
    first.delete()
    with pytest.raises(exc.ResourceNotFound):
        first.refresh()
    assert kept(service, first.id) is None
    second = finished(acme, "second", ["done", *PAD])  # its room is back
    acme.runs.delete(second.id)
    # the run store's rows are gone, its id stays taken; the audit trail still verifies
    db = open_database(f"sqlite:///{service[2] / 'service.db'}")
    with RunStore(db, namespace="runs") as runs:
        assert runs.summary(first.id) is None and runs.load(first.id) is None
        with pytest.raises(exc.RunConflict, match="erased"):
            runs.claim(first.id, new=True)
    assert acme.verify_audit()["ok"]


def test_a_runs_conversation_counts_once_it_has_stopped(
    service: tuple[Server, Tokens, Path], acme: Client
) -> None:
    """Its answer and tool outputs are kept in the run store (messages, steps, checkpoints):
    they count beside its spec."""
    answer = "z" * 300_000
    run = finished(acme, "talk", [{"name": "list_files", "args": {}}, answer])
    spec = len(json.dumps({"task": "talk", "scripted": [{"name": "list_files", "args": {}}, answer]}))
    assert (kept(service, run.id) or 0) > spec + len(answer)
    run.delete()


def test_a_deletion_the_trail_cannot_record_erases_nothing_and_a_retry_finishes(
    service: tuple[Server, Tokens, Path], acme: Client
) -> None:
    """The run store's rows went first and the note after: a full disk between the two left a
    run the trail reported ``not_in_store`` for ever, and no run left to delete again."""
    run = finished(acme, "noted first", ["done"])
    db = service[2] / "service.db"
    with sqlite3.connect(db) as conn:  # the disk is full for the note, as ENOSPC makes it
        conn.execute(
            "CREATE TRIGGER full BEFORE INSERT ON audit_t_acme_events WHEN NEW.kind = 'note' "
            "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"
        )
    conn.close()
    try:
        with pytest.raises(exc.AuditStoreError):
            run.delete()
        assert run.refresh().status == "success" and kept(service, run.id) is not None
    finally:
        with sqlite3.connect(db) as conn:
            conn.execute("DROP TRIGGER full")
        conn.close()
    run.delete()
    with pytest.raises(exc.ResourceNotFound):
        run.refresh()
    assert acme.verify_audit()["ok"]


def test_only_a_run_that_ended_is_deleted_and_only_by_its_tenant(
    service: tuple[Server, Tokens, Path], acme: Client
) -> None:
    run = acme.runs.submit("sleep", scripted=[SLEEP, "never"])
    wait_for(lambda: run.refresh().status == "running", what="the run to start", timeout_s=30)
    with pytest.raises(exc.RunConflict, match="only a run that ended"):
        run.delete()
    with Client(service[0].url, service[1].other) as other, pytest.raises(exc.ResourceNotFound):
        other.runs.delete(run.id)
    run.kill("enough")
    assert run.wait(timeout_s=30).status == "killed"
    with Client(service[0].url, service[1].other) as other, pytest.raises(exc.ResourceNotFound):
        other.runs.delete(run.id)  # ended, still not its
    run.delete()
    with pytest.raises(exc.ResourceNotFound):
        run.delete()


def test_runs_past_their_tenants_retention_are_erased_by_the_service(tmp_path: Path) -> None:
    """acme keeps its runs 3 s after they end (``keep_runs_days`` in the tenants file); other
    says nothing, and keeps them until it deletes them."""
    require_tier("process")
    tenants, tokens = write_tenants(tmp_path, keep_runs_days=3 / 86_400)
    server = Server(tenants, f"sqlite:///{tmp_path / 'service.db'}", tmp_path)
    try:
        with Client(server.url, tokens.acme) as acme, Client(server.url, tokens.other) as other:
            old = finished(acme, "old", ["done"])
            kept_run = finished(other, "kept", ["done"])
            wait_for(lambda: acme.runs.list() == [], what="acme's run to be erased", timeout_s=20)
            with pytest.raises(exc.ResourceNotFound):
                old.refresh()
            assert [r.id for r in other.runs.list()] == [kept_run.id]
            assert acme.verify_audit()["ok"]  # its chain is whole, the erasure in it
            with RunStore(open_database(f"sqlite:///{tmp_path / 'service.db'}"), namespace="runs") as runs:
                assert runs.summary(old.id) is None
                with pytest.raises(exc.RunConflict, match="erased"):
                    runs.claim(old.id, new=True)
    finally:
        server.stop()
    assert "Traceback" not in server.output(), server.output()[-3000:]
