"""The run store under test, on SQLite and on PostgreSQL (``scripts/start-services.sh postgres``;
URL from ``STOCKADE_TEST_POSTGRES_URL``). Each PostgreSQL test gets tables of its own."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import require

POSTGRES_URL = os.environ.get(
    "STOCKADE_TEST_POSTGRES_URL", "postgresql://stockade:stockade@127.0.0.1:5432/stockade"
)
TABLES = (
    "runs",
    "checkpoints",
    "messages",
    "steps",
    "tool_calls",
    "retries",
    "approvals",
    "seeds",
    "run_seeds",
    "setups",
    "run_limits",
    "run_checks",
    "run_diffs",
    "leases",
    "calls_started",
    "blobs",
    "workspace",
    "subjects",
    "erased",
)


def postgres_reachable() -> tuple[bool, str]:
    try:
        import psycopg
    except ImportError:
        return False, 'psycopg is not installed: pip install "stockade[postgres]"'
    try:
        psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
    except psycopg.Error as error:
        return False, f"{POSTGRES_URL.rpartition('@')[2]}: {error} (run scripts/start-services.sh postgres)"
    return True, ""


@dataclass(frozen=True)
class StoreTarget:
    url: str
    namespace: str


@pytest.fixture(params=["sqlite", "postgres"])
def run_store_target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreTarget]:
    if request.param == "sqlite":
        yield StoreTarget(f"sqlite:///{tmp_path / 'audit.db'}", "runs")
        return
    ok, why = postgres_reachable()
    require("postgres", ok, why)
    import psycopg

    namespace = f"r_{uuid.uuid4().hex[:12]}"
    try:
        yield StoreTarget(POSTGRES_URL, namespace)
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            tables = ", ".join(f"{namespace}_{table}" for table in TABLES)
            conn.execute(f"DROP TABLE IF EXISTS {tables}".encode())
            # the audit trail a test keeps beside the store (tables ``<ns>_audit_*``)
            trail = f"{namespace}_audit"
            conn.execute(
                f"DROP TABLE IF EXISTS {trail}_events, {trail}_head, {trail}_run_keys CASCADE".encode()
            )
            conn.execute(f"DROP FUNCTION IF EXISTS {trail}_append_only() CASCADE".encode())
