"""``RunRecorder``: what a checkpoint does not hold, written to the run store as it happens.

    recorder = RunRecorder(store, seed="project/")   # seed: the folder the run starts from
    agent = Agent(model, checkpointer=store, observers=[recorder],
                  guards=[policy_guard(engine, recorder.approvals(approvals))])
    backend = RetryingBackend(backend, Retrier(observer=recorder.runtime))

- as an agent observer: the starting workspace (``seed``, as the sandbox was given it: what
  ``seed_read`` names but what ``seed_hide`` names) and what the run runs under (``setup``:
  its policy, role and tier, for ``stockade replay``) are kept when the run starts, and
  the data subject whose personal data the run holds (``subject``), so it can be erased;
  each tool call enters the ledger the moment it returns, and the final diff when it ends;
- ``runtime``, a runtime observer: retries, attached to the step and tool call in progress
  (a retry before the run starts, e.g. of the sandbox start, is kept until the run id is known);
- ``approvals``: wraps an ``Approvals`` so that each decision, or a pause for one, is recorded.

Runtime observers must not raise; a failed write is raised instead at the next agent event,
which ends the run (an unrecorded run must not go on as if it were recorded).
"""

from __future__ import annotations

import time
from pathlib import Path

from stockade import exceptions as exc
from stockade.agent.events import (
    AgentEvent,
    ModelRequested,
    RunFinished,
    RunStarted,
    ToolCalled,
    ToolReturned,
)
from stockade.policy.approval import Approvals
from stockade.policy.approval_book import ApprovalRequest
from stockade.runs.store import ApprovalEntry, RetryEntry, RunSetup, RunStore
from stockade.runtime.events import RetryScheduled, RuntimeEvent

__all__ = ["RecordedApprovals", "RunRecorder"]


class RunRecorder:
    """Follows one run at a time (the one whose events it receives)."""

    def __init__(
        self,
        store: RunStore,
        *,
        run_id: str | None = None,
        seed: str | Path | None = None,
        subject: str | None = None,
    ) -> None:
        self.store = store
        self.seed = seed  # the folder the run starts from, kept for ``stockade replay``
        # what of it the seed keeps: the sandbox's upload of it (the policy's read and hide globs)
        self.seed_hide: tuple[str, ...] = ()
        self.seed_read: tuple[str, ...] = ("**",)
        self.setup: RunSetup | None = None  # what the run runs under (``build_agent`` sets it)
        self.subject = subject  # whose personal data the run holds (``RunStore.runs_of``)
        self.run_id = run_id
        self.step = 0
        self.call_id: str | None = None
        self._early: list[RetryEntry] = []  # retries before the run id was known
        self._failure: exc.StockadeError | None = None

    def __call__(self, event: AgentEvent) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        match event:
            case RunStarted():
                self.run_id = event.run_id
                if self.setup is not None and not event.resumed:
                    self.store.record_setup(event.run_id, self.setup)
                if self.seed is not None and not event.resumed:
                    self.store.save_seed(event.run_id, self.seed, hide=self.seed_hide, read=self.seed_read)
                if self.subject is not None:
                    self.store.tag_subject(event.run_id, self.subject)
                early, self._early = self._early, []
                for entry in early:
                    self.store.record_retry(event.run_id, entry)
            case ModelRequested():
                self.step, self.call_id = event.step, None
            case ToolCalled():
                self.step, self.call_id = event.step, event.call.id
            case ToolReturned():
                self.store.record_tool_call(event.run_id, event.step, event.record)
                self.call_id = None
            case RunFinished():
                self.store.record_diff(event.run_id, event.result.diff)
            case _:
                pass

    def runtime(self, event: RuntimeEvent) -> None:
        """A runtime observer (``Retrier(observer=...)``); never raises."""
        if not isinstance(event, RetryScheduled):
            return
        entry = RetryEntry(
            step=self.step,
            call_id=self.call_id,
            subject=event.subject,
            attempt=event.attempt,
            delay_s=event.delay_s,
            reason=event.reason,
            recorded_ns=time.time_ns(),
        )
        if self.run_id is None:
            self._early.append(entry)
            return
        try:
            self.store.record_retry(self.run_id, entry)
        except exc.StockadeError as error:
            self._failure = error

    def approvals(self, inner: Approvals) -> RecordedApprovals:
        return RecordedApprovals(inner, self)

    def approval(self, request: ApprovalRequest, decision: str) -> None:
        self.store.record_approval(
            request.run_id,
            ApprovalEntry(
                step=self.step,
                request_id=request.id,
                action=request.action,
                rule=request.rule,
                reason=request.reason,
                decision=decision,
                recorded_ns=time.time_ns(),
            ),
        )


class RecordedApprovals(Approvals):
    """The same approvals, each outcome recorded: approved, denied, or pending (the run pauses)."""

    def __init__(self, inner: Approvals, recorder: RunRecorder) -> None:
        super().__init__(inner.approver, inner.store, max_pending=inner.max_pending)
        self.inner = inner
        self.recorder = recorder

    def require(self, request: ApprovalRequest) -> None:
        request = self.keyed(request)  # recorded under the id its book keeps
        try:
            self.inner.require(request)
        except exc.ApprovalRequired:
            self.recorder.approval(request, "pending")
            raise
        except exc.ApprovalsFull:
            raise  # no request was kept: nothing to list (the trail says once that the run was full)
        except exc.PolicyDenied:
            self.recorder.approval(request, "denied")
            raise
        self.recorder.approval(request, "approved")

    def withdraw(self, run_id: str) -> list[ApprovalRequest]:
        closed = self.inner.withdraw(run_id)
        for request in closed:
            self.recorder.approval(request, "withdrawn")
        return closed
