"""``AgentSession``: one run id and what it alone needs: its sandbox, wrapped as the
``stockade.assembly`` docstring gives, its kill switch and anomaly monitor, its runtime
controls and its loop; the run is started, resumed and interrupted here.

Apart from ``GuardedAgent`` (``agent``), which holds what an agent's runs share (the policy,
the model, the audit trail, the limits' windows, the breakers, the approvals) and opens one
session per run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shlex
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from stockade._checks import check_host_path, check_id
from stockade._display import visible
from stockade._state import within
from stockade.agent.events import (
    AgentEvent,
    ModelRequested,
    ModelResponded,
    ToolCalled,
    ToolDenied,
    ToolRejected,
    ToolReturned,
)
from stockade.agent.events import Observer as AgentObserver
from stockade.agent.loop import Agent, RunResult
from stockade.agent.state import RunState
from stockade.assembly.approvals import asking_for_exec, call_approved, call_at
from stockade.assembly.guards import audited_prompt_filter, call_guard, op_guard
from stockade.audit.agent import AuditObserver
from stockade.audit.runtime_events import RuntimeAuditor
from stockade.audit.sandbox import CHECK_CALL, AuditedBackend, current_call
from stockade.audit.sandbox_texts import exec_word
from stockade.exceptions import (
    ApprovalRequired,
    ConfigurationError,
    InvalidArgument,
    PolicyDenied,
    SnapshotIncompatible,
    SnapshotNotFound,
    StockadeError,
)
from stockade.observability.agent import TelemetryObserver
from stockade.observability.sandbox import TracedBackend
from stockade.policy.agent import filter_outputs, policy_guard
from stockade.policy.approval import Approvals
from stockade.policy.approval_book import ApprovalRequest
from stockade.policy.approval_store import ApprovalStore
from stockade.policy.guards import GuardedInstance, OpContext, shown
from stockade.runs.recorder import RunRecorder
from stockade.runs.store import RunStore
from stockade.runtime.agent import RuntimeControls
from stockade.runtime.anomaly import ANOMALY_RULE, AnomalyMonitor, Finding
from stockade.runtime.breaker import BreakingBackend, RunBreakers
from stockade.runtime.events import Observer as RuntimeObserver
from stockade.runtime.events import RuntimeEvent
from stockade.runtime.failures import AgentBreaker
from stockade.runtime.kill_sources import kill_source_for
from stockade.runtime.killswitch import KillSwitch
from stockade.runtime.retry import RetryingBackend
from stockade.sandbox.base import Backend
from stockade.sandbox.facade import Sandbox
from stockade.types import ExecRecord, Limits, SnapshotKind

if TYPE_CHECKING:
    from stockade.assembly.agent import GuardedAgent

__all__ = ["AgentSession", "fan_out"]

log = logging.getLogger(__name__)


def fan_out(observers: Sequence[RuntimeObserver]) -> RuntimeObserver:
    def observe(event: RuntimeEvent) -> None:
        for observer in observers:
            observer(event)

    return observe


class AgentSession:
    """One run id: its sandbox (wrapped as the ``stockade.assembly`` docstring says), its kill
    switch, its loop."""

    def __init__(self, owner: GuardedAgent, run_id: str, *, subject: str | None = None) -> None:
        config, log = owner.config, owner.audit_log
        check_id(run_id, argument="run_id")
        if log.redactor.text(run_id) != run_id:  # stored redacted, runs would share one id
            raise InvalidArgument(
                f"run id {run_id!r} holds what the audit trail's redactor removes (a secret, a token or "
                "personal data)",
                argument="run_id",
                fix="give an opaque id (leave it out for a random one)",
            )
        self.owner = owner
        self.run_id = run_id
        self.step = 0
        self.last: RunResult | None = None
        auditor = RuntimeAuditor(log, run_id=run_id)
        stored = isinstance(owner.checkpointer, RunStore)
        observers: list[AgentObserver] = [AuditObserver(log, stored=stored), auditor.track]
        runtime: list[RuntimeObserver] = [auditor]
        self.approvals: Approvals = owner.approvals
        self._recorder: RunRecorder | None = None
        if isinstance(owner.checkpointer, RunStore):  # retries, approvals and the ledger too
            recorder = self._recorder = RunRecorder(owner.checkpointer, run_id=run_id, subject=subject)
            recorder.setup = owner.run_setup()
            observers.append(recorder)
            runtime.append(recorder.runtime)
            self.approvals = recorder.approvals(owner.approvals)
        elif subject is not None:
            raise ConfigurationError(
                "a run's data subject is recorded in a run store: give audit= a database URL, or runs_url="
            )
        # A run about a data subject: its events' attributes sealed under a key of the run that
        # erasing the subject forgets (stockade.audit.sealing); a resumed one stays sealed.
        if subject is not None:
            log.seal_run(run_id, subject)
        else:
            log.continue_sealing(run_id)
        tools = owner.tools
        if config.telemetry is not None:  # a tool call's span is current while it runs
            traced = TelemetryObserver(config.telemetry)
            observers.append(traced)
            runtime.append(traced.runtime)
            tools = tools.wrapped(traced.tool_wrapper)
        self.runtime_observer = fan_out(runtime)
        reported = fan_out((*runtime, *config.runtime_observers))
        self.kill_switch = KillSwitch(
            run_id,
            [config.kill_source or kill_source_for(config.kill_target)],
            observer=reported,
            tenant=config.tenant,
        )
        # its tools' breakers its own (its sandbox's), the providers' and backends' shared
        self.breakers = RunBreakers.of(owner.breakers)
        monitor = self.monitor = (
            AnomalyMonitor(
                rules=owner.anomaly_rules,
                clock=owner.clock,
                observer=owner.runtime_observer,
                breakers=self.breakers,
                kill_switch=self.kill_switch,
                on_kill=self._isolate,
            )
            if config.anomaly and owner.policy.anomaly.enabled
            else None
        )
        self.controls = RuntimeControls(
            run_id=run_id,
            breakers=self.breakers,
            rate=owner.rate,
            rate_key=f"tenant:{config.tenant}",
            run_rate=owner.run_rate,
            on_rate_limit=config.on_rate_limit,
            limit_wait_in_place_s=config.limit_wait_in_place_s,
            clock=owner.clock,
            retrier=owner.retrier,
            observer=reported,
            kill_switch=self.kill_switch,
            monitor=monitor,
            failures=(
                AgentBreaker(threshold=config.max_consecutive_failures, observer=reported)
                if config.max_consecutive_failures is not None
                else None
            ),
        )
        self.agent = Agent(
            owner.model,
            tools=self.controls.wrap_tools(filter_outputs(owner.engine, tools, on_flag=self.controls.flag)),
            system_prompt=config.system_prompt,
            limits=config.limits,
            guards=[self.controls.guard, call_guard(policy_guard(owner.engine, self.approvals, monitor))],
            observers=[
                *observers,
                audited_prompt_filter(owner.engine, log, self.controls.flag),
                self.controls.observe,
                self._track_step,
                *config.observers,
            ],
            checkpointer=owner.checkpointer,
            prices=owner.prices,
            check=config.check,
            check_timeout_s=config.check_timeout_s,
            keeper=owner.keeper,
            hands_back=owner.engine.hands_back,
        )
        self._raw: Sandbox | None = None
        self._sandbox: Sandbox | None = None
        self._books: Sandbox | None = None
        self._state: RunState | None = None

    @property
    def baseline(self) -> str | None:
        """What identifies the run's diff baseline (``RunState.baseline``), once it started."""
        return self._state.baseline if self._state is not None else None

    def _isolate(self, finding: Finding) -> str:
        """An anomaly rule says kill: an incident. The workspace is kept for review first, then
        the monitor pulls the kill switch with the reason returned (the sandbox dies with it)."""
        return (
            f"incident: anomaly rule {finding.rule!r} fired ({finding.detail}); the run was "
            f"isolated: its sandbox killed, {self._keep_workspace()}"
        )

    def _keep_workspace(self) -> str:
        incident_dir = self.owner.config.incident_dir
        if incident_dir is not None and self._raw is not None:
            dest = Path(incident_dir) / self.run_id / "workspace"
            try:
                kept = self._raw.files.download_dir(dest)
            except StockadeError as err:
                return f"its workspace could not be kept in {dest} ({err})"
            if kept.skipped_count:  # the evidence is partial: say what it lacks
                named = ", ".join(f"{e.path!r} ({e.kind})" for e in kept.skipped[:5])
                more = " ..." if kept.skipped_count > 5 else ""
                return f"its workspace kept in {dest}, {kept.skipped_count} entries left out: {named}{more}"
            return f"its workspace kept in {dest}"
        if isinstance(self.owner.checkpointer, RunStore):  # as its last tool call left it
            return f"its workspace kept in the run store (stockade runs workspace {self.run_id} DEST)"
        return "its workspace not kept (no run store, no incident_dir)"

    def _track_step(self, event: AgentEvent) -> None:
        if isinstance(event, ModelRequested | ToolCalled):
            self.step = event.step
        if isinstance(event, ToolReturned):
            call_approved.set(False)  # the approval covered that call's ops, and no others
        if isinstance(event, ModelRequested | ToolReturned | ToolDenied | ToolRejected):
            # the call is over: what runs next in the sandbox is no call's (it was recorded
            # under the last call's id: the acceptance check's execs, a later withdrawal)
            current_call.set(None)
            call_at.set(None)
        elif isinstance(event, ModelResponded) and not event.response.tool_calls and self.agent.check:
            current_call.set(CHECK_CALL)  # a final answer: the acceptance check runs next

    @contextlib.contextmanager
    def open(self, workspace: str | Path | None) -> Iterator[AgentSession]:
        owner = self.owner
        rules = owner.engine.sandbox_rules()
        # what of the workspace the sandbox is not given: what the rules hide (paths.deny, data
        # classes above the role, a repository's history) and the agent's own records inside it
        hide = rules.hide
        if workspace is not None:  # checked before a sandbox starts, not after
            hide = (*hide, *within(check_host_path(workspace, argument="workspace"), owner.own_records()))
        if self._recorder is not None and workspace is not None:
            # kept with the run, for ``stockade replay``: what the sandbox was given, no more
            self._recorder.seed = workspace
            self._recorder.seed_hide, self._recorder.seed_read = hide, rules.read
        telemetry = owner.config.telemetry
        tier = owner.backend if telemetry is None else TracedBackend(owner.backend, telemetry)
        backend = AuditedBackend(
            BreakingBackend(RetryingBackend(tier, owner.retrier), owner.breakers),
            owner.audit_log,
            run_id=self.run_id,
            step=lambda: self.step,
        )
        with self._start(backend, workspace, hide) as raw:
            self._raw = raw
            killable = self.controls.protect(raw)
            guard = op_guard(owner.engine, self.approvals, owner.audit_log)
            ctx = OpContext(run_id=self.run_id, role=owner.engine.role_name)
            self._sandbox = Sandbox(GuardedInstance(killable.instance, guard, ctx))
            # the run's own records (baseline, diff, saved outputs): killable and audited, but
            # not subject to the model's path rules; the sandbox confines them to the workspace
            self._books = killable
            with self.controls.watch():
                yield self

    def _start(self, backend: Backend, workspace: str | Path | None, hide: tuple[str, ...]) -> Sandbox:
        """The run's sandbox: from the snapshot the run kept when it paused, if a sandbox started
        from it is the one the run gets now (``RunSnapshots.restorable``: the policy's network
        and rules as they are now), else new (the run store puts its files back, as for a run
        without a snapshot), seeded with what the rules let it read of ``workspace`` but what
        ``hide`` names (``open``: the rules' hidden paths and the agent's own records)."""
        owner = self.owner
        limits, allow_weaker = owner.config.sandbox_limits, owner.config.allow_weaker
        network = owner.engine.network_policy()  # the role's hosts and credentials
        rules = owner.engine.sandbox_rules()
        keeper = owner.keeper
        kept = None
        if keeper is not None:
            wanted = limits or Limits()
            kept = keeper.restorable(
                self.run_id, tier=backend.tier, limits=wanted, network=network, rules=rules
            )
        if keeper is not None and kept is not None:
            # its files are the snapshot's, not the seed's; a memory snapshot's machine is as it
            # was (restorable checked that it is the one the run gets now)
            memory = kept.kind is SnapshotKind.MEMORY
            try:
                return Sandbox.create(
                    backend=backend,
                    snapshot=kept,
                    store=keeper.store,
                    limits=None if memory else limits,
                    network=None if memory else network,
                    rules=rules,
                    approver=self._approve_exec,
                    allow_weaker=allow_weaker,
                )
            except (SnapshotIncompatible, SnapshotNotFound) as err:  # another QEMU since, a gc
                log.warning("run %s: its kept sandbox was not restored (%s): files only", self.run_id, err)
        sandbox = Sandbox.create(
            backend=backend,
            limits=limits,
            network=network,
            rules=rules,
            approver=self._approve_exec,
            allow_weaker=allow_weaker,
        )
        if workspace is not None:
            try:
                sandbox.files.upload_dir(workspace, hide=hide, read=rules.read)
            except BaseException:
                sandbox.close()
                raise
        return sandbox

    def _approve_exec(self, record: ExecRecord) -> bool:
        """An exec inside the sandbox that the rules send for approval: the approvals of the
        run decide (a deferred approval refuses now and lets the same exec run once it is
        given). A human approving the tool call approves what its code runs for it, only where
        the sandbox says nothing else can have started the exec (``ExecRecord.own_code``): in
        an interpreter that earlier calls ran code in, what they left behind (a thread, a
        signal handler, a rebound name) runs during the call, and each exec is asked.

        What the acceptance check runs is refused unasked: the check is the caller's command,
        which needs no approval (the service refuses one that does at submission), and no one
        is asked inside it. One hiding its exec (``{ rm -r x; }``) left a request in the run's
        book, whose yes ran the exec at the next check, after the model's next turn."""
        if current_call.get() == CHECK_CALL:
            return False
        if call_approved.get() and record.own_code:
            return True
        redactor = self.owner.audit_log.redactor

        def said(redact: Callable[[str], str]) -> str:
            argv = shlex.join(map(redact, record.argv))
            if record.runs:  # the code chose argv (exec -a, a copy renamed, a #! line): say what runs
                return f"run `{shlex.join(map(redact, record.runs))}` (started as `{argv}`)"
            return f"run `{argv}`"

        # Shown as the trail has the exec (a word the sandbox cut keeps no head of a credential),
        # asked as it is: the id stands for the exec, not for every exec masked alike.
        request = ApprovalRequest(
            run_id=self.run_id,
            action=shown(said(functools.partial(exec_word, redactor))),
            asked_as=shown(said(str)),
            rule=record.rule,
            reason=f"code in the sandbox starts {visible(record.path)}, which needs a human's approval",
        )
        asking = asking_for_exec.set(True)
        try:
            self.approvals.require(request)
        except (PolicyDenied, ApprovalRequired):
            return False
        finally:
            asking_for_exec.reset(asking)
        return True

    @property
    def sandbox(self) -> Sandbox:
        """The sandbox the agent's tools use (policy-guarded, killable, audited)."""
        if self._sandbox is None:
            raise ConfigurationError("the session is not open")
        return self._sandbox

    def save_workspace(self, dest: str | Path) -> None:
        """Copy the run's workspace to the host (to resume a paused run in another process)."""
        if self._raw is None:
            raise ConfigurationError("the session is not open")
        self._raw.files.download_dir(dest)

    async def _drive(self, task: str | None, resume: str | RunState | None) -> RunResult:
        async with self.agent.iter(
            task, sandbox=self.sandbox, resume=resume, run_id=self.run_id, bookkeeping=self._books
        ) as run:
            run.state.audit_id = self.run_id  # the audit trail files this run's events under its id
            self._state = run.state
            async for _ in run:
                pass
        assert run.result is not None
        self.last = run.result
        if not run.result.status.resumable:  # what nobody decided waits for nothing now
            self.approvals.withdraw(self.run_id)
        return run.result

    async def run(self, task: str) -> RunResult:
        store, kept = self.approvals.store, self.owner.checkpointer
        if isinstance(store, ApprovalStore) and (kept is None or kept.load(self.run_id) is None):
            # A new run under an id used before (one its run store has is refused instead): it
            # starts with no decision; the last one's approvals let the same calls run unasked.
            store.forget(self.run_id)
        return await self._drive(task, None)

    def interrupt(self, reason: str = "interrupted") -> None:
        """Stop the run now, from any thread (a signal handler, a UI): the sandbox is killed
        mid-command and the run ends "interrupted", resumable from its last state. Save the
        workspace first (``save_workspace``) to resume it in another sandbox."""
        self.kill_switch.interrupt(reason)

    async def resume(self) -> RunResult:
        """Continue the run after a pause or an interruption (from the checkpointer, else from
        the last result)."""
        book = self.approvals.store
        if self.monitor is not None and book is not None:  # what it held before is asked again
            held = book.requests(self.run_id)
            self.monitor.recall({r["action"]: r["reason"] for r in held if r.get("rule") == ANOMALY_RULE})
        if self.owner.checkpointer is not None:
            return await self._drive(None, self.run_id)
        if self.last is None or not self.last.status.resumable:
            raise ConfigurationError("nothing to resume: no paused run here and no checkpointer")
        return await self._drive(None, self.last.state)

    def run_sync(self, task: str) -> RunResult:
        return _sync(self.run(task))

    def resume_sync(self) -> RunResult:
        return _sync(self.resume())


def _sync(coro: Coroutine[object, object, RunResult]) -> RunResult:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise ConfigurationError("run_sync() inside a running event loop: use `await session.run(...)`")
