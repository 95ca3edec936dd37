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
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from stockade._checks import MAX_COST_USD, check_instance, check_number, check_text, check_timeout
from stockade._cuts import cut_marker
from stockade._threads import off_loop
from stockade.agent.checkpoint import Checkpointer, DurableCheckpointer, Lease, SandboxKeeper
from stockade.agent.events import (
    AgentEvent,
    CheckFinished,
    ModelDenied,
    ModelRequested,
    ModelResponded,
    Observer,
    RunFinished,
    RunResumed,
    RunStarted,
    StepFinished,
    ToolCalled,
    ToolDenied,
    ToolRejected,
    ToolReturned,
)
from stockade.agent.screen import screened
from stockade.agent.state import (
    CheckRecord,
    NodeKind,
    RunState,
    RunStatus,
    StepRecord,
    ToolCallRecord,
)
from stockade.exceptions import (
    ApprovalRequired,
    ConfigurationError,
    InvalidArgument,
    InvalidToolCall,
    LimitWait,
    PolicyDenied,
    ProtocolError,
    RunConflict,
    RunInterrupted,
    RunStopped,
    SandboxClosed,
    SandboxCrashed,
    StockadeError,
    ToolError,
)
from stockade.models.base import Model, counted_usage, resolve_model
from stockade.models.messages import (
    AssistantMessage,
    ModelRequest,
    ModelResponse,
    ToolCall,
    ToolResultMessage,
    Usage,
    UserMessage,
)
from stockade.models.pricing import DEFAULT_PRICES, Price, cost_usd
from stockade.sandbox.facade import Sandbox
from stockade.tools.base import Tool, ToolContext, Toolset, idempotency_key, render, reported_failure
from stockade.tools.builtin import default_toolset, run_test_command
from stockade.tools.observations import bound, clip
from stockade.tools.workspace_diff import record_baseline, workspace_diff
from stockade.types import MAX_PENDING_APPROVALS

log = logging.getLogger(__name__)

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

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful software engineer working in a sandboxed workspace. Use the tools to "
    "inspect the code, change it and run its tests. Prefer small, precise edits (apply_patch with a "
    "unified diff). When the task is done, reply with a short summary and no tool call."
)

_FATAL = (SandboxCrashed, SandboxClosed, ProtocolError)
# The most a tool call's arguments may take (as JSON): a larger call is refused before it is
# validated, and its arguments are dropped before anything keeps them (the run's state, its
# checkpoints and ledger, the audit trail each kept a copy: 5 calls of 4 MB made a 126 MB
# trail). What it asked for stays provable: its size and SHA-256 are in the refusal.
MAX_CALL_ARGS_BYTES = 256 * 1024


@dataclass(frozen=True, kw_only=True)
class RunLimits:
    """Per-run budgets. Steps count model requests; wall time accumulates across resumes."""

    max_steps: int = 30
    max_wall_s: float = 900.0
    max_tokens: int = 1_000_000
    max_cost_usd: float | None = None
    max_malformed: int = 3  # corrective observations for malformed or unknown tool calls
    max_denials: int = 3  # policy denials in a row before the run ends as "denied"
    max_check_failures: int = 3  # failed acceptance checks before the run ends as "check_failed"
    max_observation_chars: int = 12_000
    max_call_args_bytes: int = MAX_CALL_ARGS_BYTES  # a larger call is refused, as a malformed one
    # requests kept pending at once; an action asked past them is refused, not kept (ApprovalsFull)
    max_pending_approvals: int = MAX_PENDING_APPROVALS

    def __post_init__(self) -> None:
        for name in (
            "max_steps",
            "max_tokens",
            "max_malformed",
            "max_denials",
            "max_check_failures",
            "max_observation_chars",
            "max_call_args_bytes",
            "max_pending_approvals",
        ):
            value = getattr(self, name)
            check_number(value, argument=f"RunLimits.{name}", integer=True, low=0, high=2**62)
        check_number(
            self.max_wall_s, argument="RunLimits.max_wall_s", integer=False, low=0, high=1e9, unit="seconds"
        )
        if self.max_cost_usd is not None:
            check_number(
                self.max_cost_usd, argument="RunLimits.max_cost_usd", integer=False, low=0, high=MAX_COST_USD
            )
        if (
            self.max_steps < 1
            or self.max_wall_s <= 0
            or self.max_tokens < 1
            or self.max_check_failures < 1
            or self.max_call_args_bytes < 1
        ):
            raise ConfigurationError(
                "RunLimits: max_steps, max_wall_s, max_tokens, max_check_failures and "
                "max_call_args_bytes must be positive"
            )


def _callables(value: object, *, argument: str) -> tuple[Callable[..., Any], ...]:
    """A list or tuple of functions (guards, observers), each checked now, not at its first call."""
    if not isinstance(value, list | tuple) or not all(callable(item) for item in value):
        raise InvalidArgument(
            f"{argument} must be a list of callables, got {type(value).__name__}",
            argument=argument,
            fix=f"give a list of functions, e.g. {argument}=[my_{argument[:-1]}]",
        )
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class GuardContext:
    """What a guard sees besides the call: the run, the step, the tool and the sandbox."""

    run_id: str
    step: int
    tool: Tool
    sandbox: Sandbox
    state: RunState  # read it, never change it


Guard = Callable[[GuardContext, ToolCall], ToolCall]


@dataclass(frozen=True, kw_only=True)
class RunResult:
    run_id: str
    status: RunStatus
    answer: str
    steps: tuple[StepRecord, ...]
    usage: Usage
    cost_usd: float
    diff: str
    audit_id: str | None
    error: str | None
    state: RunState
    tier: str | None = None  # the isolation tier the run's sandbox used

    @property
    def ok(self) -> bool:
        return self.status == RunStatus.SUCCESS

    @property
    def check(self) -> CheckRecord | None:
        """The last run of the acceptance check, if there was one."""
        return self.state.checks[-1] if self.state.checks else None


@dataclass(frozen=True, kw_only=True)
class ModelRequestNode:
    step: int
    response: ModelResponse
    duration_s: float


@dataclass(frozen=True, kw_only=True)
class CallToolsNode:
    step: int
    records: tuple[ToolCallRecord, ...]


@dataclass(frozen=True, kw_only=True)
class CheckNode:
    record: CheckRecord


@dataclass(frozen=True, kw_only=True)
class End:
    result: RunResult


Node = ModelRequestNode | CallToolsNode | CheckNode | End


class Agent:
    """An LLM driving narrow tools over one sandbox, within limits."""

    def __init__(
        self,
        model: str | Model,
        *,
        tools: Toolset | None = None,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        limits: RunLimits | None = None,
        guards: Sequence[Guard] = (),
        observers: Sequence[Observer] = (),
        checkpointer: Checkpointer | None = None,
        prices: Mapping[str, Price] = DEFAULT_PRICES,
        clock: Callable[[], float] = time.monotonic,
        check: str | None = None,
        check_timeout_s: float | None = None,
        keeper: SandboxKeeper | None = None,
        hands_back: Callable[[str], bool] | None = None,
    ) -> None:
        if check is not None and (not isinstance(check, str) or not check.strip()):
            raise InvalidArgument(
                f"check is {check!r}",
                argument="check",
                fix='give the command that decides whether the task is done, e.g. "python3 -m pytest -q"',
            )
        self.check = check
        self.hands_back = hands_back  # which changed paths the run's diff may show the host
        self.check_timeout_s = check_timeout(check_timeout_s, argument="check_timeout_s")
        self.model = resolve_model(model)
        if tools is not None:
            check_instance(tools, Toolset, argument="tools", fix="give Toolset([...]) or leave it out")
        if limits is not None:
            check_instance(limits, RunLimits, argument="limits", fix="give RunLimits(max_steps=...)")
        self.tools = tools if tools is not None else default_toolset()
        self.system_prompt = check_text(system_prompt, argument="system_prompt", nul=True)
        self.limits = limits or RunLimits()
        self.guards = _callables(guards, argument="guards")
        self.observers = _callables(observers, argument="observers")
        self.checkpointer = checkpointer
        self.prices = prices
        self.clock = clock
        self.keeper = keeper
        self._definitions = self.tools.definitions()

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

    @property
    def _durable(self) -> DurableCheckpointer | None:
        return self.checkpointer if isinstance(self.checkpointer, DurableCheckpointer) else None

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


class AgentRun:
    """One run in progress: ``state`` is live; ``result`` is set once it ends."""

    def __init__(
        self, agent: Agent, state: RunState, sandbox: Sandbox, *, bookkeeping: Sandbox | None = None
    ) -> None:
        self.agent = agent
        self.state = state
        self.sandbox = sandbox
        self.bookkeeping = bookkeeping if bookkeeping is not None else sandbox
        self.result: RunResult | None = None
        self._node_started = 0.0  # the clock when the running node started (its time is not in elapsed_s yet)

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

    def _over_budget(self, *, running: bool = False) -> tuple[RunStatus, str] | None:
        """The budget the run has used up, if any; ``running``: within a node, whose time so far
        counts (steps do not: they count model requests, checked before each)."""
        limits, state = self.agent.limits, self.state
        if not running and len(state.steps) >= limits.max_steps:
            return RunStatus.MAX_STEPS, f"the run reached max_steps={limits.max_steps}"
        elapsed = state.elapsed_s + (self.agent.clock() - self._node_started if running else 0.0)
        if elapsed >= limits.max_wall_s:
            return RunStatus.BUDGET, f"the run used its wall time ({limits.max_wall_s:g} s)"
        if state.usage.total_tokens >= limits.max_tokens:
            return RunStatus.BUDGET, f"the run used its tokens ({limits.max_tokens})"
        if limits.max_cost_usd is not None and state.cost_usd >= limits.max_cost_usd:
            return RunStatus.BUDGET, f"the run spent its budget (${limits.max_cost_usd:g})"
        return None

    def _wall_left(self) -> float:
        """The seconds left of the run's wall time, this node's so far counted."""
        spent = self.state.elapsed_s + self.agent.clock() - self._node_started
        return max(0.0, self.agent.limits.max_wall_s - spent)

    def _wall_deadline(self) -> float:
        """When the run's wall time ends, as a ``time.monotonic()`` reading: a tool call in
        flight is bounded by it (the model chooses a command's own timeout, up to days)."""
        return time.monotonic() + self._wall_left()

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

    # -- ending -------------------------------------------------------------------------

    def _finish(self, status: RunStatus, *, error: str | None = None) -> None:
        self.state.status = status
        # bounded as an observation is: it may quote what the model sent (a name, a path)
        self.state.error = (
            None if error is None else clip(error, self.agent.limits.max_observation_chars).text
        )
        self.state.next = NodeKind.END

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

    # -- plumbing -----------------------------------------------------------------------

    def _emit(self, event: AgentEvent) -> None:
        for observer in self.agent.observers:
            observer(event)

    @property
    def _durable(self) -> DurableCheckpointer | None:
        return self.agent._durable

    def _checkpoint(self, *, mid_node: bool = False) -> None:
        """``mid_node``: between the calls of a response; the time the node has taken so far is
        counted in what is kept (added to ``elapsed_s`` only when the node ends, it was lost
        with a process killed in it, and repeated kills ran past ``max_wall_s``)."""
        if self.agent.checkpointer is None:
            return
        if self.state.status.finished and self.result is None:
            # The node ended the run, and ``_end`` has not kept what it keeps yet (the diff, the
            # trail's last batch). A checkpoint saying "ended" now would outlive a crash before
            # them, and a run that ended is never resumed: its trail never reconciled. The last
            # checkpoint stays "running"; ``_end`` writes the one that says it ended.
            return
        state = self.state
        if mid_node:
            spent = state.elapsed_s + self.agent.clock() - self._node_started
            state = state.model_copy(update={"elapsed_s": spent})
        self.agent.checkpointer.save(state)


def _exit_code(value: object) -> int | None:
    """The exit code a tool's result carries (``Ran``, ``TestReport``), if any."""
    code = getattr(value, "exit_code", None)
    return code if isinstance(code, int) and not isinstance(code, bool) else None
