"""What every request of one service process shares: the configuration, the database, the
tenants' audit trails and limits, the live sandboxes and where runs go."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from stockade import exceptions as exc
from stockade.audit.log import AuditLog
from stockade.audit.stores import open_store
from stockade.runtime.limits import LocalWindow, RateLimit, RedisWindow, Window
from stockade.sandbox.snapshots import SnapshotStore
from stockade.server.body_limits import BODY_TIMEOUT_S, MIN_BODY_RATE
from stockade.server.tenants import Principal, Tenant, Tenants, TenantsFile

__all__ = ["MAX_ATTEMPTS", "AuditLogs", "ServiceConfig", "TenantLimits", "gave_up"]

MiB = 1024 * 1024
# Attempts of a run that failed (its worker died holding it, a retryable error such as a
# sandbox that would not start) before it ends "error": the same on every executor.
MAX_ATTEMPTS = 20


def gave_up(attempts: int) -> str:
    """A run's error once it has failed ``attempts`` times."""
    return f"gave up after {attempts} attempts"


API_RATE = "api"  # the name of the API's rate limit, which keys its counters in the window


@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """How ``stockade serve`` (and ``stockade worker``) run.

    ``database``: where the run store, the audit trails and the service's tables live
    (``sqlite:///PATH`` embedded, ``postgresql://...`` distributed). ``redis``: the Celery
    broker and the shared rate and spend windows; None runs every run in the server's
    process (``run_threads`` at a time), the embedded default."""

    # a table, or the file it is loaded from, followed while the process runs (``TenantsFile``):
    # read it as ``tenants.current()``, each time (a token taken out is refused from then on)
    tenants: Tenants | TenantsFile
    database: str = "sqlite:///.stockade/service.db"
    redis: str | None = None
    run_threads: int = 2
    max_upload_bytes: int = 64 * MiB
    max_file_bytes: int = 64 * MiB
    # a request's body other than a file's or an archive's (JSON: code, a command's stdin)
    max_request_bytes: int = 16 * MiB
    # A request's body must come whole within ``body_timeout_s``, then at ``min_body_rate``
    # bytes a second (``server/guard.py``): 16 MiB within 286 s, 64 MiB within 1,054 s;
    # slower is 408 and the connection closed, so no client parks a body in the server's memory
    body_timeout_s: float = BODY_TIMEOUT_S
    min_body_rate: float = MIN_BODY_RATE
    sandbox_idle_timeout_s: float = 300.0
    max_sandbox_idle_timeout_s: float = 3600.0
    event_poll_s: float = 0.2
    # event streams (a run's, the viewer's) one tenant may hold open at once in one API
    # process: each polls the database while open; one more is answered 429
    max_streams: int = 16
    # FastAPI's interactive docs (/docs, /redoc): their pages load scripts from a CDN
    # (cdn.jsdelivr.net) on the API's origin, where the viewer's cookie is, so they are off
    # unless asked for; /openapi.json is always served
    docs: bool = False
    tools: str | None = None  # "module:attribute" of a Toolset replacing the default tools
    audit_key: bytes | None = field(default=None, repr=False)
    visibility_timeout_s: float = 3600.0  # Celery: a delivered run is given again after this
    queue: str = "stockade"  # the Celery queue, and the prefix of every Redis key of the service
    temp_dir: Path | None = None  # uploads being checked, downloads being packed
    # where this API process's peers reach it (requests for its sandboxes are forwarded there);
    # ``serve`` fills it from its host and port when left out
    advertise_url: str | None = None
    # where the tenants' snapshots and paused sandboxes are kept (a store per tenant below
    # it); None: ``snapshots`` beside a SQLite database, else ``.stockade/snapshots``. API
    # processes that share this folder restore each other's snapshots; others cannot
    snapshot_dir: Path | None = None
    # Tiers whose sandboxes' start images are built when the service starts, for each
    # tenant's policy and role (``stockade.policy.prepare``): on the microVM, its ready
    # images, so that no API sandbox's first start boots. In the background: the API serves
    # meanwhile, and a sandbox created before they are built starts from the boot image.
    prepare_tiers: tuple[str, ...] = ()
    # A run whose tenant's rate window is full for longer than this does not sleep on its worker
    # (or thread): it stops where it is, waits "queued" and is run again when the window frees.
    limit_wait_in_place_s: float = 5.0
    # Runs that ended longer ago are erased (``server/retention.py``), for every tenant whose
    # tenants-file entry has no ``keep_runs_days`` of its own; None keeps them until deleted.
    keep_runs_days: float | None = None
    # failed attempts of a run (``MAX_ATTEMPTS``) before it ends "error"
    max_attempts: int = MAX_ATTEMPTS

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise exc.ConfigurationError("max_attempts must be at least 1")
        if not (self.body_timeout_s > 0 and self.min_body_rate > 0):
            raise exc.ConfigurationError("body_timeout_s and min_body_rate must be positive")
        if self.keep_runs_days is not None and not self.keep_runs_days > 0:
            raise exc.ConfigurationError("keep_runs_days must be positive (or None: runs are kept)")
        if (
            self.snapshot_dir is not None
            and os.path.lexists(self.snapshot_dir)
            and not self.snapshot_dir.is_dir()
        ):
            # it started, and each tenant's first snapshot failed (a folder made under a file)
            raise exc.InvalidArgument(
                f"snapshot_dir {str(self.snapshot_dir)!r} is not a folder", argument="snapshot_dir",
                fix="give a folder (it is made when missing)",
            )  # fmt: skip

    @property
    def snapshot_root(self) -> Path:
        """``snapshot_dir``, or its default: beside a SQLite database, else
        ``.stockade/snapshots`` of the current folder."""
        if self.snapshot_dir is not None:
            return self.snapshot_dir
        if self.database.startswith("sqlite:///"):
            return Path(self.database[len("sqlite:///") :]).parent / "snapshots"
        if "://" not in self.database:
            return Path(self.database).parent / "snapshots"
        return Path(".stockade/snapshots")

    def snapshot_store(self, tenant: Tenant) -> SnapshotStore:
        """The tenant's snapshots, paused sandboxes and paused runs' sandboxes, within its
        ``snapshot_mb``."""
        room = tenant.quotas.snapshot_mb * MiB
        return SnapshotStore(self.snapshot_root / tenant.id, max_bytes=room, name=f"tenant:{tenant.id}")


class AuditLogs:
    """One audit log per tenant (a chain of its own), opened on first use."""

    def __init__(self, database: str, *, key: bytes | None = None) -> None:
        self.database = database
        self.key = key
        self._logs: dict[str, AuditLog] = {}
        self._lock = threading.Lock()

    def get(self, tenant: Tenant) -> AuditLog:
        with self._lock:
            log = self._logs.get(tenant.id)
            if log is None:
                store = open_store(self.database, namespace=tenant.audit_namespace)
                try:  # a key that is not the trail's is refused here: the store must not stay open
                    log = AuditLog(store, key=self.key)
                except BaseException:
                    store.close()
                    raise
                self._logs[tenant.id] = log
            return log

    def close(self) -> None:
        with self._lock:
            logs, self._logs = list(self._logs.values()), {}
        for log in logs:
            log.close()
            log.store.close()


class TenantLimits:
    """Each tenant's ``rate_per_minute`` over its API calls, in a window shared by every
    process when Redis is configured. Its runs count their tool actions in the same
    ``window`` (``AgentConfig.limits_window``) against a counter of their own: a limit's name
    keys the window (``api:tenant:<id>`` here, ``actions:tenant:<id>`` for the runs), so
    polling a run never holds up its actions, nor the reverse."""

    def __init__(self, redis: str | None, *, namespace: str = "stockade") -> None:
        self.window: Window = RedisWindow(redis, namespace=namespace) if redis else LocalWindow()
        self._rates: dict[str, RateLimit] = {}
        self._lock = threading.Lock()

    def rate(self, tenant: Tenant) -> RateLimit | None:
        if tenant.rate_per_minute is None:
            return None
        with self._lock:
            limit = self._rates.get(tenant.id)
            if limit is None or (limit.per_minute, limit.period_s) != (
                tenant.rate_per_minute,
                tenant.rate_period_s,
            ):
                limit = RateLimit(
                    per_minute=tenant.rate_per_minute, window=self.window, name=API_RATE,
                    period_s=tenant.rate_period_s,
                )  # fmt: skip
                self._rates[tenant.id] = limit
            return limit

    def actions(self, tenant: Tenant) -> RateLimit | None:
        """The limit the tenant's runs count their tool actions against (``actions:tenant:<id>``,
        as ``build_agent`` makes it): what a run waiting for that window looks at."""
        if tenant.rate_per_minute is None:
            return None
        return RateLimit(per_minute=tenant.rate_per_minute, window=self.window, period_s=tenant.rate_period_s)

    def admit(self, principal: Principal) -> None:
        """``RateLimited`` when the tenant's calls this minute are used up."""
        limit = self.rate(principal.tenant)
        if limit is not None:
            limit.acquire(f"tenant:{principal.tenant.id}")


def check_tenants(tenants: Tenants) -> None:
    if not tenants.tenants:
        raise exc.ConfigurationError("the service has no tenants: give a tenants file (--tenants)")
