"""A service database made before uploaded workspaces and snapshot places had a role, opened
by this version (SQLite and PostgreSQL): the workspaces keep their bytes and become a token
without a role's (no role of the tenant lists, uses or deletes them; the operator sees them
with their role), each role's upload of the same files is its own copy, and a snapshot's
place is its role's; a run's idempotency key, unique per tenant before, is its role's."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import exceptions as exc
from stockade.runs._db import Database
from stockade.server.state.schema import TABLES, open_database
from stockade.server.state.store import ServiceStore
from tests.conftest import require
from tests.integration.run_stores import POSTGRES_URL, postgres_reachable

OLD_WORKSPACES = """CREATE TABLE {ns}_workspaces (
    tenant TEXT NOT NULL, digest TEXT NOT NULL, bytes BIGINT NOT NULL, data {blob} NOT NULL,
    created_ns BIGINT NOT NULL, PRIMARY KEY (tenant, digest))"""
OLD_RUNS = """CREATE TABLE {ns}_runs (
    run_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, role TEXT, spec TEXT NOT NULL,
    status TEXT NOT NULL, error TEXT, labels TEXT NOT NULL, submitted_ns BIGINT NOT NULL,
    started_ns BIGINT, finished_ns BIGINT, attempts INTEGER NOT NULL, worker TEXT, idem_key TEXT)"""
OLD_RUNS_KEY = "CREATE UNIQUE INDEX {ns}_runs_idem ON {ns}_runs (tenant, idem_key)"
OLD_SNAPSHOTS = """CREATE TABLE {ns}_snapshots (
    tenant TEXT NOT NULL, name TEXT NOT NULL, store_id TEXT NOT NULL, url TEXT NOT NULL,
    taken_ns BIGINT NOT NULL, PRIMARY KEY (tenant, name))"""


@pytest.fixture(params=["sqlite", "postgres"])
def old_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Database, str]]:
    """A database with the old tables: one workspace, one snapshot place and one run (role dev,
    idempotency key ``nightly``) of tenant acme."""
    if request.param == "sqlite":
        db, ns = open_database(f"sqlite:///{tmp_path / 'service.db'}"), "svc"
    else:
        ok, why = postgres_reachable()
        require("postgres", ok, why)
        db, ns = open_database(POSTGRES_URL), f"s_{uuid.uuid4().hex[:12]}"
    db.write([
        (OLD_WORKSPACES.format(ns=ns, blob=db.blob), [()]),
        (f"INSERT INTO {ns}_workspaces VALUES (?, ?, ?, ?, ?)", [("acme", "sha256:old", 3, b"old", 1)]),
        (OLD_SNAPSHOTS.format(ns=ns), [()]),
        (f"INSERT INTO {ns}_snapshots VALUES (?, ?, ?, ?, ?)", [("acme", "snap-old", "store-a", "", 1)]),
        (OLD_RUNS.format(ns=ns), [()]),
        (OLD_RUNS_KEY.format(ns=ns), [()]),
        (
            f"INSERT INTO {ns}_runs VALUES (?, ?, ?, ?, ?, NULL, ?, ?, NULL, NULL, 0, NULL, ?)",
            [("run-old", "acme", "dev", "{}", "success", "{}", 1, "nightly")],
        ),
    ])  # fmt: skip
    try:
        yield db, ns
    finally:
        if request.param == "postgres":
            db.write([(f"DROP TABLE IF EXISTS {', '.join(f'{ns}_{t}' for t in TABLES)}", [()])])
        db.close()


def test_old_workspaces_become_a_role_less_tokens_and_each_role_keeps_its_own_copy(
    old_database: tuple[Database, str],
) -> None:
    db, ns = old_database
    store = ServiceStore(db, namespace=ns)
    ServiceStore(db, namespace=ns)  # a second process's start changes nothing again
    assert store.workspaces("acme", None) == [("sha256:old", 3, 1)]
    assert store.workspaces("acme", "admin") == [] and store.workspace("acme", "admin", "sha256:old") is None
    assert not store.delete_workspace("acme", "dev", "sha256:old")
    assert store.all_workspaces("acme") == [("sha256:old", None, 3, 1)]  # what the operator sees

    store.put_workspace("acme", "admin", "sha256:old", b"new", 3, max_bytes=1000)
    store.put_workspace("acme", "dev", "sha256:old", b"new", 3, max_bytes=1000)
    assert store.stored_bytes("acme") == 2 + 9  # the old run's spec; three copies, each its role's
    assert store.delete_workspace("acme", "dev", "sha256:old")
    assert store.workspace("acme", "admin", "sha256:old") == b"new"
    assert store.workspace("acme", None, "sha256:old") == b"old"


def test_an_old_snapshot_place_is_a_role_less_tokens_and_a_new_one_its_roles(
    old_database: tuple[Database, str],
) -> None:
    db, ns = old_database
    store = ServiceStore(db, namespace=ns)
    assert store.snapshot_place("acme", None, "snap-old") == ("store-a", "")
    assert store.snapshot_place("acme", "admin", "snap-old") is None
    store.record_snapshot("acme", "admin", "snap-new", "store-a", "http://a")
    assert store.snapshot_place("acme", "admin", "snap-new") == ("store-a", "http://a")
    assert store.snapshot_place("acme", "dev", "snap-new") is None
    assert store.snapshot_place("acme", None, "snap-new") is None


def test_an_idempotency_key_is_its_roles_in_an_old_database_too(old_database: tuple[Database, str]) -> None:
    # the old index kept one key per tenant: dev's "nightly" refused admin's, naming dev's run
    db, ns = old_database
    store = ServiceStore(db, namespace=ns)
    ServiceStore(db, namespace=ns)  # a second process's start changes nothing again

    def submit(run_id: str, role: str | None) -> bool:
        return store.add_run(
            run_id=run_id, tenant="acme", role=role, spec={}, labels={}, max_active=10, idem_key="nightly"
        )

    found = store.run_by_key("acme", "dev", "nightly")
    assert found is not None and found.run_id == "run-old"
    assert store.run_by_key("acme", "admin", "nightly") is None
    for run_id, role in (("run-admin", "admin"), ("run-none", None)):
        assert submit(run_id, role)
        mine = store.run_by_key("acme", role, "nightly")
        assert mine is not None and mine.run_id == run_id
        with pytest.raises(exc.RunConflict):  # still one run per key within a role
            submit(f"{run_id}-again", role)
