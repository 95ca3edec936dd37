"""The share of a tenant's quota (sandboxes, CPUs, memory) that its live sandboxes and its
running runs hold (``<ns>_sandboxes``, ``<ns>_holds``), taken in one transaction each.

A part of ``ServiceStore``. Quotas hold across API processes: a reservation is one
transaction that locks its tenant's row first (``FOR UPDATE`` on PostgreSQL, ``BEGIN
IMMEDIATE`` on SQLite), then inserts only if the tenant's totals stay within the quota.
"""

from __future__ import annotations

import time

from stockade import exceptions as exc
from stockade.runs._db import Database
from stockade.server.state.rows import as_int
from stockade.server.tenants import Quotas


def _milli(cpus: float) -> int:
    return round(cpus * 1000)


class QuotaTables:
    """The tables of what holds a share of a quota: the API's sandboxes and the runs that run."""

    db: Database
    ns: str

    # -- sandboxes: quotas ------------------------------------------------------------------

    def reserve_sandbox(
        self, *, sandbox_id: str, tenant: str, owner: str, tier: str, cpus: float, memory_mb: int,
        quotas: Quotas,
    ) -> None:  # fmt: skip
        """Hold a share of the tenant's quota for a sandbox about to start; ``QuotaExceeded``."""
        self._take(
            f"INSERT INTO {self.ns}_sandboxes SELECT ?, ?, ?, ?, ?, ?, ?",
            (sandbox_id, tenant, owner, tier, cpus, memory_mb, time.time_ns()),
            tenant=tenant, cpus=cpus, memory_mb=memory_mb, quotas=quotas,
        )  # fmt: skip
        if not self.db.query(f"SELECT 1 FROM {self.ns}_sandboxes WHERE sandbox_id = ?", (sandbox_id,)):
            raise self._full(tenant, cpus=cpus, memory_mb=memory_mb, quotas=quotas, what="this sandbox")

    def hold_run(
        self, *, run_id: str, tenant: str, worker: str, cpus: float, memory_mb: int, quotas: Quotas
    ) -> None:
        """Hold the share of the tenant's quota that a run's sandbox takes, until the run leaves
        "running" (``set_status``); ``QuotaExceeded`` when the tenant's sandboxes and running
        runs hold too much for it (the run waits queued). A run held already keeps its share
        (another delivery of a run that runs)."""
        ns = self.ns
        if self.db.query(f"SELECT 1 FROM {ns}_holds WHERE run_id = ?", (run_id,)):
            return
        self._take(
            f"INSERT INTO {ns}_holds SELECT ?, ?, ?, ?, ?, ?",
            (run_id, tenant, worker, cpus, memory_mb, time.time_ns()),
            tenant=tenant, cpus=cpus, memory_mb=memory_mb, quotas=quotas,
            conflict="ON CONFLICT (run_id) DO NOTHING",
        )  # fmt: skip
        if not self.db.query(f"SELECT 1 FROM {ns}_holds WHERE run_id = ?", (run_id,)):
            raise self._full(tenant, cpus=cpus, memory_mb=memory_mb, quotas=quotas, what="this run's sandbox")

    def drop_hold(self, run_id: str) -> None:
        """Free a run's share (one that never turned "running": it was ended meanwhile)."""
        self.db.write([(f"DELETE FROM {self.ns}_holds WHERE run_id = ?", [(run_id,)])])

    def holds(self, tenant: str) -> list[str]:
        """The runs that hold a share of ``tenant``'s quota."""
        rows = self.db.query(
            f"SELECT run_id FROM {self.ns}_holds WHERE tenant = ? ORDER BY run_id", (tenant,)
        )
        return [str(r[0]) for r in rows]

    def _live(self) -> str:
        """What holds a share of a quota: the API's sandboxes and the runs that run."""
        ns = self.ns
        return (
            f"(SELECT tenant, cpus, memory_mb FROM {ns}_sandboxes "
            f"UNION ALL SELECT tenant, cpus, memory_mb FROM {ns}_holds) live WHERE tenant = ?"
        )

    def _take(
        self, insert: str, row: tuple[object, ...], *, tenant: str, cpus: float, memory_mb: int,
        quotas: Quotas, conflict: str = "",
    ) -> None:  # fmt: skip
        """``insert`` ``row``, only if the tenant's totals stay within ``quotas``: one
        transaction that locks the tenant's row first."""
        ns = self.ns
        self.db.write([(f"INSERT INTO {ns}_tenants VALUES (?) ON CONFLICT (tenant) DO NOTHING", [(tenant,)])])
        totals = f"FROM {self._live()}"
        # CPUs are added up in thousandths, as integers: 0.1 + 0.2 is not above a quota of 0.3
        self.db.write(
            [
                (
                    f"{insert} WHERE (SELECT COUNT(*) {totals}) < ? "
                    f"AND (SELECT ROUND(COALESCE(SUM(cpus), 0) * 1000) {totals}) + ? <= ? "
                    f"AND (SELECT COALESCE(SUM(memory_mb), 0) {totals}) + ? <= ? {conflict}",
                    [
                        (
                            *row, tenant, quotas.sandboxes, tenant, _milli(cpus), _milli(quotas.cpus), tenant,
                            memory_mb, quotas.memory_mb,
                        )
                    ],
                )
            ],
            require=(f"SELECT 1 FROM {ns}_tenants WHERE tenant = ?", (tenant,)),
        )  # fmt: skip

    def _full(
        self, tenant: str, *, cpus: float, memory_mb: int, quotas: Quotas, what: str
    ) -> exc.QuotaExceeded:
        """Which of the tenant's quotas has no room for ``cpus`` and ``memory_mb`` more."""
        count, used_cpus, used_memory = self.db.query(
            f"SELECT COUNT(*), COALESCE(SUM(cpus), 0), COALESCE(SUM(memory_mb), 0) FROM {self._live()}",
            (tenant,),
        )[0]
        if as_int(count) >= quotas.sandboxes:
            quota, limit, used = "sandboxes", float(quotas.sandboxes), float(as_int(count))
        elif _milli(float(str(used_cpus))) + _milli(cpus) > _milli(quotas.cpus):
            quota, limit, used = "cpus", quotas.cpus, _milli(float(str(used_cpus))) / 1000
        else:
            quota, limit, used = "memory_mb", float(quotas.memory_mb), float(str(used_memory))
        return exc.QuotaExceeded(
            f"tenant {tenant!r} holds {used:g} of its {limit:g} {quota} (its sandboxes and running runs); "
            f"{what} would need { {'sandboxes': 1, 'cpus': cpus, 'memory_mb': memory_mb}[quota] } more: "
            "delete a sandbox, wait for a run, or ask for smaller limits",
            quota=quota,
            limit=limit,
            used=used,
        )

    def release_sandbox(self, sandbox_id: str) -> None:
        """Forget a sandbox: its share of the quota is free, and it was never there."""
        self.db.write(
            [
                (f"DELETE FROM {self.ns}_sandboxes WHERE sandbox_id = ?", [(sandbox_id,)]),
                (f"DELETE FROM {self.ns}_ended WHERE sandbox_id = ?", [(sandbox_id,)]),
            ]
        )

    def end_sandbox(self, sandbox_id: str, reason: str) -> None:
        """Free a sandbox's share of the quota, and remember why it ended (``killed``)."""
        ns = self.ns
        self.db.write(
            [
                (
                    f"INSERT INTO {ns}_ended SELECT sandbox_id, tenant, owner, ?, ? FROM {ns}_sandboxes "
                    "WHERE sandbox_id = ? ON CONFLICT (sandbox_id) DO NOTHING",
                    [(reason, time.time_ns(), sandbox_id)],
                ),
                (f"DELETE FROM {ns}_sandboxes WHERE sandbox_id = ?", [(sandbox_id,)]),
            ]
        )
