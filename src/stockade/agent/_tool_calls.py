"""The call_tools node: each tool call the model asked for, validated, then guarded, then
invoked, and recorded (durably, for a ``DurableCheckpointer``).

A part of ``AgentRun`` (``run``): what a call may do and what it leaves is the loop's largest
concern, and the one the durable-run promises (a call that returned never runs again) rest on.
"""

from __future__ import annotations

import time

from pydantic import BaseModel

from stockade._threads import off_loop
from stockade.agent._run_upkeep import RunUpkeep
from stockade.agent.events import StepFinished, ToolCalled, ToolDenied, ToolRejected, ToolReturned
from stockade.agent.nodes import CallToolsNode
from stockade.agent.settings import GuardContext
from stockade.agent.state import NodeKind, RunStatus, ToolCallRecord
from stockade.exceptions import (
    ApprovalRequired,
    InvalidToolCall,
    LimitWait,
    PolicyDenied,
    ProtocolError,
    SandboxClosed,
    SandboxCrashed,
    StockadeError,
)
from stockade.models.messages import ToolCall, ToolResultMessage
from stockade.tools.base import Tool, ToolContext, idempotency_key, render, reported_failure
from stockade.tools.observations import bound, clip

_FATAL = (SandboxCrashed, SandboxClosed, ProtocolError)


class ToolCalls(RunUpkeep):
    """The tool calls of a run (see ``AgentRun``)."""

    async def _call_tools(self) -> CallToolsNode:
        state = self.state
        current = state.current
        assert current is not None, "call_tools without a model response"
        calls = current.response.tool_calls
        # Calls run in order, so those with a record are a prefix (resumed mid-step: they ran);
        # by position, not by id: a model may give two calls one id.
        for index in range(len(current.tool_calls), len(calls)):
            # One response may ask for many calls: none starts once a budget is used up.
            over = self._over_budget(running=True)
            if over is not None:
                left = len(calls) - index
                self._finish(
                    over[0], error=f"{over[1]}; {left} tool call(s) of step {current.index} not started"
                )
                break
            call = calls[index]
            record = await self._call_one(current.index, index, call)
            state.messages.append(
                ToolResultMessage(
                    call_id=call.id,
                    name=call.name,
                    content=record.observation,
                    is_error=record.is_error,
                )
            )
            current = current.model_copy(update={"tool_calls": (*current.tool_calls, record)})
            state.current = current
            if state.next == NodeKind.END:
                break
            if index + 1 < len(calls):
                self._checkpoint(mid_node=True)  # the node's own checkpoint follows the last call
        state.steps.append(current)
        state.current = None
        self._emit(StepFinished(run_id=state.run_id, step=current))
        if state.next != NodeKind.END:
            state.next = NodeKind.MODEL_REQUEST
        return CallToolsNode(step=current.index, records=current.tool_calls)

    async def _call_one(self, step: int, index: int, call: ToolCall) -> ToolCallRecord:
        """One tool call (the ``index``-th of its response): validated, then guarded, then
        invoked; a refusal at either of the first two is the call's record (an observation for
        the model), not an error."""
        key = idempotency_key(self.state.run_id, step, index, call.id)
        validated = self._validate(step, call, key)
        if isinstance(validated, ToolCallRecord):
            return validated
        guarded = self._guard(step, call, key, *validated)
        if isinstance(guarded, ToolCallRecord):
            return guarded
        return await self._invoke(step, *guarded, index=index, key=key)

    def _validate(self, step: int, call: ToolCall, key: str) -> tuple[Tool, BaseModel] | ToolCallRecord:
        """The call's tool and its arguments, or the record of a malformed call (too many of
        them in a run end it)."""
        state, agent = self.state, self.agent
        tool = agent.tools.get(call.name)
        try:
            if call.malformed is not None:
                raise InvalidToolCall(f"malformed call to {call.name}: {call.malformed}")
            if tool is None:
                raise InvalidToolCall(
                    f"there is no tool {call.name!r}; the tools are: {', '.join(agent.tools.names)}"
                )
            return tool, tool.validate(call.args)
        except InvalidToolCall as err:
            state.malformed_calls += 1
            if state.malformed_calls > agent.limits.max_malformed:
                self._finish(
                    RunStatus.ERROR, error=f"too many malformed tool calls ({state.malformed_calls}): {err}"
                )
            said = clip(f"error: {err}", agent.limits.max_observation_chars)  # it may quote a key
            rejected = ToolCallRecord(
                call=call,
                idempotency_key=key,
                observation=said.text,
                is_error=True,
                failed=True,
                error_type=type(err).__name__,
                cut_chars=said.cut_chars,
            )
            self._emit(ToolRejected(run_id=state.run_id, step=step, record=rejected))
            return rejected

    def _guard(
        self, step: int, call: ToolCall, key: str, tool: Tool, args: BaseModel
    ) -> tuple[ToolCall, Tool, BaseModel] | ToolCallRecord:
        """The call as the guards let it through (possibly rewritten, then checked again), or
        the record of a denial (``max_denials`` in a row end the run). ``ApprovalRequired``
        passes: the run pauses, and the guards see the call again on resume."""
        state, agent = self.state, self.agent
        try:
            guard_ctx = GuardContext(
                run_id=state.run_id, step=step, tool=tool, sandbox=self.sandbox, state=state
            )
            asked = call
            for guard in agent.guards:
                call = guard(guard_ctx, call)
            if call != asked:  # a guard rewrote the call: check it again
                rewritten = agent.tools.get(call.name)
                if rewritten is None:
                    raise PolicyDenied(f"a guard rewrote the call to an unknown tool {call.name!r}")
                tool, args = rewritten, rewritten.validate(call.args)
        except PolicyDenied as err:
            limit = agent.limits.max_observation_chars
            reason = clip(str(err), limit).text  # it quotes what was asked (a path of any length)
            state.consecutive_denials += 1
            self._emit(ToolDenied(run_id=state.run_id, step=step, call=call, reason=reason, rule=err.rule))
            if state.consecutive_denials >= agent.limits.max_denials:
                self._finish(
                    RunStatus.DENIED,
                    error=f"{state.consecutive_denials} actions in a row were denied: {reason}",
                )
            rule = f" (rule {err.rule})" if err.rule else ""
            said = clip(f"denied by policy{rule}: {reason}", limit)
            return ToolCallRecord(
                call=call,
                idempotency_key=key,
                observation=said.text,
                is_error=True,
                failed=True,
                error_type="PolicyDenied",
                denied=True,
                cut_chars=said.cut_chars,
            )
        state.consecutive_denials = 0
        return call, tool, args

    async def _invoke(
        self, step: int, call: ToolCall, tool: Tool, args: BaseModel, *, index: int, key: str
    ) -> ToolCallRecord:
        """Run the call; whatever the tool raises is its observation, except what ends the run
        (a dead sandbox, a stop). Durable runs record its start before and its workspace after."""
        state, agent = self.state, self.agent
        self._emit(ToolCalled(run_id=state.run_id, step=step, call=call, tool=tool, idempotency_key=key))
        durable = self._durable
        if durable is not None:  # before it runs: a resume must know it may have had effects
            await off_loop(durable.call_started, state.run_id, step, call, key, idempotent=tool.idempotent)
        ctx = ToolContext(
            sandbox=self.sandbox,
            run_id=state.run_id,
            step=step,
            call_id=call.id,
            call_index=index,
            max_observation_chars=agent.limits.max_observation_chars,
            bookkeeping=self.bookkeeping,
            deadline=self._wall_deadline(),
            baseline=state.baseline,
        )
        started = time.perf_counter()
        value: object = None
        error_type: str | None = None
        try:
            value = await agent.tools.call(ctx, tool, args)
            text = render(value)
        except SandboxCrashed as err:
            # The run ends; the call's record says how the sandbox died and what it printed.
            crashed = ToolCallRecord(
                call=call,
                idempotency_key=key,
                observation=bound(ctx, f"error: SandboxCrashed: {err.report()}").text,
                is_error=True,
                failed=True,
                error_type="SandboxCrashed",
                duration_s=time.perf_counter() - started,
            )
            self._emit(ToolReturned(run_id=state.run_id, step=step, record=crashed, value=None))
            raise
        except (ApprovalRequired, LimitWait):
            # The call stopped before the action it asks about (an op guard's, or the tool's own
            # question), or before it ran at all (its window is full: the run waits off its
            # worker): it runs again on resume, guards and all, so the decision is applied.
            if durable is not None:
                await off_loop(durable.call_parked, state.run_id, key)
            raise
        except _FATAL:  # the run cannot go on (RunStopped passes too: it is no Exception)
            raise
        except StockadeError as err:
            text, error_type = f"error: {type(err).__name__}: {err}", type(err).__name__
        except Exception as err:  # a tool's own failure is information for the model, not a crash
            text, error_type = f"error: {type(err).__name__}: {err}", type(err).__name__
        duration = time.perf_counter() - started
        shown = (
            await off_loop(bound, ctx, text) if len(text) > ctx.max_observation_chars else bound(ctx, text)
        )
        record = ToolCallRecord(
            call=call,
            idempotency_key=key,
            observation=shown.text,
            is_error=error_type is not None,
            failed=error_type is not None or reported_failure(value),
            error_type=error_type,
            duration_s=duration,
            cut_chars=shown.cut_chars,
            saved_to=shown.saved_to,
            exit_code=_exit_code(value),
        )
        if durable is not None:  # the call and the workspace it left, kept together
            try:
                await off_loop(durable.record_workspace, state.run_id, self.bookkeeping, call=(step, record))
            except _FATAL:
                raise
            except StockadeError as err:
                # The call ran; only the workspace it left cannot be kept (over the store's caps,
                # say). It is recorded all the same (ToolReturned: the ledger and the trail) and
                # the run ends on it: a resume would restore a workspace from before the call.
                record = self._unkept(record, err)
                return self._returned(step, record, value)
        keeper = agent.keeper
        if keeper is not None and keeper.each_call:  # after the ledger: they agree on the files
            kept = await off_loop(keeper.keep, state.run_id, self.bookkeeping)
            state.snapshot = kept or state.snapshot
        return self._returned(step, record, value)

    def _returned(self, step: int, record: ToolCallRecord, value: object) -> ToolCallRecord:
        self._emit(ToolReturned(run_id=self.state.run_id, step=step, record=record, value=value))
        return record

    def _unkept(self, record: ToolCallRecord, err: StockadeError) -> ToolCallRecord:
        """``record`` of a call whose workspace the run store could not keep, which ends the run."""
        why = f"{type(err).__name__}: {err}"
        self._finish(
            RunStatus.ERROR,
            error=f"{record.call.name} ran, and the workspace it left cannot be kept ({why})",
        )
        ending = f"[the run ends here: the workspace this call left cannot be kept: {why}]"
        said = clip(ending, 2_000).text  # the call's own observation is bounded already
        return record.model_copy(update={"observation": f"{record.observation}\n\n{said}"})


def _exit_code(value: object) -> int | None:
    """The exit code a tool's result carries (``Ran``, ``TestReport``), if any."""
    code = getattr(value, "exit_code", None)
    return code if isinstance(code, int) and not isinstance(code, bool) else None
