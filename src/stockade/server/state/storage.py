"""What a tenant keeps in the database, counted against its ``storage_mb``: the byte count
(its workspaces, its runs' artifacts, specs and run store rows) and its uploaded workspaces.

A part of ``ServiceStore``; runs build on it (a spec counts when a run is submitted).
"""

from __future__ import annotations

import time

from stockade import exceptions as exc
from stockade.runs._db import Database
from stockade.server.state.rows import as_bytes, as_int, role_key
from stockade.types import MiB


class StorageTables:
    """The tables of what a tenant keeps: its workspaces (``<ns>_workspaces``), and what its runs
    keep (``<ns>_run_bytes``; their artifacts, ``<ns>_artifacts``, are the runs')."""

    db: Database
    ns: str

    def _stored(self) -> str:
        """What a tenant keeps in the database (``?``: ``_stored_params``), in bytes: its
        workspaces, its runs' artifacts, its runs' specs and their rows in the run store (as
        last measured: when the run last stopped)."""
        ns = self.ns
        return (
            f"(SELECT COALESCE(SUM(bytes), 0) FROM {ns}_workspaces WHERE tenant = ?) + "
            f"(SELECT COALESCE(SUM(a.bytes), 0) FROM {ns}_artifacts a JOIN {ns}_runs r "
            "ON r.run_id = a.run_id WHERE r.tenant = ?) + "
            f"(SELECT COALESCE(SUM(spec + store), 0) FROM {ns}_run_bytes WHERE tenant = ?)"
        )

    @staticmethod
    def _stored_params(tenant: str) -> tuple[str, str, str]:
        return (tenant, tenant, tenant)

    def stored_bytes(self, tenant: str) -> int:
        rows = self.db.query(f"SELECT {self._stored()}", self._stored_params(tenant))
        return as_int(rows[0][0]) if rows else 0

    def run_bytes(self, run_id: str) -> int | None:
        """What a run keeps in the database (its spec, its run store rows as last measured)."""
        rows = self.db.query(f"SELECT spec + store FROM {self.ns}_run_bytes WHERE run_id = ?", (run_id,))
        return as_int(rows[0][0]) if rows else None

    def put_workspace(
        self, tenant: str, role: str | None, digest: str, data: bytes, size: int, *, max_bytes: int
    ) -> None:
        """Keep a workspace uploaded by a token of ``role``, if what the tenant keeps stays
        within ``max_bytes`` (one the role has already costs nothing; another role's copy is
        that role's, and this one counts too); ``QuotaExceeded`` otherwise."""
        ns, key = self.ns, role_key(role)
        if self.workspace_size(tenant, role, digest) is not None:
            return
        self._keep(
            f"INSERT INTO {ns}_workspaces (tenant, role, digest, bytes, data, created_ns) "
            f"SELECT ?, ?, ?, ?, ?, ? WHERE {self._stored()} + ? <= ? "
            "ON CONFLICT (tenant, role, digest) DO NOTHING",
            (tenant, key, digest, size, data, time.time_ns(), *self._stored_params(tenant), size, max_bytes),
            tenant=tenant,
        )
        if self.workspace_size(tenant, role, digest) is None:
            raise self._storage_full(tenant, size, max_bytes, what="this workspace")

    def workspace_size(self, tenant: str, role: str | None, digest: str) -> int | None:
        rows = self.db.query(
            f"SELECT bytes FROM {self.ns}_workspaces WHERE tenant = ? AND role = ? AND digest = ?",
            (tenant, role_key(role), digest),
        )
        return as_int(rows[0][0]) if rows else None

    def workspace(self, tenant: str, role: str | None, digest: str) -> bytes | None:
        """The workspace ``digest`` that a token of ``role`` uploaded (another role's is not
        found)."""
        rows = self.db.query(
            f"SELECT data FROM {self.ns}_workspaces WHERE tenant = ? AND role = ? AND digest = ?",
            (tenant, role_key(role), digest),
        )
        return as_bytes(rows[0][0]) if rows else None

    def workspaces(self, tenant: str, role: str | None) -> list[tuple[str, int, int]]:
        """The workspaces a role's tokens uploaded: (id, bytes, uploaded ns), newest first."""
        rows = self.db.query(
            f"SELECT digest, bytes, created_ns FROM {self.ns}_workspaces WHERE tenant = ? AND role = ? "
            "ORDER BY created_ns DESC",
            (tenant, role_key(role)),
        )
        return [(str(r[0]), as_int(r[1]), as_int(r[2])) for r in rows]

    def all_workspaces(self, tenant: str) -> list[tuple[str, str | None, int, int]]:
        """Every role's workspaces of a tenant, for its operator: (id, role or None, bytes,
        uploaded ns), newest first."""
        rows = self.db.query(
            f"SELECT digest, role, bytes, created_ns FROM {self.ns}_workspaces WHERE tenant = ? "
            "ORDER BY created_ns DESC",
            (tenant,),
        )
        return [(str(r[0]), str(r[1]) or None, as_int(r[2]), as_int(r[3])) for r in rows]

    def delete_workspace(self, tenant: str, role: str | None, digest: str) -> bool:
        table, where = f"{self.ns}_workspaces", "tenant = ? AND role = ? AND digest = ?"
        params = (tenant, role_key(role), digest)
        return self.db.write(
            [(f"DELETE FROM {table} WHERE {where}", [params])],
            require=(f"SELECT 1 FROM {table} WHERE {where}", params),
        )

    def _keep(self, insert: str, params: tuple[object, ...], *, tenant: str) -> None:
        """``insert``, in one transaction that locks the tenant's row first (so two uploads
        never both fit where one does)."""
        ns = self.ns
        self.db.write([(f"INSERT INTO {ns}_tenants VALUES (?) ON CONFLICT (tenant) DO NOTHING", [(tenant,)])])
        self.db.write(
            [(insert, [params])], require=(f"SELECT 1 FROM {ns}_tenants WHERE tenant = ?", (tenant,))
        )

    def _storage_full(self, tenant: str, size: int, max_bytes: int, *, what: str) -> exc.QuotaExceeded:
        used = self.stored_bytes(tenant)
        return exc.QuotaExceeded(
            f"tenant {tenant!r} keeps {used / MiB:.1f} MiB of workspaces, runs and run artifacts of its "
            f"{max_bytes / MiB:g} MiB storage_mb; {what} needs {size / MiB:.1f} MiB more: delete a workspace "
            "(DELETE /v1/workspaces/ID), a run's artifacts (DELETE /v1/runs/ID/artifacts) or a run that "
            "ended (DELETE /v1/runs/ID)",
            quota="storage_mb",
            limit=max_bytes / MiB,
            used=used / MiB,
        )
