"""One run in progress, node by node: ``AgentRun``.

Its driving (``begin``, ``next``), the model_request and check nodes, and its end (the diff,
the result, the sandbox kept or let go). The call_tools node is in ``_tool_calls`` and what
every node shares in ``_run_upkeep``, the bases it is made of; ``Agent`` (``loop``) starts it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from stockade._cuts import cut_marker
from stockade._threads import off_loop
from stockade.agent._tool_calls import ToolCalls
from stockade.agent.events import (
    AgentEvent,
    CheckFinished,
    ModelDenied,
    ModelRequested,
    ModelResponded,
    RunFinished,
    RunResumed,
    RunStarted,
    StepFinished,
)
from stockade.agent.nodes import CheckNode, End, ModelRequestNode, Node, RunResult
from stockade.agent.screen import screened
from stockade.agent.state import CheckRecord, NodeKind, RunStatus, StepRecord
from stockade.exceptions import (
    ConfigurationError,
    PolicyDenied,
    RunInterrupted,
    RunStopped,
    StockadeError,
    ToolError,
)
from stockade.models.base import counted_usage
from stockade.models.messages import AssistantMessage, ModelRequest, UserMessage
from stockade.models.pricing import cost_usd
from stockade.tools.testrun import run_test_command
from stockade.tools.workspace_diff import workspace_diff

log = logging.getLogger(__name__)

__all__ = ["AgentRun"]


class AgentRun(ToolCalls):
    """One run in progress: ``state`` is live; ``result`` is set once it ends."""

    # -- driving ------------------------------------------------------------------------

    async def begin(
        self,
        *,
        resumed: bool,
        previous: RunStatus = RunStatus.RUNNING,
        recovered: bool = False,
        restored: bool = False,
    ) -> None:
        # In a worker thread: what hears of a run's start may take long (a run store keeps a
        # copy of the workspace the run starts from), and the event loop stays free meanwhile.
        events: list[AgentEvent] = []
        if resumed:
            events.append(
                RunResumed(
                    run_id=self.state.run_id,
                    previous_status=previous.value,
                    recovered=recovered,
                    workspace_restored=restored,
                    state=self.state,
                )
            )
        events.append(
            RunStarted(
                run_id=self.state.run_id,
                task=self.state.task,
                model_name=self.state.model_name,
                resumed=resumed,
            )
        )

        def tell() -> None:
            for event in events:
                self._emit(event)

        try:
            await off_loop(tell)
        except (RunStopped, PolicyDenied, StockadeError) as err:
            self._stop(err)
        self._checkpoint()

    def __aiter__(self) -> AgentRun:
        return self

    async def __anext__(self) -> Node:
        if self.result is not None:
            raise StopAsyncIteration
        return await self.next()

    async def next(self) -> Node:
        """Run the next node, checkpoint, and return what it did (``End`` last)."""
        if self.result is not None:
            raise ConfigurationError("the run has ended")
        if self.state.next == NodeKind.END:
            return await self._end()
        started = self._node_started = self.agent.clock()
        node: Node | None = None
        try:
            if self.state.next == NodeKind.MODEL_REQUEST:
                node = await self._model_request()
            elif self.state.next == NodeKind.CHECK:
                node = await self._check()
            else:
                node = await self._call_tools()
        except (RunStopped, PolicyDenied, StockadeError) as err:
            self._stop(err)
        except (asyncio.CancelledError, KeyboardInterrupt):
            self.state.elapsed_s += self.agent.clock() - started
            try:
                self._cancelled()
            except (RunStopped, StockadeError) as err:  # the cancellation goes on all the same
                log.warning(
                    "run %s: its end after a cancellation was not recorded: %s", self.state.run_id, err
                )
            raise
        self.state.elapsed_s += self.agent.clock() - started
        if node is None:
            return await self._end()
        self._checkpoint()
        return node

    # -- nodes --------------------------------------------------------------------------

    async def _model_request(self) -> ModelRequestNode | None:
        state, agent = self.state, self.agent
        step = len(state.steps) + 1
        over = self._over_budget()
        if over is not None:
            last = state.checks[-1] if state.checks else None
            if last is not None and not last.passed and last.step == len(state.steps):
                # the model's last word was "done" and the check disagreed: that is the outcome
                self._finish(
                    RunStatus.CHECK_FAILED, error=f"{over[1]}; the acceptance check fails: {last.summary}"
                )
            else:
                self._finish(over[0], error=over[1])
            return None
        request = ModelRequest(system=state.system, messages=tuple(state.messages), tools=agent._definitions)
        self._emit(ModelRequested(run_id=state.run_id, step=step, request=request))
        started = time.perf_counter()
        # A model that never answers (a stalled stream, retries backing off for minutes) is cut
        # where the run's wall time ends: max_wall_s bounds the run, not its tool calls alone.
        cut = asyncio.timeout(self._wall_left())
        try:
            async with cut:
                response = await agent.model.request(request)
        except TimeoutError:
            if not cut.expired():
                raise  # the model's own, not ours
            used = f"the run used its wall time ({agent.limits.max_wall_s:g} s)"
            self._finish(RunStatus.BUDGET, error=f"{used} waiting for the model")
            return None
        except PolicyDenied as err:  # a decision like a tool denial: observers (the audit) see it
            self._emit(
                ModelDenied(
                    run_id=state.run_id,
                    step=step,
                    model_name=agent.model.name,
                    reason=str(err),
                    rule=err.rule,
                )
            )
            raise
        duration = time.perf_counter() - started
        # Never less than was spent: negative usage is refused, none reported is estimated.
        response = response.model_copy(update={"usage": counted_usage(request, response)})
        # Before anything keeps it: calls no record can hold become malformed calls (refused).
        response = screened(response, step=step, max_args_bytes=agent.limits.max_call_args_bytes)
        self._emit(ModelResponded(run_id=state.run_id, step=step, response=response, duration_s=duration))
        state.usage = state.usage + response.usage
        state.cost_usd += cost_usd(response.model_name or agent.model.name, response.usage, agent.prices)
        state.messages.append(AssistantMessage(text=response.text, tool_calls=response.tool_calls))
        record = StepRecord(index=step, response=response, model_duration_s=duration)
        if response.tool_calls:
            state.current = record
            state.next = NodeKind.CALL_TOOLS
        else:
            state.steps.append(record)
            self._emit(StepFinished(run_id=state.run_id, step=record))
            state.answer = response.text
            if agent.check is None:
                self._finish(RunStatus.SUCCESS)
            else:
                state.next = NodeKind.CHECK
        return ModelRequestNode(step=step, response=response, duration_s=duration)

    async def _check(self) -> CheckNode:
        """Run the acceptance check: success if it passes, else tell the model and go on."""
        state, agent = self.state, self.agent
        assert agent.check is not None, "a check node without a check"
        step = len(state.steps)
        # A check of its own timeout runs within the run's wall time too (cut there, it decided
        # nothing); without one, the sandbox's default timeout bounds it (30 s by default).
        left, own = self._wall_left(), agent.check_timeout_s
        try:
            report = await off_loop(
                run_test_command,
                self.bookkeeping,  # the user's command, not the model's: the model's rules do not apply
                agent.check,
                name=f"check-{step}-{len(state.checks) + 1}",
                timeout_s=None if own is None else max(0.01, min(own, left)),
            )
        except StockadeError:
            raise
        except Exception as err:
            # The check reads what code in the sandbox left (its runner's report), as a tool
            # does: whatever it raises ends the run as an error, with its end in the trail,
            # never as a crash out of run() that leaves the run without one.
            why = f"{type(err).__name__}: {err}"
            raise ToolError(f"the acceptance check `{agent.check}` failed to run ({why})") from err
        shown = report.observation()
        limit = agent.limits.max_observation_chars
        if len(shown) > limit:
            shown = shown[: limit // 3] + cut_marker(len(shown) - limit) + shown[-(limit * 2 // 3) :]
        lines = shown.splitlines()
        record = CheckRecord(
            command=agent.check,
            step=step,
            passed=report.ok,
            exit_code=report.exit_code,
            summary=(lines[1] if len(lines) > 1 else "") or f"exit code {report.exit_code}",
            observation=shown,
            duration_s=report.duration_s,
            timed_out=report.timed_out,
        )
        state.checks.append(record)
        self._emit(CheckFinished(run_id=state.run_id, record=record, report=report))
        if record.passed:
            self._finish(RunStatus.SUCCESS)
            return CheckNode(record=record)
        if report.timed_out and own is not None and left < own:
            used = f"the run used its wall time ({agent.limits.max_wall_s:g} s)"
            self._finish(RunStatus.BUDGET, error=f"{used} in the acceptance check")
            return CheckNode(record=record)
        failures = sum(1 for c in state.checks if not c.passed)
        if failures >= agent.limits.max_check_failures:
            self._finish(
                RunStatus.CHECK_FAILED,
                error=f"the acceptance check failed {failures} times: {record.summary}",
            )
            return CheckNode(record=record)
        state.messages.append(
            UserMessage(
                content=(
                    f"The acceptance check `{agent.check}` failed, so the task is not done yet:\n\n"
                    f"{shown}\n\nKeep working. When you are done, reply without a tool call; "
                    "the check runs again then."
                )
            )
        )
        state.next = NodeKind.MODEL_REQUEST
        return CheckNode(record=record)

    # -- ending -------------------------------------------------------------------------

    def _stop(self, err: StockadeError | RunStopped) -> None:
        if isinstance(err, RunStopped):
            status = RunStatus(err.status)
        elif isinstance(err, PolicyDenied):
            status = RunStatus.DENIED
        else:
            status = RunStatus.ERROR
        if status.resumable:  # resuming runs the interrupted node again
            self.state.resume_at = self.state.next
        self._finish(status, error=f"{type(err).__name__}: {err}")

    def _cancelled(self) -> None:
        """The task running the run was cancelled mid-node (by its caller, or by ``asyncio.run``
        on Ctrl-C): the run ends interrupted, resumable, as a kill switch's interrupt ends it,
        and its end is recorded before the cancellation goes on (the trail's ``run_end`` closes
        the call it cut; ``audit verify`` would take that call for one a dead process cut).
        Nothing here awaits, the task being cancelled; no diff is taken, as a tool call may
        still be running in its worker thread until the sandbox closes."""
        why = "the task running the run was cancelled"
        self._stop(RunInterrupted(why, run_id=self.state.run_id, reason=why))
        self._emit(RunFinished(run_id=self.state.run_id, result=self._result(f"(no diff: {why})")))
        self._checkpoint()

    async def _end(self) -> End:
        state = self.state
        if state.current is not None and not state.status.resumable:
            state.steps.append(state.current)  # a step cut short keeps what it did
            state.current = None
        try:
            diff = await off_loop(
                workspace_diff, self.bookkeeping, self.agent.hands_back, baseline=state.baseline
            )
        except RunStopped:
            diff = f"(no diff: the run's sandbox was stopped with the run, {state.status.value})"
        except StockadeError as err:
            diff = f"(the diff is unavailable: {err})"
        result = self._result(diff)
        # What is kept of the end (the diff, the audit trail's last events) is kept before the
        # checkpoint that says the run ended (the first one: ``_checkpoint`` holds back the
        # ending node's): a run that ended is never resumed to redo it.
        durable = self._durable
        if durable is not None:
            await off_loop(durable.record_diff, state.run_id, diff)
        await self._keep_sandbox()
        self._emit(RunFinished(run_id=state.run_id, result=result))
        self._checkpoint()
        return End(result=result)

    def _result(self, diff: str) -> RunResult:
        state = self.state
        self.result = RunResult(
            run_id=state.run_id,
            status=state.status,
            answer=state.answer,
            steps=tuple(state.steps),
            usage=state.usage,
            cost_usd=state.cost_usd,
            diff=diff,
            audit_id=state.audit_id,
            error=state.error,
            state=state,
            tier=self.sandbox.tier,
        )
        return self.result

    async def _keep_sandbox(self) -> None:
        """A run that can be resumed keeps its sandbox (a killed one is dead by now: what was
        kept after its last call stays); one that ended lets go of what it kept."""
        keeper, state = self.agent.keeper, self.state
        if keeper is None:
            return
        if state.status.resumable:
            kept = await off_loop(keeper.keep, state.run_id, self.bookkeeping)
            state.snapshot = kept or state.snapshot
        else:
            await off_loop(keeper.release, state.run_id)
            state.snapshot = None
