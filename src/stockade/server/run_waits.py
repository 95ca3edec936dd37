"""How a run that cannot go on yet waits, off its worker: when one whose tenant's quota was
full asks again (``quota_wait_s``), how one that waits for its tenant's window says so
(``DEFERRED``), and what tells the runner a run stopped to wait so (``Deferral``); with
``RunWaits``, a base of ``Runner``: the shares of the runs waiting for room and the peek at a
tenant's window. Apart from the runner's start, drive and end of a run, which only asks them.
"""

from __future__ import annotations

from stockade import exceptions as exc
from stockade.runtime.events import LimitHit, RuntimeEvent
from stockade.server.context import TenantLimits
from stockade.server.state.rows import RunRow
from stockade.server.state.store import ServiceStore
from stockade.server.tenants import Tenant
from stockade.types import Limits

__all__ = [
    "DEFERRED", "MAX_SHARES", "QUOTA_POLL_MAX_S", "QUOTA_POLL_S", "Deferral", "RunWaits", "quota_wait_s",
]  # fmt: skip

QUOTA_POLL_S = 2.0  # how often a run that waits for room in its tenant's quota asks again
QUOTA_POLL_MAX_S = 30.0
# how a run that waits for its tenant's window says so (``RunRow.error``, shown by the API)
DEFERRED = "waiting off the worker for the tenant's"
MAX_SHARES = 10_000


def quota_wait_s(queued: int, sandboxes: int) -> float:
    """When a run that found its tenant's quota full asks again: every ``QUOTA_POLL_S`` while
    its tenant has no more runs queued than sandboxes, then as much longer as it has more (up
    to ``QUOTA_POLL_MAX_S``). All of a tenant's waiting runs ask at the same pace (no run asks
    more often for being younger), together about one ask every ``QUOTA_POLL_S`` per sandbox of
    the quota until the cap: 1,000 queued runs asked 500 times a second; now ~33."""
    return min(QUOTA_POLL_MAX_S, QUOTA_POLL_S * max(1.0, queued / max(1, sandboxes)))


class Deferral:
    """The run's last refusal that stopped it to wait off its worker (a ``LimitWait``)."""

    def __init__(self) -> None:
        self.hit: LimitHit | None = None

    def __call__(self, event: RuntimeEvent) -> None:
        if isinstance(event, LimitHit) and event.action == "defer":
            self.hit = event


class RunWaits:
    """The runner's part that paces the runs waiting for room in their tenant's quota (what
    each asks for, kept between its asks) and tells a run waiting for its tenant's window
    whether it has room yet."""

    store: ServiceStore
    limits: TenantLimits
    _shares: dict[str, Limits]

    def quota_wait_s(self, tenant: Tenant | None) -> float:
        """When a run of ``tenant`` whose quota was full asks again (``quota_wait_s``)."""
        if tenant is None:
            return quota_wait_s(1, 1)
        return quota_wait_s(self.store.queued_count(tenant.id), tenant.quotas.sandboxes)

    def _remember_share(self, run_id: str, share: Limits) -> None:
        """What a run waiting for room in its quota asks for, kept between its asks (bounded:
        a run forgotten is only read again)."""
        if len(self._shares) >= MAX_SHARES:
            self._shares.clear()
        self._shares[run_id] = share

    def _still_waiting(self, row: RunRow, tenant: Tenant) -> exc.RunDeferred | None:
        """A run that waits for its tenant's rate window, run again before it has room (early,
        or its tenant's other runs took it): waits on, without starting its sandbox."""
        limit = self.limits.actions(tenant)
        if row.status != "queued" or not (row.error or "").startswith(DEFERRED) or limit is None:
            return None
        verdict = limit.peek(f"tenant:{tenant.id}")
        if verdict.allowed:
            return None
        return exc.RunDeferred(row.error or DEFERRED, kind="rate", retry_after=max(verdict.retry_after, 1.0))
