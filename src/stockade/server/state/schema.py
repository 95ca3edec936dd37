"""The service's tables (``<ns>_*``): the database a URL names, the statements that make the
tables, and the migrations of tables made by older versions.

Apart from the store that reads and writes them: what a table holds is read here in one
place, and a change of a table's shape (a migration) touches only this module.
"""

from __future__ import annotations

from stockade import exceptions as exc
from stockade.runs._db import Database, PostgresDatabase, SQLiteDatabase


def open_database(url: str) -> Database:
    """``postgresql://...``, ``sqlite:///PATH`` or a plain path."""
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresDatabase(url)
    if url.startswith("sqlite:///"):
        return SQLiteDatabase(url[len("sqlite:///") :])
    if "://" in url:
        raise exc.InvalidArgument(
            f"unknown database URL {url!r}", argument="database", fix="use sqlite:///PATH or postgresql://..."
        )
    return SQLiteDatabase(url)


def schema(ns: str, blob: str) -> list[str]:
    return [
        f"""CREATE TABLE IF NOT EXISTS {ns}_runs (
            run_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, role TEXT, spec TEXT NOT NULL,
            status TEXT NOT NULL, error TEXT, labels TEXT NOT NULL, submitted_ns BIGINT NOT NULL,
            started_ns BIGINT, finished_ns BIGINT, attempts INTEGER NOT NULL, worker TEXT, idem_key TEXT)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_runs_tenant ON {ns}_runs (tenant, submitted_ns)",
        # an idempotency key is its role's (a dev token's key blocked an admin's submit, naming a
        # run the admin could not see); the older (tenant, idem_key) index goes: its keys were
        # unique per tenant, so they are per role too
        f"CREATE UNIQUE INDEX IF NOT EXISTS {ns}_runs_idem_role "
        f"ON {ns}_runs (tenant, COALESCE(role, ''), idem_key)",
        f"DROP INDEX IF EXISTS {ns}_runs_idem",
        _workspaces_table(f"{ns}_workspaces", blob),
        f"""CREATE TABLE IF NOT EXISTS {ns}_artifacts (
            run_id TEXT PRIMARY KEY, digest TEXT NOT NULL, bytes BIGINT NOT NULL, data {blob} NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_run_bytes (
            run_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, spec BIGINT NOT NULL, store BIGINT NOT NULL)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_run_bytes_tenant ON {ns}_run_bytes (tenant)",
        # runs submitted before their bytes were counted: their specs count from now on (a spec
        # is JSON in ASCII, so its length is its size). Once, while the table is empty: every
        # process opens this store at its start, and the anti-join read every run each time.
        f"INSERT INTO {ns}_run_bytes SELECT run_id, tenant, LENGTH(spec), 0 FROM {ns}_runs "
        f"WHERE NOT EXISTS (SELECT 1 FROM {ns}_run_bytes) ON CONFLICT (run_id) DO NOTHING",
        f"CREATE TABLE IF NOT EXISTS {ns}_tenants (tenant TEXT PRIMARY KEY)",
        f"""CREATE TABLE IF NOT EXISTS {ns}_sandboxes (
            sandbox_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, owner TEXT NOT NULL, tier TEXT NOT NULL,
            cpus DOUBLE PRECISION NOT NULL, memory_mb BIGINT NOT NULL, created_ns BIGINT NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_holds (
            run_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, worker TEXT NOT NULL,
            cpus DOUBLE PRECISION NOT NULL, memory_mb BIGINT NOT NULL, created_ns BIGINT NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_nodes (
            owner TEXT PRIMARY KEY, url TEXT NOT NULL, hop_key TEXT NOT NULL, beat_ns BIGINT NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_ended (
            sandbox_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, owner TEXT NOT NULL, reason TEXT NOT NULL,
            ended_ns BIGINT NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_snapshots (
            tenant TEXT NOT NULL, name TEXT NOT NULL, store_id TEXT NOT NULL, url TEXT NOT NULL,
            taken_ns BIGINT NOT NULL, role TEXT, PRIMARY KEY (tenant, name))""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_approvals (
            run_id TEXT NOT NULL, request_id TEXT NOT NULL, action TEXT NOT NULL, rule TEXT NOT NULL,
            reason TEXT NOT NULL, status TEXT NOT NULL, decided_by TEXT NOT NULL, updated_ns BIGINT NOT NULL,
            PRIMARY KEY (run_id, request_id))""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_kills (
            run_id TEXT PRIMARY KEY, reason TEXT NOT NULL, created_ns BIGINT NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_live (
            run_id TEXT PRIMARY KEY, info TEXT NOT NULL, beat_ns BIGINT NOT NULL)""",
        # when a run nobody holds goes to a worker again (``server/wakes.py``)
        f"""CREATE TABLE IF NOT EXISTS {ns}_wakes (
            run_id TEXT PRIMARY KEY, wake_ns BIGINT NOT NULL, misses INTEGER NOT NULL)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_wakes_due ON {ns}_wakes (wake_ns)",
        # the attempts of a run that failed (its worker died, a retryable error): capped
        f"CREATE TABLE IF NOT EXISTS {ns}_tries (run_id TEXT PRIMARY KEY, failed INTEGER NOT NULL)",
        # the service's own random keys, shared by every process over the database
        f"CREATE TABLE IF NOT EXISTS {ns}_keys (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
        # viewer sessions signed out before they expire
        f"""CREATE TABLE IF NOT EXISTS {ns}_signouts (
            nonce TEXT PRIMARY KEY, expires_ns BIGINT NOT NULL)""",
    ]


def _workspaces_table(name: str, blob: str) -> str:
    # role: the role of the token that uploaded it ('' for a token without one, and for a row
    # from before workspaces had a role); a key column, so each role keeps its own copy
    return f"""CREATE TABLE IF NOT EXISTS {name} (
        tenant TEXT NOT NULL, digest TEXT NOT NULL, bytes BIGINT NOT NULL, data {blob} NOT NULL,
        created_ns BIGINT NOT NULL, role TEXT NOT NULL DEFAULT '', PRIMARY KEY (tenant, role, digest))"""


def migrate_workspaces(db: Database, ns: str) -> None:
    """Give a ``<ns>_workspaces`` table made before workspaces had a role its ``role`` column
    and its key (tenant, role, digest); its rows get role '': a token without a role's."""
    table = f"{ns}_workspaces"
    if "role" in db.columns(table):
        return
    if isinstance(db, PostgresDatabase):
        # under the lock ``create`` takes: a second process finds it done, and redoes nothing
        db.write([
            ("SELECT pg_advisory_xact_lock(hashtext(?))", [(f"stockade-{ns}",)]),
            (f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS role TEXT NOT NULL DEFAULT ''", [()]),
            (f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {table}_pkey", [()]),
            (f"ALTER TABLE {table} ADD PRIMARY KEY (tenant, role, digest)", [()]),
        ])  # fmt: skip
        return
    # SQLite cannot change a key: the table is copied; the check is in the same transaction
    db.write(
        [
            (f"DROP TABLE IF EXISTS {table}_old", [()]),
            (f"ALTER TABLE {table} RENAME TO {table}_old", [()]),
            (_workspaces_table(table, db.blob), [()]),
            (
                f"INSERT INTO {table} (tenant, digest, bytes, data, created_ns, role) "
                f"SELECT tenant, digest, bytes, data, created_ns, '' FROM {table}_old",
                [()],
            ),
            (f"DROP TABLE {table}_old", [()]),
        ],
        require=(f"SELECT 1 WHERE 'role' NOT IN (SELECT name FROM pragma_table_info('{table}'))", ()),
    )


TABLES = ("runs", "workspaces", "artifacts", "run_bytes", "tenants", "sandboxes", "holds", "nodes", "ended",
          "snapshots", "approvals", "kills", "live", "wakes", "tries", "keys", "signouts")  # fmt: skip
