"""Sandboxes over HTTP: ``stockade.Sandbox`` behind ``/v1/sandboxes``.

A sandbox lives in the API process that made it (its supervisor's byte stream is here);
its record, the process that holds it and its share of the tenant's quota are in the
database, so quotas hold across API processes, and a request that reaches another process is
forwarded to the one that holds the sandbox (``server/routing.py``). Each process says it is
alive every ``BEAT_S``; one silent for ``DEAD_AFTER_S`` (or, on this machine, whose pid is
gone) is dead: any peer buries it, its sandboxes answer ``SandboxGone`` (410) and their quota
is free. Every op goes through the tenant policy's guard (under the token's role) and
the tenant's audit trail (``run_id`` = the sandbox's id; ``actor`` = the token that made the
call), then the tier. A sandbox with no call for its ``idle_timeout_s`` is closed and its quota freed.

A sandbox belongs to the role of the token that made it: the tokens of that role use it; to
another role of the tenant it is as another tenant's, not found (404) on every route, and so
are its snapshots and its pause (``server/snapshots.py``). The role's policy was asked what
the sandbox may hold (``[data_access]`` above a role never enters it), so another role must
not read it there. Each call amounts to one of the agent's tools (``authz.SANDBOX_TOOLS``:
a command is ``shell``, code ``run_code``, a write ``write_file``, ...) and is refused (403,
rule ``roles.<role>.tools``) when the role's ``tools`` leave it out, as a run's call would be.

Command output streams as NDJSON (``"stream": true``): one JSON object a line,
``{"type": "stdout"|"stderr", "data": TEXT}`` as the output comes, then
``{"type": "result", "result": {...CommandResult or Execution...}}`` or
``{"type": "error", "problem": {...}}`` last. A client that reads slower than the call prints
misses output past ``STREAM_BUFFER_CHARS`` waiting here: a
``{"type": "skipped", "stdout": N, "stderr": M}`` line (characters) marks where; the result
holds all of it.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Query, Request, Response
from fastapi.encoders import jsonable_encoder

from stockade import exceptions as exc
from stockade.audit.sandbox import AuditedBackend, current_actor
from stockade.policy.engine import PolicyEngine
from stockade.policy.guards import GuardedBackend, OpContext
from stockade.runs.lease import owner_gone, owner_token
from stockade.sandbox._startup import rules_changed
from stockade.sandbox._supervised import spec_from_state
from stockade.sandbox.base import Backend, SandboxSpec
from stockade.sandbox.facade import Sandbox
from stockade.sandbox.ops import LISTING_TRUNCATED_HEADER, ReadFile
from stockade.server.authz import (
    check_network,
    check_sandbox_tool,
    check_sandbox_tools,
    check_tier_network,
    choose_tier,
    engine_for,
    network_changed,
    sandbox_op_guard,
)
from stockade.server.bodies import JSONRoute, raw_body, read_body
from stockade.server.calls import CutOnLeave, RunningCalls
from stockade.server.deps import Caller, get_service, recheck
from stockade.server.downloads import entries_that_fit, pack_folder
from stockade.server.held import CHUNK, HeldResponse, Hold, held_bytes, unpacking
from stockade.server.schemas import (
    CodeRequest,
    CommandRequest,
    SandboxCreate,
    SandboxOut,
    SnapshotOut,
    SnapshotRequest,
)
from stockade.server.scratch import scratch
from stockade.server.snapshots import by_role, snapshot_out
from stockade.server.state.rows import Node, Placement
from stockade.server.streamed import streamed
from stockade.server.tenants import Principal, Tenant, check_output_bytes, check_weaker
from stockade.server.uploads import unpack_within
from stockade.types import CommandResult, EntryInfo, Execution, Limits, Listing, NetworkPolicy, SnapshotKind

__all__ = ["BEAT_S", "DEAD_AFTER_S", "Held", "SandboxRegistry", "router"]

log = logging.getLogger("stockade.server")
router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"], route_class=JSONRoute)

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

    @staticmethod
    def _network(engine: PolicyEngine, kept: SandboxSpec) -> NetworkPolicy | None:
        """A snapshot's network, judged again by the tenant's policy as it is now."""
        if not (kept.network.enabled or kept.network.egress):
            return None
        return check_network(engine, kept.network)

    @classmethod
    def _same_rules(cls, engine: PolicyEngine, kept: SandboxSpec, snapshot: str, what: str, fix: str) -> None:
        """A memory snapshot comes back only under the rules and network it was taken with:
        its supervisor and kernel hold those rules, its egress proxy that network. A tenant
        whose policy changed since is refused (the sandbox would enforce the old ones), with
        what changed; its files still come back under the policy as it is now, from a files
        snapshot. A host no longer allowed is ``PolicyDenied``, as for a new sandbox; one still
        allowed whose methods, ports or rates the policy changed is such a change (it came back
        with the old ones)."""
        differences = rules_changed(kept.rules, engine.sandbox_rules())
        judged = cls._network(engine, kept)
        if judged is not None:
            differences += network_changed(kept.network, judged)
        if differences:
            raise exc.SnapshotIncompatible(
                f"{what} {snapshot} keeps a running sandbox's memory under the sandbox rules and "
                f"network the tenant's policy gave when it was taken; the policy has changed since "
                f"({'; '.join(differences)}) and its memory cannot come back under the new ones: {fix}"
            )

    @staticmethod
    def _consented(tenant: Tenant, sandbox: Sandbox) -> None:
        """Close ``sandbox`` and refuse it (``PolicyDenied``) where it is weaker than asked and
        the tenants file does not let its tenant accept that."""
        try:
            check_weaker(tenant, sandbox.enforcement.weakened, what="this sandbox")
        except exc.PolicyDenied:
            with contextlib.suppress(Exception):
                sandbox.close()
            raise

    @staticmethod
    def _unconsented(tenant: Tenant, asked: bool, refused: exc.LimitNotEnforceable) -> exc.StockadeError:
        """What a tenant is told of a tier's refusal: its advice to pass ``allow_weaker`` holds
        here only where the tenants file lets the tenant accept weaker enforcement."""
        if tenant.allow_weaker:
            return refused
        weakened = (f"{refused.setting}: {refused}" if refused.setting else str(refused),)
        if asked:  # the request asked for what only the operator can give
            try:
                check_weaker(tenant, weakened, what="this sandbox")
            except exc.PolicyDenied as denied:
                return denied
        fix = (
            f"{refused.fix} (here allow_weaker counts only where the tenants file sets "
            f"allow_weaker = true under [tenants.{tenant.id}])"
        )
        return exc.LimitNotEnforceable(str(refused), setting=refused.setting, fix=fix)

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
            self._same_rules(engine, kept, manifest.snapshot.id, "snapshot", fix)
        network = request.network.build() if request.network is not None else None
        if network is not None:  # the policy's own rules for the hosts asked for, with credentials
            network = check_network(engine, network)
        elif kept is not None:
            judged = self._network(engine, kept)  # refused if the policy no longer gives it
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
            self._consented(tenant, sandbox)
        except exc.LimitNotEnforceable as refused:
            service.store.release_sandbox(sandbox_id)
            raise self._unconsented(tenant, request.allow_weaker, refused) from None
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
            self._same_rules(engine, kept, sandbox_id, "paused sandbox", fix)
        network = self._network(engine, kept)
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
                self._consented(tenant, sandbox)  # it resumes with the consent it paused with
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


def _registry_of(request: Request) -> SandboxRegistry:
    return get_service(request).sandboxes


async def _blocking(function: Callable[[], Any]) -> Any:
    return await anyio.to_thread.run_sync(function)


async def _call(
    request: Request, caller: Principal, function: Callable[[], Any], *, cut_on_leave: bool = False
) -> Any:
    """``function`` on a server thread, as one of the caller's ``RunningCalls`` (refused at
    once when they are all taken). Killing or deleting a sandbox is not one: a tenant at its
    most can always stop what holds it. ``cut_on_leave``: a command or code, stopped in the
    sandbox when its client goes (``CutOnLeave``); the other calls are short, and run to
    their end."""
    cut = CutOnLeave(request) if cut_on_leave else None
    return await _registry_of(request).calls.run(caller.tenant, function, cut=cut)


# -- routes -------------------------------------------------------------------------------


@router.post("", status_code=201, response_model=SandboxOut, summary="Create a sandbox")
async def create_sandbox(body: SandboxCreate, request: Request, caller: Caller) -> SandboxOut:
    registry = _registry_of(request)
    held: Held = await _call(request, caller, lambda: registry.create(caller, body))
    return held.out()


@router.get("", response_model=list[SandboxOut], summary="List your sandboxes")
async def list_sandboxes(request: Request, caller: Caller) -> list[SandboxOut]:
    from stockade.server.routing import HOP_HEADER, peers_of

    registry = _registry_of(request)
    found = [h.out() for h in registry.of(caller)]
    if HOP_HEADER not in request.headers:  # a peer asks only for this process's own
        found += await peers_of(request, caller)
    return found


@router.get("/{sandbox_id}", response_model=SandboxOut, summary="One sandbox")
async def get_sandbox(sandbox_id: str, request: Request, caller: Caller) -> SandboxOut:
    registry = _registry_of(request)
    try:
        return registry.get(caller, sandbox_id).out()
    except exc.ResourceNotFound:
        # no process holds a paused sandbox (routing left it here): the tenant's store does
        paused: SandboxOut | None = await _blocking(lambda: registry.paused(caller, sandbox_id))
        if paused is None:
            raise
        return paused


@router.post("/{sandbox_id}/kill", response_model=SandboxOut, summary="Stop a sandbox now, mid-command too")
async def kill_sandbox(sandbox_id: str, request: Request, caller: Caller) -> SandboxOut:
    registry = _registry_of(request)
    held: Held = await _blocking(lambda: registry.kill(caller, sandbox_id))
    return held.out()


@router.post("/{sandbox_id}/snapshot", status_code=201, response_model=SnapshotOut,
             summary="Save the sandbox (files, or memory where the tier can) and let it run on")  # fmt: skip
async def take_snapshot(
    sandbox_id: str, request: Request, caller: Caller, body: SnapshotRequest | None = None
) -> SnapshotOut:
    registry = _registry_of(request)
    memory = body.memory if body is not None else None
    taken: SnapshotOut = await _call(request, caller, lambda: registry.snapshot(caller, sandbox_id, memory))
    return taken


@router.post("/{sandbox_id}/pause", response_model=SnapshotOut,
             summary="Save the sandbox and stop it; POST .../resume brings it back under its id")  # fmt: skip
async def pause_sandbox(
    sandbox_id: str, request: Request, caller: Caller, body: SnapshotRequest | None = None
) -> SnapshotOut:
    registry = _registry_of(request)
    memory = body.memory if body is not None else None
    paused: SnapshotOut = await _call(request, caller, lambda: registry.pause(caller, sandbox_id, memory))
    return paused


@router.post("/{sandbox_id}/resume", response_model=SandboxOut, summary="Run a paused sandbox again")
async def resume_sandbox(sandbox_id: str, request: Request, caller: Caller) -> SandboxOut:
    registry = _registry_of(request)
    held: Held = await _call(request, caller, lambda: registry.resume(caller, sandbox_id))
    return held.out()


@router.delete("/{sandbox_id}", status_code=204, summary="Close and forget a sandbox")
async def delete_sandbox(sandbox_id: str, request: Request, caller: Caller) -> Response:
    registry = _registry_of(request)
    await _blocking(lambda: registry.delete(caller, sandbox_id))
    return Response(status_code=204)


def _as_json(value: CommandResult | Execution) -> dict[str, Any]:
    return dataclasses.asdict(value)


async def _held_result(request: Request, caller: Principal, result: CommandResult | Execution) -> Response:
    """``result`` as JSON (encoded off the loop: its output may be tens of MiB), counted
    against the tenant's ``bodies_mb`` until its client has read it."""
    body: bytes = await _blocking(lambda: json.dumps(
        jsonable_encoder(_as_json(result)), ensure_ascii=False, allow_nan=False, separators=(",", ":")
    ).encode())  # fmt: skip
    hold = held_bytes(request).hold(caller.tenant, len(body), what="the result of a call that ran")
    return HeldResponse.of(body, hold=hold, media_type="application/json")


@router.post("/{sandbox_id}/commands", summary="Run a command (JSON, or NDJSON streamed while it runs)",
             response_model=None)  # fmt: skip
async def run_command(sandbox_id: str, body: CommandRequest, request: Request, caller: Caller) -> Response:
    check_sandbox_tool(caller, "command")
    registry = _registry_of(request)

    def work(
        on_stdout: Callable[[str], object] | None, on_stderr: Callable[[str], object] | None
    ) -> CommandResult:
        with registry.use(caller, sandbox_id) as sandbox:
            return sandbox.commands.run(
                body.cmd, cwd=body.cwd, envs=body.envs or None, timeout_s=body.timeout_s, stdin=body.stdin,
                on_stdout=on_stdout, on_stderr=on_stderr,
            )  # fmt: skip

    registry.get(caller, sandbox_id)  # 404 before a stream starts
    if body.stream:
        return streamed(request, caller, registry.calls, lambda out, err: _as_json(work(out, err)))
    result: CommandResult = await _call(request, caller, lambda: work(None, None), cut_on_leave=True)
    await _blocking(lambda: recheck(request, caller))  # the token may have gone while it ran
    return await _held_result(request, caller, result)


@router.post("/{sandbox_id}/code", summary="run_code (JSON, or NDJSON streamed while it runs)",
             response_model=None)  # fmt: skip
async def run_code(sandbox_id: str, body: CodeRequest, request: Request, caller: Caller) -> Response:
    check_sandbox_tool(caller, "code")
    registry = _registry_of(request)

    def work(
        on_stdout: Callable[[str], object] | None, on_stderr: Callable[[str], object] | None
    ) -> Execution:
        with registry.use(caller, sandbox_id) as sandbox:
            return sandbox.run_code(
                body.code, body.language, timeout_s=body.timeout_s, on_stdout=on_stdout, on_stderr=on_stderr
            )

    registry.get(caller, sandbox_id)
    if body.stream:
        return streamed(request, caller, registry.calls, lambda out, err: _as_json(work(out, err)))
    result: Execution = await _call(request, caller, lambda: work(None, None), cut_on_leave=True)
    await _blocking(lambda: recheck(request, caller))
    return await _held_result(request, caller, result)


@router.post("/{sandbox_id}/reset", status_code=204, summary="Kill every process, empty the workspace")
async def reset_sandbox(sandbox_id: str, request: Request, caller: Caller) -> Response:
    check_sandbox_tool(caller, "reset")
    registry = _registry_of(request)

    def work() -> None:
        with registry.use(caller, sandbox_id) as sandbox:
            sandbox.reset()

    await _call(request, caller, work)
    return Response(status_code=204)


# -- files ----------------------------------------------------------------------------------

PathQuery = Annotated[str, Query(description="relative to the workspace, or under /workspace")]


def _entry(entry: EntryInfo) -> dict[str, Any]:
    return dataclasses.asdict(entry)


@router.get(
    "/{sandbox_id}/files",
    summary="List a folder",
    description=f"At most 100,000 entries: past them the listing is cut, and the response has "
    f"the header `{LISTING_TRUNCATED_HEADER}: true`.",
)
async def list_files(
    sandbox_id: str,
    request: Request,
    response: Response,
    caller: Caller,
    path: PathQuery = "",
    depth: Annotated[int, Query(ge=1, le=32)] = 1,
) -> list[dict[str, Any]]:
    check_sandbox_tool(caller, "list")
    registry = _registry_of(request)

    def work() -> Listing:
        with registry.use(caller, sandbox_id) as sandbox:
            return sandbox.files.list(path, depth=depth)

    listing = await _call(request, caller, work)
    if listing.truncated:
        response.headers[LISTING_TRUNCATED_HEADER] = "true"
    return [_entry(e) for e in listing]


@router.get("/{sandbox_id}/files/stat", summary="One entry (404 when there is none)")
async def stat_file(sandbox_id: str, request: Request, caller: Caller, path: PathQuery) -> dict[str, Any]:
    check_sandbox_tool(caller, "stat")
    registry = _registry_of(request)

    def work() -> EntryInfo | None:
        with registry.use(caller, sandbox_id) as sandbox:
            return sandbox.files.stat(path)

    entry = await _call(request, caller, work)
    if entry is None:
        raise exc.SandboxFileNotFound(f"nothing at {path!r}", path=path)
    return _entry(entry)


@router.get("/{sandbox_id}/files/content", summary="Read a file (or, with length, a range of it)",
            response_class=Response)  # fmt: skip
async def read_file(
    sandbox_id: str, request: Request, caller: Caller, path: PathQuery,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
    length: Annotated[int | None, Query(ge=0, le=2**62)] = None,
) -> Response:  # fmt: skip
    check_sandbox_tool(caller, "read")
    registry = _registry_of(request)

    held = held_bytes(request)

    def work() -> tuple[bytes, Hold]:
        # counted before it is read (its size, or the range's length), so a tenant's share
        # bounds its reads in flight too, then as it came
        with registry.use(caller, sandbox_id) as sandbox:
            if length is not None:
                expected = min(length, ReadFile.max_bytes)
            else:
                entry = sandbox.files.stat(path)
                expected = entry.size if entry is not None else 0
            hold = held.hold(caller.tenant, expected, what="a file's content")
            try:
                if length is not None:
                    data = sandbox.files.read_range(path, offset, length)
                else:
                    data = sandbox.files.read(path, format="bytes")
                hold.resize(len(data), what="a file's content")
            except BaseException:
                hold.release()
                raise
            return data, hold

    data, hold = await _call(request, caller, work)
    return HeldResponse.of(data, hold=hold, media_type="application/octet-stream")


@router.put("/{sandbox_id}/files/content", summary="Write a file (the body is its content)")
@raw_body
async def write_file(
    sandbox_id: str, request: Request, caller: Caller, path: PathQuery,
    mode: Annotated[int, Query(ge=0, le=0o777)] = 0o644,  # as the SDK's: no setuid, setgid or sticky
) -> dict[str, Any]:  # fmt: skip
    check_sandbox_tool(caller, "write")  # before its body is read
    registry = _registry_of(request)
    registry.get(caller, sandbox_id)
    data = await read_body(request, get_service(request).config.max_file_bytes, caller)

    def work() -> EntryInfo:
        with registry.use(caller, sandbox_id) as sandbox:
            return sandbox.files.write(path, data, mode=mode)

    return _entry(await _call(request, caller, work))


@router.delete("/{sandbox_id}/files", status_code=204, summary="Remove a file or folder")
async def remove_file(sandbox_id: str, request: Request, caller: Caller, path: PathQuery) -> Response:
    check_sandbox_tool(caller, "remove")
    registry = _registry_of(request)

    def work() -> None:
        with registry.use(caller, sandbox_id) as sandbox:
            sandbox.files.remove(path)

    await _call(request, caller, work)
    return Response(status_code=204)


@router.post("/{sandbox_id}/files/dir", summary="Make a folder (and its parents)")
async def make_dir(sandbox_id: str, request: Request, caller: Caller, path: PathQuery) -> dict[str, Any]:
    check_sandbox_tool(caller, "make_dir")
    registry = _registry_of(request)

    def work() -> EntryInfo:
        with registry.use(caller, sandbox_id) as sandbox:
            return sandbox.files.make_dir(path)

    return _entry(await _call(request, caller, work))


@router.put("/{sandbox_id}/archive", status_code=204, summary="Upload a folder (a tar) into the workspace")
@raw_body
async def upload_archive(sandbox_id: str, request: Request, caller: Caller, path: PathQuery = "") -> Response:
    check_sandbox_tool(caller, "upload")  # before its body is read
    service = get_service(request)
    registry = _registry_of(request)
    registry.get(caller, sandbox_id)
    data = await read_body(request, service.config.max_upload_bytes, caller)

    def work(room: int) -> None:
        with scratch("upload", service.config.temp_dir) as tmp:
            unpack_within(data, Path(tmp) / "in", room, service.config.max_upload_bytes)
            with registry.use(caller, sandbox_id) as sandbox:
                sandbox.files.upload_dir(Path(tmp) / "in", path)

    with unpacking(request, caller, service.config.max_upload_bytes) as room:
        await _call(request, caller, lambda: work(room))
    return Response(status_code=204)


@router.get("/{sandbox_id}/archive", summary="Download a folder as a tar (checked on the server first)",
            response_class=Response)  # fmt: skip
async def download_archive(
    sandbox_id: str, request: Request, caller: Caller, path: PathQuery = "",
    max_bytes: Annotated[int | None, Query(ge=1, le=2**62)] = None,
    max_entries: Annotated[int, Query(ge=1, le=1_000_000)] = 100_000,
) -> Response:  # fmt: skip
    check_sandbox_tool(caller, "download")
    service = get_service(request)
    registry = _registry_of(request)
    cap = min(max_bytes or service.config.max_upload_bytes, service.config.max_upload_bytes)

    def work() -> tuple[IO[bytes], int]:
        # the sandbox's tar is untrusted: it is unpacked with every check of files.download_dir
        # (nothing outside the folder, links resolved inside), then packed again from the host
        # into a file on disk, the whole tar (headers too) under the service's cap
        whole = service.config.max_upload_bytes
        entries = min(max_entries, entries_that_fit(whole))  # the unpack's memory: ~1 KB an entry
        with scratch("download", service.config.temp_dir) as tmp:
            dest = Path(tmp) / "out"
            with registry.use(caller, sandbox_id) as sandbox:
                try:
                    sandbox.files.download_dir(dest, path, max_bytes=cap, max_entries=entries)
                except exc.FileTooLarge as error:
                    if entries == max_entries:
                        raise
                    raise exc.FileTooLarge(
                        f"{error} (the service takes at most {entries:,}: no more fit in a tar "
                        f"under its cap of {whole:,} bytes)",
                        path=error.path,
                    ) from None
            return pack_folder(dest, tmp, cap=whole, what=path or "/")

    packed, size = await _call(request, caller, work)
    try:  # a temporary file's disk until its client has read it
        hold = held_bytes(request).hold(caller.tenant, size, what="a packed folder")
    except exc.QuotaExceeded:
        packed.close()
        raise
    return HeldResponse(_read_out(packed), hold=hold, media_type="application/x-tar",
                        headers={"Content-Length": str(size)})  # fmt: skip


def _read_out(file: IO[bytes]) -> Iterator[bytes]:
    """``file``'s bytes a chunk at a time, then closed (when the client leaves, as the
    iterator is collected)."""
    with file:
        while chunk := file.read(CHUNK):
            yield chunk
