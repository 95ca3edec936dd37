"""Erasing runs that ended: at a tenant's request (``DELETE /v1/runs/{id}``), and by the
service once they are older than their tenant's ``keep_runs_days`` (the tenants file, or
``ServiceConfig.keep_runs_days`` for every tenant that does not say).

A run's erasure is written in its tenant's audit trail first; then the run is erased from the
run store (``RunStore.erase``: its rows, the contents and seeds no other run shares; its id
kept taken, the audit trail untouched), the sandbox it kept if it was killed while paused (in
its tenant's snapshot store), then from the service's tables in one transaction that requires
it to have ended: a failure between any two leaves the service's row, and erasing it again
finishes. Several API processes may sweep at once: a run
erased by one is not found by the other.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from stockade import exceptions as exc
from stockade.audit.events import EventKind
from stockade.server.state.rows import TERMINAL, RunRow
from stockade.server.tenants import Tenant

if TYPE_CHECKING:
    from stockade.server.service import Service

__all__ = ["Retention", "erase_run", "keep_runs_s"]

log = logging.getLogger("stockade.retention")

DAY_S = 86_400.0
MAX_EVERY_S = 600.0  # how often at most a sweep looks (sooner for a retention shorter than 40 min)
BATCH = 100  # runs erased per tenant per sweep: a backlog is worked off sweep by sweep


def erase_run(
    service: Service, tenant: Tenant, row: RunRow, *, actor: str, attributes: dict[str, object]
) -> bool:
    """Erase ``row``, a run of ``tenant`` that ended (``RunConflict`` otherwise); False when it
    was erased meanwhile. The erasure is written in the tenant's audit trail."""
    if row.status not in TERMINAL:
        raise exc.RunConflict(
            f"run {row.run_id} is {row.status}: only a run that ended is deleted; kill it first "
            f"(POST /v1/runs/{row.run_id}/kill), then delete it once it has ended"
        )
    # The note first, written before anything is erased (``check``): erased first, a failed
    # write left a run gone from the store that the trail reported ``not_in_store`` for ever,
    # and erasing it again found no run to note. Noted and not erased (a failure after the
    # note, or another process's sweep first), the run is only left out of verify's check.
    audit = service.audit.get(tenant)
    audit.record(
        EventKind.NOTE, run_id=row.run_id, actor=actor,
        attributes={"action": "delete", "status": row.status, **attributes},
    )  # fmt: skip
    audit.check()
    service.run_store.erase([row.run_id])
    service.snapshots.release_runs(tenant.id, [row.run_id])  # counted against snapshot_mb, listed nowhere
    return service.store.forget_run(row.run_id)


def keep_runs_s(service: Service, tenant: Tenant) -> float | None:
    """How long the tenant's runs are kept once ended (None: until it deletes them)."""
    days = tenant.keep_runs_days if tenant.keep_runs_days is not None else service.config.keep_runs_days
    return None if days is None else days * DAY_S


class Retention:
    """A thread that erases the runs ended longer ago than their tenant keeps them."""

    def __init__(self, service: Service) -> None:
        self.service = service
        kept = [k for t in service.tenants.tenants.values() if (k := keep_runs_s(service, t)) is not None]
        # a quarter of the shortest retention: a run is erased at most 25 % past its time
        self.every_s = min(MAX_EVERY_S, max(1.0, min(kept) / 4)) if kept else MAX_EVERY_S
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="stockade-retention", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.sweep()
            except exc.StockadeError as error:  # the database away: the next sweep tries again
                log.warning("runs past their retention not erased this time: %s", error)

    def sweep(self) -> int:
        """Erase every tenant's runs past its retention (up to ``BATCH`` each); how many. The
        sandboxes kept for runs that ended go too."""
        self.service.snapshots.sweep_ended_runs()
        erased = 0
        now = time.time_ns()
        for tenant in self.service.tenants.tenants.values():
            keep_s = keep_runs_s(self.service, tenant)
            if keep_s is None:
                continue
            due = self.service.store.ended_runs(tenant.id, before_ns=now - int(keep_s * 1e9), limit=BATCH)
            for row in due:
                if self._stop.is_set():
                    return erased
                why: dict[str, object] = {"through": "retention", "keep_runs_s": keep_s}
                try:
                    erased += erase_run(self.service, tenant, row, actor="service:retention", attributes=why)
                except exc.RunConflict as error:  # its store still has it running (a worker died)
                    log.info("run %s not erased yet: %s", row.run_id, error)
        return erased
