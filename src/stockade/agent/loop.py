"""The agent loop: explicit nodes over a serialisable ``RunState``.

    prompt -> model_request -> call_tools -> model_request -> ... -> end
                                 └─ (final answer, with an acceptance check) -> check -> end, or
                                    back to model_request with the check's result

``state.next`` names the node to run; each node reads and updates the state, and the state
is checkpointed after it. Step through a run with ``agent.iter()``:

    async with agent.iter("fix the failing test", sandbox=sbx) as run:
        async for node in run:        # ModelRequestNode, CallToolsNode, ..., End (each after it ran)
            print(node)
    print(run.result.status, run.result.diff)

or run it whole with ``await agent.run(...)`` / ``agent.run_sync(...)``. Resume a run,
here or in another process, with ``resume=run_id`` (loaded from the checkpointer) or
``resume=state``.

Extension points (other layers plug in here without editing the loop):

- ``observers``: callables receiving every ``AgentEvent`` (see ``events``);
- ``guards``: a pipeline of plain callables ``guard(ctx: GuardContext, call: ToolCall) -> ToolCall``
  run before each tool call; a guard may rewrite the call or raise ``PolicyDenied``, which goes
  back to the model as an observation (``max_denials`` in a row end the run as "denied"), or
  ``ApprovalRequired``, which pauses the run (status "paused", state checkpointed); resuming it
  runs the guards on that call again, so the approval layer answers from its decision;
- ``model``'s tool calls are screened before anything keeps them (``screen``): a call no record
  can hold (a name that is no identifier, arguments too large, too deep or not Unicode) is
  refused as ``InvalidToolCall``, and what the loop says of a refusal or a denial is bounded
  like a tool's output (``max_observation_chars``);
- ``tools``: a ``Toolset``, wrapped with ``Toolset.wrapped`` for per-call behaviour;
- ``model``: any ``Model``, wrapped with ``WrapperModel`` subclasses (retries, spend limits);
- ``checkpointer``: any ``Checkpointer`` (run stores); a ``DurableCheckpointer`` (a run store)
  also owns the run while it runs (a lease: another process cannot run it at the same time),
  keeps each call's start and the workspace after each call, and restores that workspace
  on resume (see "Durable runs" below);
- ``bookkeeping=``: the sandbox the run keeps its own records through (the baseline and the
  diff, saved outputs, test reports), when ``sandbox`` is policy-guarded: the model's path
  rules are about the model's actions, not the run's records. The default is ``sandbox``.

``check=`` is the run's acceptance check, a command run in the sandbox when the model says it is
done: the run ends "success" only when it passes; when it fails, the model is told the result
and goes on within its budget, and the run ends "check_failed" if it never passes.

Durable runs. With a ``DurableCheckpointer``, a run survives its process (SIGKILL, a lost
machine): resume it by id, in any process that reaches the store, with a fresh sandbox.
What it promises, per tool kind:

- a call that returned is never run again (the ledger has it, with the workspace it left);
  when the store cannot keep that workspace (``SeedTooLarge``), the call is recorded without
  it (the ledger, the trail, the model's observation) and the run ends "error" on it;
- a call that started and did not return is run again if its tool is ``idempotent``; if not,
  it is not run again: the model is told its outcome is unknown (``OutcomeUnknown``), and the
  run store and the audit trail say so. Tools get ``ctx.idempotency_key`` (the same on every
  attempt) to deduplicate effects outside the sandbox;
- a call that stopped at an approval (``ApprovalRequired`` from inside it: the sandbox's op
  guard, or the tool asking) did not do what it asked about: it is run again on resume, from
  the workspace before it, so a tool asks before its effects, not after;
- the workspace continues from the last call that returned, the diff's baseline included;
  processes and ``run_code`` variables do not survive (the sandbox is new), unless a
  ``keeper`` kept the sandbox (a snapshot, with its memory where the tier can) when the run
  paused or after its last call, and the session started the new sandbox from it (see
  ``stockade.runs.snapshots``).

Anything in a step that raises ``RunStopped`` (control flow, not an error: a budget, the kill
switch, an approval to wait for) ends the run with that exception's status. Whatever a tool
raises is an observation for the model (``ToolError``, ``WorkspaceError``, a tool's own bug
alike), except a dead sandbox (``SandboxCrashed``, ``SandboxClosed``, ``ProtocolError``): that
ends the run with status "error", as any other ``StockadeError`` does (a provider failure, a
failing store), and a ``PolicyDenied`` of the model call ends it "denied". An exception of
any other type out of the acceptance check ends the run "error" too (it reads what code in
the sandbox wrote). Anything else, raised outside a tool and the check (an observer's, a
model adapter's or a checkpointer's bug), propagates; the last checkpoint stays resumable.

Where it is: ``Agent`` (here) starts and resumes runs; ``AgentRun`` (``run``) drives one, its
tool calls in ``_tool_calls`` and what every node shares in ``_run_upkeep``; ``settings`` has
what an agent is made of (guards included), ``limits`` its budgets, ``nodes`` what a run gives
back.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from stockade._checks import check_text
from stockade._threads import off_loop
from stockade.agent.checkpoint import Lease
from stockade.agent.limits import MAX_CALL_ARGS_BYTES, RunLimits
from stockade.agent.nodes import CallToolsNode, CheckNode, End, ModelRequestNode, Node, RunResult
from stockade.agent.run import AgentRun
from stockade.agent.settings import DEFAULT_SYSTEM_PROMPT, AgentSettings, Guard, GuardContext
from stockade.agent.state import RunState, RunStatus
from stockade.exceptions import ConfigurationError, RunConflict
from stockade.models.messages import UserMessage
from stockade.sandbox.facade import Sandbox
from stockade.tools.workspace_diff import record_baseline

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "MAX_CALL_ARGS_BYTES",
    "Agent",
    "AgentRun",
    "CallToolsNode",
    "CheckNode",
    "End",
    "Guard",
    "GuardContext",
    "ModelRequestNode",
    "Node",
    "RunLimits",
    "RunResult",
]


class Agent(AgentSettings):
    """An LLM driving narrow tools over one sandbox, within limits."""

    @asynccontextmanager
    async def iter(
        self,
        task: str | None = None,
        *,
        sandbox: Sandbox,
        resume: str | RunState | None = None,
        run_id: str | None = None,
        bookkeeping: Sandbox | None = None,
    ) -> AsyncIterator[AgentRun]:
        """Start (or resume) a run and hand it over for stepping."""
        books = bookkeeping if bookkeeping is not None else sandbox
        held: list[Lease] = []  # the run's lease, once claimed (a DurableCheckpointer's)
        try:
            if resume is None:
                run = await self._start(task, run_id, sandbox, books, held)
            else:
                run = await self._resume(resume, sandbox, books, held)
            yield run
        finally:
            for lease in held:
                await off_loop(lease.release)

    async def _start(
        self, task: str | None, run_id: str | None, sandbox: Sandbox, books: Sandbox, held: list[Lease]
    ) -> AgentRun:
        if task is None:
            raise ConfigurationError("give a task, or resume=RUN_ID to continue a run")
        check_text(task, argument="task", nul=True)  # a lone surrogate: no model can be sent it
        state = RunState(
            run_id=run_id or uuid.uuid4().hex,
            task=task,
            system=self.system_prompt,
            model_name=self.model.name,
            messages=[UserMessage(content=task)],
        )
        durable = self._durable
        if durable is not None:  # RunConflict if the store has the id
            held.append(await off_loop(durable.claim, state.run_id, new=True))
        elif run_id is not None and self.checkpointer is not None and self.checkpointer.load(run_id):
            raise RunConflict(f"a run {run_id!r} is already checkpointed: give a new run an id of its own")
        state.baseline = await off_loop(record_baseline, books)
        if durable is not None:
            await off_loop(durable.record_workspace, state.run_id, books)
        run = AgentRun(self, state, sandbox, bookkeeping=books)
        await run.begin(resumed=False)
        return run

    async def _resume(
        self, resume: str | RunState, sandbox: Sandbox, books: Sandbox, held: list[Lease]
    ) -> AgentRun:
        durable = self._durable
        if durable is not None:  # own the run before reading it: its state is then final
            rid = resume.run_id if isinstance(resume, RunState) else resume
            held.append(await off_loop(durable.claim, rid, new=False))
        state = self._load(resume)
        if held and held[0].recovered:  # the dead process's time after its last checkpoint was spent
            state.elapsed_s += held[0].unsaved_s
        if state.status.finished:
            raise RunConflict(
                f"run {state.run_id} ended ({state.status.value}); a run that ended is kept as "
                "it is and never resumed: start a new run"
            )
        previous = state.status
        restored = durable is not None and await off_loop(durable.restore_workspace, state.run_id, books)
        if self.keeper is not None:
            # The sandbox started from what was kept (or is the one it was taken of): the run goes
            # on from here, and a later crash must not bring back memory older than its workspace.
            await off_loop(self.keeper.release, state.run_id)
            state.snapshot = None
        # paused or interrupted: the node it stopped in runs again; crashed: where it was
        state.status, state.next, state.resume_at, state.error = (
            RunStatus.RUNNING,
            state.resume_at or state.next,
            None,
            None,
        )
        run = AgentRun(self, state, sandbox, bookkeeping=books)
        recovered = held[0].recovered if held else previous == RunStatus.RUNNING
        await run.begin(resumed=True, previous=previous, recovered=recovered, restored=restored)
        return run

    def _load(self, resume: str | RunState) -> RunState:
        if isinstance(resume, RunState):
            return resume
        if self.checkpointer is None:
            raise ConfigurationError("resume by run id needs Agent(checkpointer=...)")
        state = self.checkpointer.load(resume)
        if state is None:
            raise ConfigurationError(f"no checkpoint for run {resume!r}")
        return state

    async def run(
        self,
        task: str | None = None,
        *,
        sandbox: Sandbox,
        resume: str | RunState | None = None,
        run_id: str | None = None,
        bookkeeping: Sandbox | None = None,
    ) -> RunResult:
        async with self.iter(
            task, sandbox=sandbox, resume=resume, run_id=run_id, bookkeeping=bookkeeping
        ) as run:
            async for _ in run:
                pass
        assert run.result is not None
        return run.result

    def run_sync(
        self,
        task: str | None = None,
        *,
        sandbox: Sandbox,
        resume: str | RunState | None = None,
        run_id: str | None = None,
        bookkeeping: Sandbox | None = None,
    ) -> RunResult:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(
                self.run(task, sandbox=sandbox, resume=resume, run_id=run_id, bookkeeping=bookkeeping)
            )
        raise ConfigurationError("run_sync() inside a running event loop: use `await agent.run(...)`")
