"""One service process: its stores, its sandboxes, and where its runs go."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from stockade import exceptions as exc
from stockade.runs.store import RunStore
from stockade.sandbox import _registry
from stockade.sandbox.base import Backend
from stockade.server import scratch
from stockade.server.context import AuditLogs, ServiceConfig, TenantLimits, check_tenants
from stockade.server.exclusive import OnePerKey
from stockade.server.executor import Executor, InProcessExecutor
from stockade.server.retention import Retention
from stockade.server.runner import Runner
from stockade.server.sandbox_registry import SandboxRegistry
from stockade.server.snapshots import TenantSnapshots
from stockade.server.state.approvals import DatabaseApprovals
from stockade.server.state.kills import DatabaseKillSource
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore
from stockade.server.streams import StreamSlots
from stockade.server.tenants import Tenants

__all__ = ["Service"]

log = logging.getLogger("stockade.server")


class Service:
    """``executor`` None: runs go to Celery workers when ``config.redis`` is set, else to
    threads of this process (the embedded default). ``backends`` gives the backend of a tier
    for the API's sandboxes (the tier registry's unless told)."""

    def __init__(
        self,
        config: ServiceConfig,
        *,
        executor: Executor | None = None,
        backends: Callable[[str], Backend] | None = None,
    ) -> None:
        check_tenants(config.tenants.current())
        self.streams = StreamSlots(config.max_streams)  # event streams open, per tenant
        self.trail_checks = OnePerKey("a verification of its whole audit trail")  # per tenant
        self.config = config
        self.run_store = RunStore(open_database(config.database), namespace="runs", key=config.audit_key)
        self.store = ServiceStore(open_database(config.database), runs=self.run_store.ns)
        self.audit = AuditLogs(config.database, key=config.audit_key)
        self.limits = TenantLimits(config.redis, namespace=config.queue)
        self.approvals = DatabaseApprovals(self.store)
        self.kills = DatabaseKillSource(self.store, poll_s=0.0)
        self.snapshots = TenantSnapshots(self)
        # the tier backends of the API's sandboxes (``stockade.testing.FakeBackend`` in tests)
        self.backends: Callable[[str], Backend] = backends or _registry.backend
        self.sandboxes = SandboxRegistry(self)
        self.retention = Retention(self)
        self._runner: Runner | None = None
        if executor is None and config.redis:
            import importlib  # the distributed tier is optional; the core never imports Celery

            distributed = importlib.import_module("stockade.distributed.executor")
            executor = distributed.CeleryExecutor(config)
        elif executor is None:
            self._runner = Runner(config, name="embedded")
            executor = InProcessExecutor(
                self._runner, config.tenants, threads=config.run_threads, max_attempts=config.max_attempts
            )
        self.executor = executor

    @property
    def tenants(self) -> Tenants:
        """The tenants and tokens now: the tenants file as it was at most a second ago."""
        return self.config.tenants.current()

    @property
    def embedded(self) -> bool:
        return self._runner is not None

    def start(self) -> None:
        scratch.collect(self.config.temp_dir)  # a killed predecessor's uploads: a tenant's files
        self.snapshots.collect()
        self.sandboxes.start()
        self.retention.start()
        if self.config.prepare_tiers:
            threading.Thread(target=self._prepare, name="stockade-prepare", daemon=True).start()
        if self.embedded:  # runs this process had when it stopped (or died) go on
            for row in self.store.unfinished_runs():
                log.info("run %s (%s) continues", row.run_id, row.status)
                self.executor.submit(row.run_id, reason="restart")

    def _prepare(self) -> None:
        """Build what the API's sandboxes start from (``ServiceConfig.prepare_tiers``), for
        each tenant's policy: what it could not build is logged, and starts stay correct."""
        from stockade.policy.prepare import prepare_policy

        for tier in self.config.prepare_tiers:
            for tenant in self.tenants.tenants.values():
                try:
                    done = prepare_policy(self.backends(tier), tenant.policy)
                except exc.StockadeError as err:
                    log.warning("cannot prepare the %s tier for tenant %s: %s", tier, tenant.id, err)
                    continue
                for role, started_from in done.items():
                    log.info("%s, tenant %s, role %s: starts from %s", tier, tenant.id, role or "-",
                             started_from or "nothing built ahead")  # fmt: skip

    def close(self) -> None:
        self.retention.close()
        self.sandboxes.close()
        _registry.stop_background()  # what the tiers start ahead of the next create
        self.executor.close()
        if self._runner is not None:
            self._runner.close()
        self.audit.close()
        self.run_store.close()
        self.store.close()
