"""The live sandboxes of one API process (``SandboxRegistry``), as ``Held`` records.

Apart from HTTP: the routes (``server/sandboxes.py``, ``server/sandbox_files.py``) ask it for
a caller's sandbox; it starts, holds, snapshots, pauses, resumes and closes them, and keeps
this process's place among its peers.

A sandbox lives in the API process that made it (its supervisor's byte stream is here);
its record, the process that holds it and its share of the tenant's quota are in the
database, so quotas hold across API processes, and a request that reaches another process is
forwarded to the one that holds the sandbox (``server/routing.py``). Each process says it is
alive every ``BEAT_S``; one silent for ``DEAD_AFTER_S`` (or, on this machine, whose pid is
gone) is dead: any peer buries it, its sandboxes answer ``SandboxGone`` (410) and their quota
is free. Every op goes through the tenant policy's guard (under the token's role) and
the tenant's audit trail (``run_id`` = the sandbox's id; ``actor`` = the token that made the
call), then the tier. A sandbox with no call for its ``idle_timeout_s`` is closed and its quota freed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from stockade import exceptions as exc
from stockade.audit.sandbox import AuditedBackend, current_actor
from stockade.policy.engine import PolicyEngine
from stockade.policy.guards import GuardedBackend, OpContext
from stockade.runs.lease import owner_gone, owner_token
from stockade.sandbox._supervised import spec_from_state
from stockade.sandbox.base import Backend, SandboxSpec
from stockade.sandbox.facade import Sandbox
from stockade.server.authz import (
    check_network,
    check_sandbox_tool,
    check_sandbox_tools,
    check_tier_network,
    choose_tier,
    engine_for,
    sandbox_op_guard,
)
from stockade.server.calls import RunningCalls
from stockade.server.sandbox_admission import consented, judged_network, same_rules, unconsented
from stockade.server.schemas import SandboxCreate, SandboxOut, SnapshotOut
from stockade.server.snapshots import by_role, snapshot_out
from stockade.server.state.rows import Node, Placement
from stockade.server.tenants import Principal, check_output_bytes
from stockade.types import Limits, SnapshotKind

__all__ = ["BEAT_S", "DEAD_AFTER_S", "Held", "SandboxRegistry"]

log = logging.getLogger("stockade.server")

BEAT_S = 2.0  # how often a process says it is alive
DEAD_AFTER_S = 15.0  # silent this long, a process is dead (as a run's lease): clocks may differ a little
SWEEP_S = 5.0  # how often a process looks for dead peers
ENDED_KEPT_S = 86400.0  # a lost sandbox answers "gone" this long, then "not found"


@dataclass(kw_only=True)
class Held:
    id: str
    tenant: str
    role: str | None  # the role of the token that made it: only that role's tokens use it
    sandbox: Sandbox
    tier_reason: str
    limits: Limits
    labels: dict[str, str]
    idle_timeout_s: float
    created_at: float = field(default_factory=time.time)
    last_used_at: float = field(default_factory=time.time)
    busy: int = 0
    state: Literal["running", "killed"] = "running"

    def out(self) -> SandboxOut:
        enforcement = self.sandbox.enforcement
        return SandboxOut(
            id=self.id,
            tier=self.sandbox.tier,
            tier_reason=self.tier_reason,
            state=self.state,
            limits=dataclasses.asdict(self.limits),
            enforcement=json.loads(json.dumps(dataclasses.asdict(enforcement), default=str)),
            started_from=self.sandbox.started_from,
            labels=self.labels,
            idle_timeout_s=self.idle_timeout_s,
            created_at=self.created_at,
            last_used_at=self.last_used_at,
        )


class SandboxRegistry:
    """The live sandboxes of this process, by id; this process's row among its peers; the
    thread that reaps idle sandboxes, says this process is alive and buries dead peers."""

    def __init__(self, service: Any) -> None:
        from stockade.server.service import Service

        assert isinstance(service, Service)
        self.service = service
        self.owner = owner_token()
        self.url = service.config.advertise_url or ""
        self.hop_key = secrets.token_urlsafe(32)  # marks a peer's forwarded request (no second rate count)
        self._held: dict[str, Held] = {}
        self.calls = RunningCalls()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.service.store.register_node(self.owner, self.url, self.hop_key)
        self.sweep()

    def start(self) -> None:
        self._reaper = threading.Thread(target=self._reap_loop, name="stockade-sandbox-reaper", daemon=True)
        self._reaper.start()

    # -- peers ----------------------------------------------------------------------------------

    def holds(self, sandbox_id: str) -> bool:
        with self._lock:
            return sandbox_id in self._held

    def is_peer(self, hop: str) -> bool:
        """Whether a request's hop header is this process's key (a peer forwarded it)."""
        return hmac.compare_digest(hop.encode(), self.hop_key.encode())

    def locate(self, sandbox_id: str) -> Placement | None:
        return self.service.store.locate(sandbox_id)

    @staticmethod
    def alive(owner: str, node: Node | None) -> bool:
        """Whether a process is alive: it has a row, has beaten lately, and (on this machine)
        still runs."""
        if node is None or owner_gone(owner):
            return False
        return time.time_ns() - node.beat_ns <= DEAD_AFTER_S * 1e9

    def sweep(self) -> list[str]:
        """Bury every process found dead (its sandboxes lost, their quota freed); their owners."""
        store = self.service.store
        nodes = {n.owner: n for n in store.nodes()}
        dead = [o for o in store.owners() if o != self.owner and not self.alive(o, nodes.get(o))]
        for owner in dead:
            lost = store.bury(owner)
            log.warning("API process %s is dead: %d of its sandboxes lost, their quota freed", owner, lost)
        store.purge_ended(time.time_ns() - int(ENDED_KEPT_S * 1e9))
        return dead

    def peers_of(self, principal: Principal) -> list[Node]:
        """The live processes other than this one that hold sandboxes of the caller's tenant."""
        store = self.service.store
        nodes = {n.owner: n for n in store.nodes()}
        owners = store.tenant_owners(principal.tenant.id)
        return [nodes[o] for o in owners if o != self.owner and self.alive(o, nodes.get(o))]

    def _beat(self) -> None:
        if self.service.store.beat(self.owner):
            return
        # A peer found this process dead (it stalled, or lost the database past DEAD_AFTER_S):
        # its sandboxes were declared lost and their quota given back, so they close here too.
        with self._lock:
            held, self._held = list(self._held.values()), {}
        log.warning("this API process was found dead by a peer; closing its %d sandboxes", len(held))
        for h in held:
            with contextlib.suppress(Exception):
                h.sandbox.close()
        self.service.store.register_node(self.owner, self.url, self.hop_key)

    # -- lifecycle ----------------------------------------------------------------------------

    def _backend(self, principal: Principal, engine: PolicyEngine, tier: str, sandbox_id: str) -> Backend:
        """The tier's backend for one sandbox: the tenant's policy under the token's role, then
        the tenant's audit trail (``run_id`` = the sandbox's id)."""
        log = self.service.audit.get(principal.tenant)
        return GuardedBackend(
            AuditedBackend(
                self.service.backends(tier), log, run_id=sandbox_id, actor=f"api:{principal.token_id}"
            ),
            sandbox_op_guard(engine),
            OpContext(run_id=sandbox_id, role=principal.role),
        )

    def _reserve(self, principal: Principal, sandbox_id: str, tier: str, limits: Limits) -> None:
        store = self.service.store
        # a call's output is held here, in the API process, up to output_bytes (each stream)
        check_output_bytes(principal.tenant, limits.output_bytes, what="this sandbox")

        def reserve() -> None:
            store.reserve_sandbox(
                sandbox_id=sandbox_id, tenant=principal.tenant.id, owner=self.owner, tier=tier,
                cpus=limits.cpus, memory_mb=limits.memory_mb, quotas=principal.tenant.quotas,
            )  # fmt: skip

        try:
            reserve()
        except exc.QuotaExceeded:
            if not self.sweep():  # a dead process may hold the quota: bury it, and try once more
                raise
            reserve()

    def _hold(self, held: Held) -> Held:
        with self._lock:
            self._held[held.id] = held
        return held

    def create(self, principal: Principal, request: SandboxCreate) -> Held:
        service, tenant = self.service, principal.tenant
        engine = engine_for(principal, request.trust)
        check_sandbox_tools(engine)
        if request.snapshot is not None:
            check_sandbox_tool(principal, "restore")
        kept: SandboxSpec | None = None
        memory = False
        if request.snapshot is not None:
            with service.snapshots.errors(principal, request.snapshot) as store:
                service.snapshots.check_owned(store, request.snapshot, principal)  # another role's: not found
                manifest = store.load(request.snapshot)
                kept = spec_from_state(manifest.spec)
            memory = manifest.snapshot.kind is SnapshotKind.MEMORY
        asked = request.tier or (manifest.snapshot.tier if kept is not None else None)
        tier, why = choose_tier(engine, asked, request.prefer)
        # its memory comes back on its own tier; on another, only its files
        memory = memory and tier == manifest.snapshot.tier
        if kept is not None and memory:
            fix = "restore a files snapshot (memory=false): its files come back under the policy as it is now"
            same_rules(engine, kept, manifest.snapshot.id, "snapshot", fix)
        network = request.network.build() if request.network is not None else None
        if network is not None:  # the policy's own rules for the hosts asked for, with credentials
            network = check_network(engine, network)
        elif kept is not None:
            judged = judged_network(engine, kept)  # refused if the policy no longer gives it
            # a memory snapshot keeps its own, the same as judged (no credentials); its files
            # alone take the policy's as it is now
            network = None if memory else judged
        check_tier_network(
            self.service.backends(tier),
            network if network is not None else kept.network if kept is not None else None,
        )
        given = request.limits.build() if request.limits is not None else None
        limits = given or (kept.limits if kept is not None else Limits())
        idle = min(request.idle_timeout_s or service.config.sandbox_idle_timeout_s,
                   service.config.max_sandbox_idle_timeout_s)  # fmt: skip
        sandbox_id = f"sbx_{uuid.uuid4().hex}"
        self._reserve(principal, sandbox_id, tier, limits)
        try:
            backend = self._backend(principal, engine, tier, sandbox_id)
            # a request's allow_weaker counts only with the operator's consent: without it the
            # tier refuses before it starts anything (a snapshot brings the consent it was
            # taken with, judged after the start below)
            weaker = request.allow_weaker and tenant.allow_weaker
            if request.snapshot is not None:
                with service.snapshots.errors(principal, request.snapshot) as store:
                    sandbox = Sandbox.create(
                        tier, backend=backend, limits=given, network=network, envs=request.envs or None,
                        rules=engine.sandbox_rules(), allow_weaker=weaker,
                        labels=request.labels, snapshot=request.snapshot, store=store,
                    )  # fmt: skip
                why = f"{why}; started from snapshot {request.snapshot}"
            else:
                sandbox = Sandbox.create(
                    backend=backend, limits=limits, network=network, envs=request.envs,
                    rules=engine.sandbox_rules(), allow_weaker=weaker, labels=request.labels,
                )  # fmt: skip
            # after the start: only the tier knows what it holds less strictly, and a snapshot
            # brings the consent it was taken with
            consented(tenant, sandbox)
        except exc.LimitNotEnforceable as refused:
            service.store.release_sandbox(sandbox_id)
            raise unconsented(tenant, request.allow_weaker, refused) from None
        except BaseException:
            service.store.release_sandbox(sandbox_id)
            raise
        labels = {**(kept.labels if kept is not None else {}), **request.labels}
        held = Held(
            id=sandbox_id, tenant=tenant.id, role=principal.role, sandbox=sandbox, tier_reason=why,
            limits=limits, labels=labels, idle_timeout_s=idle,
        )  # fmt: skip
        return self._hold(held)

    # -- snapshots ----------------------------------------------------------------------------

    def snapshot(self, principal: Principal, sandbox_id: str, memory: bool | None) -> SnapshotOut:
        """Save the sandbox into its tenant's store and let it run on."""
        tenant, snapshots = principal.tenant, self.service.snapshots
        check_sandbox_tool(principal, "snapshot")
        self.get(principal, sandbox_id)
        snapshots.check_room(tenant)
        with (
            self.use(principal, sandbox_id) as sandbox,
            snapshots.errors(principal, sandbox_id, "sandbox") as store,
        ):
            taken = sandbox.snapshot(memory=memory, store=store)
            # named by the API's id; the role's alone
            store.set_ref("kept", taken.id, taken.id, source=sandbox_id, **by_role(principal.role))
        snapshots.record(principal, taken.id)
        return snapshot_out(taken, source=sandbox_id)

    def pause(self, principal: Principal, sandbox_id: str, memory: bool | None) -> SnapshotOut:
        """Save the sandbox and stop it: kept under its id until ``resume``; its share of the
        live quota (count, CPUs, memory) is free meanwhile, its disk counts as snapshots."""
        tenant, snapshots = principal.tenant, self.service.snapshots
        check_sandbox_tool(principal, "pause")
        held = self.get(principal, sandbox_id)
        snapshots.check_room(tenant)
        with (
            self.use(principal, sandbox_id) as sandbox,
            snapshots.errors(principal, sandbox_id, "sandbox") as store,
        ):
            taken = sandbox.pause(memory=memory, store=store)
            # the tier keeps it under its own id for the sandbox; the API's id names it here
            store.set_ref("paused", sandbox_id, taken.id, **by_role(principal.role))
            if sandbox.id != sandbox_id:
                store.drop_ref("paused", sandbox.id)
        with self._lock:
            self._held.pop(sandbox_id, None)
        with contextlib.suppress(Exception), self.acting(principal):
            held.sandbox.close()
        self.service.store.release_sandbox(sandbox_id)
        snapshots.record(principal, sandbox_id)
        return snapshot_out(taken, source=sandbox_id, paused=sandbox_id)

    def resume(self, principal: Principal, sandbox_id: str) -> Held:
        """A paused sandbox, running again under its id (on this process). One resume wins."""
        service, tenant, snapshots = self.service, principal.tenant, self.service.snapshots
        check_sandbox_tool(principal, "resume")
        if self.holds(sandbox_id):
            self.get(principal, sandbox_id)  # another tenant's: not found
            raise exc.SnapshotNotFound(f"sandbox {sandbox_id} is running, not paused")
        what = "paused sandbox"
        with snapshots.errors(principal, sandbox_id, what) as store:
            ref = snapshots.paused_ref(store, sandbox_id, principal)  # another role's: not found
            if ref is None:
                raise exc.SnapshotNotFound(sandbox_id)
            manifest = store.load(ref["snapshot"])
            kept = spec_from_state(manifest.spec)
        tier = manifest.snapshot.tier
        engine = engine_for(principal)
        choose_tier(engine, tier)  # the role may still use its tier
        if manifest.snapshot.kind is SnapshotKind.MEMORY:
            fix = "it stays paused: resumed once the policy gives those rules again, or deleted"
            same_rules(engine, kept, sandbox_id, "paused sandbox", fix)
        network = judged_network(engine, kept)
        check_tier_network(self.service.backends(tier), kept.network)
        if manifest.snapshot.kind is SnapshotKind.MEMORY:
            network = None
        backend = self._backend(principal, engine, tier, sandbox_id)
        # The claim first: only the resume that wins it (on any process sharing the store)
        # reserves the quota under the sandbox's id; a refusal puts the ref back, still paused.
        with snapshots.errors(principal, sandbox_id, what) as store, store.claim("paused", sandbox_id) as ref:
            self._reserve(principal, sandbox_id, tier, kept.limits)
            try:
                sandbox = Sandbox.create(
                    tier, backend=backend, network=network, rules=engine.sandbox_rules(),
                    snapshot=ref["snapshot"], store=store,
                )  # fmt: skip
                consented(tenant, sandbox)  # it resumes with the consent it paused with
            except BaseException:
                service.store.release_sandbox(sandbox_id)
                raise
        store.discard(ref["snapshot"])  # consumed: its bytes no longer count against snapshot_mb
        snapshots.forget(tenant, sandbox_id)
        held = Held(
            id=sandbox_id, tenant=tenant.id, role=principal.role, sandbox=sandbox,
            tier_reason=f"resumed from its pause, on its {tier} tier", limits=kept.limits,
            labels=dict(kept.labels), idle_timeout_s=service.config.sandbox_idle_timeout_s,
        )  # fmt: skip
        return self._hold(held)

    def get(self, principal: Principal, sandbox_id: str) -> Held:
        """The caller's sandbox; another tenant's, another role's of its tenant, or none, is
        ``ResourceNotFound`` alike."""
        with self._lock:
            held = self._held.get(sandbox_id)
        if held is None or not self._mine(principal, held):
            raise exc.ResourceNotFound(f"no sandbox {sandbox_id!r}", kind="sandbox", id=sandbox_id)
        return held

    @staticmethod
    def _mine(principal: Principal, held: Held) -> bool:
        return held.tenant == principal.tenant.id and held.role == principal.role

    def paused(self, principal: Principal, sandbox_id: str) -> SandboxOut | None:
        """The caller's paused sandbox ``sandbox_id`` as a sandbox is shown (state ``paused``,
        its tier, limits and labels as kept), or None: none is paused under that id in the
        tenant's store by the caller's role (another tenant's is not in it)."""
        store = self.service.snapshots.store(principal.tenant)
        if not (store.root / "refs" / "paused").is_dir():
            return None  # not created by a look
        try:
            ref = self.service.snapshots.paused_ref(store, sandbox_id, principal)
            if ref is None:
                return None
            manifest = store.load(ref["snapshot"])
            kept = spec_from_state(manifest.spec)
        except (exc.SnapshotError, exc.InvalidArgument, OSError, KeyError, ValueError):
            return None
        snapshot = manifest.snapshot
        enforcement = manifest.tier_state.get("enforcement")
        return SandboxOut(
            id=sandbox_id,
            tier=snapshot.tier,
            tier_reason=f"paused: kept in {snapshot.kind.value} snapshot {snapshot.id}",
            state="paused",
            limits=json.loads(json.dumps(dataclasses.asdict(kept.limits), default=str)),
            enforcement=enforcement if isinstance(enforcement, dict) else {},
            labels=dict(kept.labels),
            idle_timeout_s=self.service.config.sandbox_idle_timeout_s,
            created_at=snapshot.taken_at,
            last_used_at=snapshot.taken_at,
        )

    def of(self, principal: Principal) -> list[Held]:
        with self._lock:
            return [h for h in self._held.values() if self._mine(principal, h)]

    @staticmethod
    @contextlib.contextmanager
    def acting(principal: Principal) -> Iterator[None]:
        """The audit events of the calls made in the block name the caller's token: another
        token of the role may use a sandbox it did not make."""
        token = current_actor.set(f"api:{principal.token_id}")
        try:
            yield
        finally:
            current_actor.reset(token)

    @contextlib.contextmanager
    def use(self, principal: Principal, sandbox_id: str) -> Iterator[Sandbox]:
        """The sandbox for one call: counted busy (the reaper leaves it), its clock reset, its
        events the caller's."""
        held = self.get(principal, sandbox_id)
        if held.state == "killed":
            raise exc.SandboxClosed(f"sandbox {sandbox_id} was killed; create a new one")
        with self._lock:
            held.busy += 1
        try:
            with self.acting(principal):
                yield held.sandbox
        finally:
            with self._lock:
                held.busy -= 1
                held.last_used_at = time.time()

    def _close(self, held: Held) -> None:
        with contextlib.suppress(Exception):
            held.sandbox.close()
        self.service.store.release_sandbox(held.id)

    def kill(self, principal: Principal, sandbox_id: str) -> Held:
        """Stop it now, mid-command too; it stays listed (``killed``) until deleted."""
        held = self.get(principal, sandbox_id)
        held.state = "killed"
        with contextlib.suppress(Exception), self.acting(principal):
            held.sandbox.close()
        self.service.store.end_sandbox(held.id, "killed")  # its quota is free; peers still find it
        return held

    def delete(self, principal: Principal, sandbox_id: str) -> None:
        held = self.get(principal, sandbox_id)
        with self._lock:
            self._held.pop(sandbox_id, None)
        with self.acting(principal):
            self._close(held)

    def _reap_loop(self) -> None:
        beat_at = sweep_at = time.monotonic()
        while not self._stop.wait(min(1.0, BEAT_S)):
            try:
                now = time.monotonic()
                if now - beat_at >= BEAT_S:
                    beat_at = now
                    self._beat()
                self.reap()
                if now - sweep_at >= SWEEP_S:
                    sweep_at = now
                    self.sweep()
            except Exception:  # the database away for a moment: the next round tries again
                log.exception("the sandbox reaper's round failed")

    def reap(self) -> list[str]:
        now = time.time()
        with self._lock:
            idle = [h for h in self._held.values() if h.busy == 0 and now - h.last_used_at > h.idle_timeout_s]
            for held in idle:
                del self._held[held.id]
        for held in idle:
            self._close(held)
        return [h.id for h in idle]

    def close(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join()
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for h in held:
            self._close(h)
        self.service.store.forget_node(self.owner)
