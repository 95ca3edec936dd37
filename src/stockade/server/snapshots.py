"""Snapshots over HTTP: each tenant's own snapshot store, and ``/v1/snapshots``.

A tenant's snapshots and paused sandboxes are kept in a store of its own
(``SnapshotStore(<snapshot_dir>/<tenant>)``), so another tenant's snapshot id is not found,
exactly as an id that never was (404), and nothing is shared across tenants (not even an
object two tenants' workspaces have in common). The store holds at most the tenant's
``snapshot_mb`` quota; a paused sandbox is only disk: it holds no share of the live quota
(sandboxes, CPUs, memory) until it is resumed.

Several API processes: a snapshot is written by the process that holds the sandbox, into its
``snapshot_dir``. Processes that share that folder (one host, or a shared file system) restore
each other's snapshots. Each store folder has an id of its own (``store-id``), and the
database says which store keeps each tenant's snapshot (``svc_snapshots``): a process that
does not share it answers ``SnapshotNotFound`` naming the process that has it, rather than a
bare "not found", to the role that took it (to another role, a bare "not found").

A paused run's sandbox is kept in its tenant's store too (``run/<run id>``, listed nowhere, no
role's, within ``snapshot_mb``) until the run goes on or ends. A run the service ends while it
waits (a kill, a kill-all, ``DELETE /v1/runs/{id}``, the retention) lets it go at once; one a
process could not let go of (``stockade kill --all --target DB``, which knows no snapshot folder;
a process that died between the two) is dropped by the service: at its start, before each
snapshot or pause of its tenant, and every sweep of ``Retention`` (the database says which runs
ended or are gone).

Within a tenant, a snapshot and a paused sandbox belong to the role that took them (its ref
names it, ``ROLE_KEY``): only tokens of that role list, restore, resume or delete them; to
another role of the tenant they are as a snapshot that never was (404). A role may be kept out
of a data class the sandbox held (``[data_access]``), so a role's snapshot must not be a way
around its role.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING

import anyio
from fastapi import APIRouter, Request, Response

from stockade import exceptions as exc
from stockade.runs.snapshots import kept_runs, release_run_snapshots
from stockade.sandbox._snapshot_files import MiB
from stockade.sandbox.snapshots import ROLE_KEY, SnapshotStore
from stockade.server.bodies import JSONRoute
from stockade.server.deps import Caller, get_service
from stockade.server.schemas import SnapshotOut
from stockade.server.tenants import Principal, Tenant
from stockade.types import Snapshot

if TYPE_CHECKING:
    from stockade.server.service import Service

__all__ = ["ROLE_KEY", "TenantSnapshots", "by_role", "release_run_snapshots", "router"]


log = logging.getLogger("stockade.server")

router = APIRouter(prefix="/v1/snapshots", tags=["snapshots"], route_class=JSONRoute)


def snapshot_out(snapshot: Snapshot, *, source: str | None = None, paused: str | None = None) -> SnapshotOut:
    return SnapshotOut(
        id=snapshot.id, kind=snapshot.kind.value, tier=snapshot.tier, source=source or snapshot.source,
        taken_at=snapshot.taken_at, size_bytes=snapshot.size_bytes, paused=paused,
    )  # fmt: skip


def by_role(role: str | None) -> dict[str, str]:
    """What a ref records of the role that took it (nothing for a token without a role)."""
    return {} if role is None else {ROLE_KEY: role}


def _role_of(ref: dict[str, str] | None) -> str | None:
    return None if ref is None else ref.get(ROLE_KEY)


class TenantSnapshots:
    """The tenants' snapshot stores of one service process."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.root = service.config.snapshot_root
        self._store_id: str | None = None

    def store(self, tenant: Tenant) -> SnapshotStore:
        return self.service.config.snapshot_store(tenant)

    @property
    def store_id(self) -> str:
        """The id of this snapshot folder: the same for every process that shares it."""
        if self._store_id is None:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            path = self.root / "store-id"
            with contextlib.suppress(FileExistsError):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as fh:
                    fh.write(secrets.token_hex(16))
            self._store_id = path.read_text().strip()
        return self._store_id

    def record(self, principal: Principal, name: str) -> None:
        url = self.service.config.advertise_url or ""
        self.service.store.record_snapshot(principal.tenant.id, principal.role, name, self.store_id, url)

    def forget(self, tenant: Tenant, name: str) -> None:
        self.service.store.forget_snapshot(tenant.id, name)

    def not_found(self, principal: Principal, name: str, what: str) -> exc.SnapshotNotFound:
        """ "Not found", or where it is when another process's store keeps it and the caller's
        role took it (to another role, another role's is as missing: the message confirms
        nothing of it)."""
        place = self.service.store.snapshot_place(principal.tenant.id, principal.role, name)
        if place is not None and place[0] != self.store_id:
            where = f"the API process at {place[1]}" if place[1] else "another API process"
            return exc.SnapshotNotFound(
                f"{what} {name} is kept in the snapshot store of {where}, which this process does not "
                "share: give every API process the same snapshot folder (serve --snapshot-dir, a shared "
                "folder), or send this request to that process"
            )
        return exc.SnapshotNotFound(f"no {what} {name!r}")

    @contextlib.contextmanager
    def errors(self, principal: Principal, name: str = "", what: str = "snapshot") -> Iterator[SnapshotStore]:
        """The caller's tenant's store; its errors as the caller should read them: "not found"
        says where it is if another store keeps it (the caller's role's), a full store is the
        ``snapshot_mb`` quota, and no message names the server's folders."""
        tenant = principal.tenant
        store = self.store(tenant)
        try:
            yield store
        except exc.SnapshotNotFound:
            raise self.not_found(principal, name, what) from None
        except exc.SnapshotStoreFull:
            raise self.full(tenant, store) from None
        except exc.SnapshotError as error:
            text = str(error).replace(str(store.root), "the tenant's snapshot store")
            raise type(error)(text) from None

    def full(self, tenant: Tenant, store: SnapshotStore) -> exc.QuotaExceeded:
        used = store.size() / MiB
        return exc.QuotaExceeded(
            f"tenant {tenant.id!r} keeps {used:.0f} MiB of snapshots and paused sandboxes, its "
            f"snapshot_mb quota is {tenant.quotas.snapshot_mb}: delete a snapshot (DELETE /v1/snapshots/ID)",
            quota="snapshot_mb",
            limit=float(tenant.quotas.snapshot_mb),
            used=round(used, 3),
        )

    def check_room(self, tenant: Tenant) -> SnapshotStore:
        """The tenant's store, or ``QuotaExceeded`` when it is full already (the sandboxes of
        its runs that ended are no longer counted: they go first)."""
        store = self.store(tenant)
        self.drop_ended_runs(tenant, store)
        if store.size() >= store.max_bytes:
            raise self.full(tenant, store)
        return store

    @staticmethod
    def owned(store: SnapshotStore, snapshot_id: str, role: str | None) -> bool:
        """Whether ``role`` took ``snapshot_id``: a snapshot it kept, or the one a sandbox it
        paused is kept in (a run's, or one no ref holds, is no role's)."""
        kept = store.ref("kept", snapshot_id)
        if kept is not None:
            return _role_of(kept) == role
        return any(
            sid == snapshot_id and _role_of(store.ref("paused", name)) == role
            for name, sid in store.refs("paused")
        )

    def check_owned(self, store: SnapshotStore, snapshot_id: str, principal: Principal) -> None:
        """``SnapshotNotFound`` unless the caller's role took ``snapshot_id`` (inside
        ``errors``, it reads as any other missing snapshot)."""
        if not self.owned(store, snapshot_id, principal.role):
            raise exc.SnapshotNotFound(snapshot_id)

    @staticmethod
    def paused_ref(store: SnapshotStore, sandbox_id: str, principal: Principal) -> dict[str, str] | None:
        """The ref of the caller's role's sandbox paused as ``sandbox_id``, or None."""
        ref = store.ref("paused", sandbox_id)
        return ref if ref is not None and _role_of(ref) == principal.role else None

    def listing(self, principal: Principal) -> list[SnapshotOut]:
        """The snapshots and paused sandboxes of the caller's role."""
        store = self.store(principal.tenant)
        found: dict[str, SnapshotOut] = {}
        for kind in ("kept", "paused"):
            for name, sid in store.refs(kind):
                with contextlib.suppress(exc.SnapshotError, OSError):
                    ref = store.ref(kind, name) or {}
                    if _role_of(ref) != principal.role:
                        continue
                    snapshot = store.load(sid).snapshot
                    paused = name if kind == "paused" else None
                    found[sid] = snapshot_out(snapshot, source=paused or ref.get("source"), paused=paused)
        return sorted(found.values(), key=lambda s: s.taken_at, reverse=True)

    def release_runs(self, tenant_id: str | None, run_ids: list[str]) -> int:
        """The runs of ``tenant_id`` ended for good: the sandboxes they kept go now."""
        tenant = self.service.tenants.tenants.get(tenant_id or "")
        if tenant is None or not run_ids:  # a tenant gone: its store is no longer served
            return 0
        return release_run_snapshots(self.store(tenant), run_ids)

    def drop_ended_runs(self, tenant: Tenant, store: SnapshotStore | None = None) -> int:
        """Erase the sandboxes kept for runs of ``tenant`` the database says ended, or does not
        know (deleted, or never the service's); how many. A run that waits keeps its own."""
        store = store or self.store(tenant)
        kept = kept_runs(store)
        if not kept:  # the common case, before each snapshot or pause: no query
            return 0
        waiting = {row.run_id for row in self.service.store.open_runs(tenant.id)}  # one query
        ended = [run_id for run_id in kept if run_id not in waiting]
        return release_run_snapshots(store, ended) if ended else 0

    def sweep_ended_runs(self) -> int:
        """``drop_ended_runs`` for every tenant (the database away: the next sweep tries again)."""
        dropped = 0
        for tenant in self.service.tenants.tenants.values():
            try:
                dropped += self.drop_ended_runs(tenant)
            except (exc.StockadeError, OSError) as error:
                log.warning("kept sandboxes of tenant %s's ended runs not dropped now: %s", tenant.id, error)
        return dropped

    def collect(self) -> None:
        """What each tenant's store keeps that nothing holds (a predecessor's deletes, writes a
        crash left, the sandboxes of runs that ended): gone at start, not counted against
        ``snapshot_mb``."""
        for tenant in self.service.tenants.tenants.values():
            try:
                self.drop_ended_runs(tenant)
                self.store(tenant).collect()
            except (exc.StockadeError, OSError) as error:
                log.warning("cannot collect the snapshot store of tenant %s: %s", tenant.id, error)

    def delete(self, principal: Principal, snapshot_id: str) -> None:
        tenant = principal.tenant
        with self.errors(principal, snapshot_id) as store:
            self.check_owned(store, snapshot_id, principal)
            store.load(snapshot_id)
            paused = [name for name, sid in store.refs("paused") if sid == snapshot_id]
            store.discard(snapshot_id)  # its bytes too: they counted against snapshot_mb for good
        for name in [snapshot_id, *paused]:
            self.forget(tenant, name)


def _snapshots(request: Request) -> TenantSnapshots:
    return get_service(request).snapshots


@router.get("", response_model=list[SnapshotOut], summary="Your snapshots and paused sandboxes")
async def list_snapshots(request: Request, caller: Caller) -> list[SnapshotOut]:
    snapshots = _snapshots(request)
    listed: list[SnapshotOut] = await anyio.to_thread.run_sync(snapshots.listing, caller)
    return listed


@router.get("/{snapshot_id}", response_model=SnapshotOut, summary="One snapshot")
async def get_snapshot(snapshot_id: str, request: Request, caller: Caller) -> SnapshotOut:
    listed = await anyio.to_thread.run_sync(_snapshots(request).listing, caller)
    for item in listed:
        if item.id == snapshot_id:
            return item
    raise _snapshots(request).not_found(caller, snapshot_id, "snapshot")


@router.delete("/{snapshot_id}", status_code=204, summary="Delete a snapshot (a paused sandbox's too)")
async def delete_snapshot(snapshot_id: str, request: Request, caller: Caller) -> Response:
    snapshots = _snapshots(request)
    await anyio.to_thread.run_sync(lambda: snapshots.delete(caller, snapshot_id))
    return Response(status_code=204)
