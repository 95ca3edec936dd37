"""The agent loop over the shipped fakes: steps, limits, hooks, guards, and how runs end."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from stockade import Sandbox
from stockade.agent import (
    Agent,
    AgentEvent,
    CallToolsNode,
    End,
    GuardContext,
    ModelDenied,
    ModelRequestNode,
    ModelResponded,
    RunFinished,
    RunLimits,
    RunStarted,
    RunState,
    RunStatus,
    StepFinished,
    ToolCalled,
    ToolDenied,
    ToolReturned,
)
from stockade.exceptions import (
    BudgetExceeded,
    ModelRateLimited,
    PolicyDenied,
    RunKilled,
    SandboxCrashed,
    ToolTimeout,
)
from stockade.models import FunctionModel, Model, ModelRequest, ModelResponse, ToolCall, Usage
from stockade.runtime.agent import RuntimeControls
from stockade.runtime.killswitch import KillSwitch
from stockade.sandbox.ops import RunCommand
from stockade.testing import FakeBackend, MemoryWorkspace, ScriptedModel, tool_call
from stockade.tools import ToolContext, Toolset, default_toolset, shell, tool
from stockade.tools.deadline import checkpoint
from stockade.types import CommandResult

FIX = "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"


@pytest.fixture
def sbx() -> Sandbox:
    sandbox = Sandbox.create(backend=FakeBackend())
    sandbox.files.write("calc.py", "def add(a, b):\n    return a - b\n")
    return sandbox


def test_a_scripted_run_reads_patches_and_finishes_with_the_diff(sbx: Sandbox) -> None:
    events: list[AgentEvent] = []
    model = ScriptedModel(
        [
            tool_call("read_file", {"path": "calc.py"}),
            tool_call("apply_patch", {"diff": FIX}),
            "add() now adds.",
        ]
    )
    result = Agent(model, observers=[events.append]).run_sync("fix add()", sandbox=sbx)

    assert result.status == RunStatus.SUCCESS and result.ok
    assert result.answer == "add() now adds."
    assert [len(s.tool_calls) for s in result.steps] == [1, 1, 0]
    assert "1  def add(a, b):" in result.steps[0].tool_calls[0].observation
    assert result.diff.endswith("-    return a - b\n+    return a + b\n")
    assert result.usage.requests == 3 and result.usage.total_tokens > 0
    assert result.audit_id is None  # set by the audit layer when it is plugged in
    assert [type(e).__name__ for e in events] == [
        "RunStarted",
        *["ModelRequested", "ModelResponded", "ToolCalled", "ToolReturned", "StepFinished"] * 2,
        "ModelRequested",
        "ModelResponded",
        "StepFinished",
        "RunFinished",
    ]


async def test_iter_steps_node_by_node(sbx: Sandbox) -> None:
    model = ScriptedModel([tool_call("list_files"), "done"])
    nodes = []
    async with Agent(model).iter("look around", sandbox=sbx) as run:
        async for node in run:
            nodes.append(node)
            assert run.state.next.value in ("model_request", "call_tools", "end")
    assert [type(n) for n in nodes] == [ModelRequestNode, CallToolsNode, ModelRequestNode, End]
    assert isinstance(nodes[2], ModelRequestNode) and nodes[2].response.text == "done"
    assert isinstance(nodes[1], CallToolsNode) and nodes[1].records[0].observation == "calc.py  (32 bytes)"
    assert run.result is not None and run.result.status == RunStatus.SUCCESS


def test_tool_errors_go_back_to_the_model_as_observations(sbx: Sandbox) -> None:
    model = ScriptedModel([tool_call("read_file", {"path": "missing.py"}), "gave up"])
    result = Agent(model).run_sync("read", sandbox=sbx)
    record = result.steps[0].tool_calls[0]
    assert record.is_error and record.error_type == "SandboxFileNotFound"
    assert record.observation.startswith("error: SandboxFileNotFound:")
    assert result.status == RunStatus.SUCCESS
    assert model.requests[1].messages[-1].content == record.observation  # type: ignore[union-attr]


def test_malformed_calls_get_a_correction_within_a_budget(sbx: Sandbox) -> None:
    bad = ToolCall(name="read_file", malformed="the arguments are not valid JSON")
    model = ScriptedModel(
        [bad, tool_call("read_file", {}), tool_call("rm_rf"), tool_call("read_file", {"x": 1})]
    )
    result = Agent(model, limits=RunLimits(max_malformed=3)).run_sync("go", sandbox=sbx)
    observations = [s.tool_calls[0].observation for s in result.steps]
    assert observations[0] == "error: malformed call to read_file: the arguments are not valid JSON"
    assert observations[1] == "error: invalid arguments for read_file: path: Field required"
    assert observations[2].startswith("error: there is no tool 'rm_rf'; the tools are: run_code, ")
    assert result.status == RunStatus.ERROR
    assert result.error is not None and result.error.startswith("too many malformed tool calls (4)")


def deny_writes(ctx: GuardContext, call: ToolCall) -> ToolCall:
    if call.name in ("write_file", "apply_patch"):
        raise PolicyDenied("the workspace is read-only in this run", rule="read-only")
    return call


def test_a_guard_denial_is_an_observation_not_a_crash(sbx: Sandbox) -> None:
    events: list[AgentEvent] = []
    model = ScriptedModel([tool_call("apply_patch", {"diff": FIX}), "could not write"])
    result = Agent(model, guards=[deny_writes], observers=[events.append]).run_sync("fix", sandbox=sbx)
    record = result.steps[0].tool_calls[0]
    assert record.denied and record.observation == (
        "denied by policy (rule read-only): the workspace is read-only in this run"
    )
    assert result.status == RunStatus.SUCCESS and result.diff == ""
    assert [e.rule for e in events if isinstance(e, ToolDenied)] == ["read-only"]
    assert not any(isinstance(e, ToolCalled) for e in events)  # the tool never ran


def test_denials_in_a_row_end_the_run_as_denied(sbx: Sandbox) -> None:
    model = ScriptedModel([tool_call("write_file", {"path": "a", "content": "x"})] * 3)
    result = Agent(model, guards=[deny_writes], limits=RunLimits(max_denials=3)).run_sync("go", sandbox=sbx)
    assert result.status == RunStatus.DENIED and len(result.steps) == 3


def test_a_guard_may_rewrite_the_call(sbx: Sandbox) -> None:
    def small_pages(ctx: GuardContext, call: ToolCall) -> ToolCall:
        assert ctx.tool.name == call.name and ctx.step == 1
        return (
            call.model_copy(update={"args": {**call.args, "limit": 1}}) if call.name == "read_file" else call
        )

    model = ScriptedModel([tool_call("read_file", {"path": "calc.py"}), "ok"])
    result = Agent(model, guards=[small_pages]).run_sync("read", sandbox=sbx)
    assert result.steps[0].tool_calls[0].observation.startswith("calc.py: lines 1-1 of 2")


def test_max_steps_ends_the_run(sbx: Sandbox) -> None:
    model = ScriptedModel([tool_call("list_files")] * 10)
    result = Agent(model, limits=RunLimits(max_steps=2)).run_sync("loop", sandbox=sbx)
    assert result.status == RunStatus.MAX_STEPS and len(result.steps) == 2


def test_the_token_budget_ends_the_run(sbx: Sandbox) -> None:
    def chatty(request: ModelRequest) -> ModelResponse:
        usage = Usage(input_tokens=600, output_tokens=10, requests=1)
        return ModelResponse(tool_calls=(tool_call("list_files"),), usage=usage)

    result = Agent(FunctionModel(chatty), limits=RunLimits(max_tokens=1000)).run_sync("go", sandbox=sbx)
    assert result.status == RunStatus.BUDGET and result.usage.total_tokens == 1220
    # the response that used them up asked for a call: it does not start
    assert result.error == "the run used its tokens (1000); 1 tool call(s) of step 2 not started"


def test_usage_a_model_reports_negative_is_refused_and_none_is_estimated(sbx: Sandbox) -> None:
    """Budgets are counted from reported usage: a negative count would cancel what was spent."""

    def refunds(request: ModelRequest) -> ModelResponse:
        usage = Usage(input_tokens=-30_000_000, output_tokens=5_000_000, requests=1)
        return ModelResponse(tool_calls=(tool_call("list_files"),), usage=usage)

    result = Agent(FunctionModel(refunds), limits=RunLimits(max_tokens=1000)).run_sync("go", sandbox=sbx)
    assert result.status == RunStatus.ERROR and not result.steps
    assert (result.error or "").startswith("ModelResponseInvalid: ") and "negative usage" in (
        result.error or ""
    )

    class Silent(Model):  # a provider that leaves usage out (requests=0: none reported)
        async def request(self, request: ModelRequest) -> ModelResponse:
            return ModelResponse(text="done")

    result = Agent(Silent()).run_sync("go", sandbox=sbx)
    assert result.ok and result.usage.requests == 1 and result.usage.input_tokens > 0


def test_wall_time_is_measured_with_an_injectable_clock(sbx: Sandbox) -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += 100.0  # every reading is 100 s later
        return now[0]

    model = ScriptedModel([tool_call("list_files")] * 10)
    result = Agent(model, clock=clock, limits=RunLimits(max_wall_s=250)).run_sync("go", sandbox=sbx)
    assert result.status == RunStatus.BUDGET
    assert result.error is not None and result.error.startswith("the run used its wall time (250 s)")


def test_no_tool_call_starts_once_the_wall_time_is_used_up(sbx: Sandbox) -> None:
    """One response may ask for many calls: the budget is checked before each, not only
    before the next model request."""
    now = [0.0]
    ran: list[int] = []

    @tool
    def work(n: int) -> str:
        """Work for 100 s.

        Args:
            n: which piece.
        """
        now[0] += 100.0
        ran.append(n)
        return "done"

    calls = [tool_call("work", {"n": n}, id=f"c{n}") for n in range(5)]
    agent = Agent(
        ScriptedModel([calls, "done"]),
        tools=Toolset([work]),
        clock=lambda: now[0],
        limits=RunLimits(max_wall_s=250),
    )
    result = agent.run_sync("go", sandbox=sbx)
    assert ran == [0, 1, 2]  # 300 s used when the fourth would start
    assert result.status == RunStatus.BUDGET and result.state.elapsed_s == 300.0
    assert result.error == "the run used its wall time (250 s); 2 tool call(s) of step 1 not started"
    assert [r.call.id for r in result.steps[0].tool_calls] == ["c0", "c1", "c2"]


def test_what_is_kept_between_the_calls_of_a_response_counts_their_time(sbx: Sandbox) -> None:
    """The node's time was added to elapsed_s only when it ended: a process killed between two
    calls of one response lost it, and a run killed and resumed again and again ran past
    max_wall_s. What is kept after each call counts the time so far."""
    from stockade.agent import MemoryCheckpointer

    now = [0.0]
    kept: list[float] = []

    class Watching(MemoryCheckpointer):
        def save(self, state: RunState) -> None:
            kept.append(state.elapsed_s)
            super().save(state)

    @tool
    def work(n: int) -> str:
        """Work for 100 s.

        Args:
            n: which piece.
        """
        now[0] += 100.0
        return "done"

    calls = [tool_call("work", {"n": n}, id=f"c{n}") for n in range(3)]
    agent = Agent(ScriptedModel([calls, "done"]), tools=Toolset([work]), clock=lambda: now[0],
                  checkpointer=Watching())  # fmt: skip
    result = agent.run_sync("go", sandbox=sbx, run_id="kept")
    assert kept[:5] == [0.0, 0.0, 100.0, 200.0, 300.0]  # start, answer, calls 1 and 2, the node
    assert result.state.elapsed_s == 300.0  # counted once: the node's end adds it as before


def test_dollar_costs_come_from_the_price_table(sbx: Sandbox) -> None:
    def pricey(request: ModelRequest) -> ModelResponse:
        usage = Usage(input_tokens=1_000_000, output_tokens=0, requests=1)
        return ModelResponse(
            tool_calls=(tool_call("list_files"),), usage=usage, model_name="gpt-4.1-2025-04-14"
        )

    agent = Agent(FunctionModel(pricey), limits=RunLimits(max_cost_usd=5.0, max_tokens=10**9))
    result = agent.run_sync("go", sandbox=sbx)
    assert result.status == RunStatus.BUDGET and result.cost_usd == pytest.approx(6.0)


@pytest.mark.parametrize(
    ("error", "status"),
    [(RunKilled("stop now", run_id="r"), RunStatus.KILLED), (BudgetExceeded("$ spent"), RunStatus.BUDGET)],
)
def test_an_observer_can_stop_the_run(sbx: Sandbox, error: Exception, status: RunStatus) -> None:
    def stopper(event: AgentEvent) -> None:
        if isinstance(event, ToolCalled):
            raise error

    model = ScriptedModel([tool_call("list_files"), "never"])
    result = Agent(model, observers=[stopper]).run_sync("go", sandbox=sbx)
    assert result.status == status and result.error is not None and str(error) in result.error
    assert len(result.steps) == 1  # the interrupted step is kept


def test_provider_errors_end_the_run_as_error(sbx: Sandbox) -> None:
    def limited(request: ModelRequest) -> ModelResponse:
        raise ModelRateLimited("slow down", provider="test", status_code=429, retry_after=2.0)

    result = Agent(FunctionModel(limited)).run_sync("go", sandbox=sbx)
    assert result.status == RunStatus.ERROR and result.error == "ModelRateLimited: slow down"


def test_a_model_request_the_policy_refuses_is_an_event_then_ends_the_run_as_denied(sbx: Sandbox) -> None:
    def refused(request: ModelRequest) -> ModelResponse:
        raise PolicyDenied("model 'x' is not approved", rule="models.approved", action="model x")

    seen: list[AgentEvent] = []
    result = Agent(FunctionModel(refused, name="x"), observers=[seen.append]).run_sync("go", sandbox=sbx)
    assert result.status == RunStatus.DENIED
    denied = [e for e in seen if isinstance(e, ModelDenied)]
    assert denied == [
        ModelDenied(
            run_id=result.run_id,
            step=1,
            model_name="x",
            reason="model 'x' is not approved",
            rule="models.approved",
        )
    ]


def test_a_dead_sandbox_ends_the_run_as_error() -> None:
    @tool
    def crash(ctx: ToolContext) -> str:
        """Crash the sandbox."""
        raise SandboxCrashed("the supervisor died")

    sandbox = Sandbox.create(backend=FakeBackend())
    model = ScriptedModel([tool_call("crash"), "never"])
    result = Agent(model, tools=default_toolset().including(crash)).run_sync("go", sandbox=sandbox)
    assert result.status == RunStatus.ERROR and result.error == "SandboxCrashed: the supervisor died"


def test_a_crashed_call_is_recorded_with_its_cause_and_output_before_the_run_ends() -> None:
    @tool
    def crash(ctx: ToolContext) -> str:
        """Crash the sandbox."""
        raise SandboxCrashed("sandbox is gone", cause="out_of_memory", stdout="step 1 done\nstep 2")

    events: list[AgentEvent] = []
    model = ScriptedModel([tool_call("crash"), "never"])
    agent = Agent(model, tools=default_toolset().including(crash), observers=[events.append])
    result = agent.run_sync("go", sandbox=Sandbox.create(backend=FakeBackend()))
    assert result.status == RunStatus.ERROR
    (returned,) = [e for e in events if isinstance(e, ToolReturned)]
    assert returned.record.error_type == "SandboxCrashed" and returned.record.is_error
    assert "cause: out_of_memory" in returned.record.observation
    assert "step 1 done\nstep 2" in returned.record.observation


def test_long_observations_are_bounded_and_saved_for_paging(sbx: Sandbox) -> None:
    sbx.files.write("big.txt", "x" * 50_000)
    model = ScriptedModel([tool_call("read_file", {"path": "big.txt"}), "ok"])
    result = Agent(model, limits=RunLimits(max_observation_chars=2000)).run_sync("go", sandbox=sbx)
    record = result.steps[0].tool_calls[0]
    assert record.saved_to == ".stockade/outputs/1-call_0_0.txt" and record.cut_chars > 45_000
    assert len(record.observation) < 2200
    assert sbx.files.read(record.saved_to).endswith("x" * 100)


def test_every_event_is_a_frozen_value(sbx: Sandbox) -> None:
    events: list[AgentEvent] = []
    Agent(ScriptedModel([tool_call("list_files"), "ok"]), observers=[events.append]).run_sync(
        "go", sandbox=sbx
    )
    kinds: tuple[type, ...] = (RunStarted, ModelResponded, ToolReturned, StepFinished, RunFinished)
    sample = next(e for e in events if isinstance(e, kinds))
    with pytest.raises(AttributeError):
        sample.run_id = "other"  # type: ignore[misc]


def test_run_sync_refuses_to_nest_in_a_running_loop(sbx: Sandbox) -> None:
    import asyncio

    from stockade.exceptions import ConfigurationError

    async def inside() -> None:
        with pytest.raises(ConfigurationError, match=r"await agent\.run"):
            Agent(ScriptedModel(["ok"])).run_sync("go", sandbox=sbx)

    asyncio.run(inside())


def test_a_tool_past_its_timeout_is_stopped_and_the_model_is_told(sbx: Sandbox) -> None:
    @tool(timeout_s=0.05)
    async def hang(ctx: ToolContext) -> str:
        """Wait for something that never comes."""
        await asyncio.Event().wait()
        return "never"

    model = ScriptedModel([tool_call("hang"), "gave up"])
    result = Agent(model, tools=Toolset([hang])).run_sync("go", sandbox=sbx)
    record = result.steps[0].tool_calls[0]
    assert result.status == RunStatus.SUCCESS  # a timeout is an observation, not the end of the run
    assert record.is_error and record.error_type == "ToolTimeout"
    assert record.observation.startswith("error: ToolTimeout: hang did not finish within its 0.05 s timeout")


def test_a_tools_sandbox_commands_are_bounded_by_its_timeout() -> None:
    asked: list[float | None] = []

    def commands(op: RunCommand) -> CommandResult:
        asked.append(op.timeout_s)
        return CommandResult(exit_code=0, stdout="built", stderr="", duration_s=0.0)

    @tool(timeout_s=30)
    def build(ctx: ToolContext, timeout_s: float | None = None) -> str:
        """Build the project."""
        return ctx.sandbox.commands.run("make", timeout_s=timeout_s).stdout

    sandbox = Sandbox.create(backend=FakeBackend(MemoryWorkspace(commands=commands)))
    calls = [tool_call("build"), tool_call("build", {"timeout_s": 600}), tool_call("build", {"timeout_s": 2})]
    Agent(ScriptedModel([*calls, "ok"]), tools=Toolset([build])).run_sync("go", sandbox=sandbox)
    assert len(asked) == 3
    assert all(t is not None and 0 < t <= 30 for t in asked[:2])  # the tool's deadline caps them
    assert asked[2] == 2  # a shorter limit is kept


def test_a_commands_timeout_is_bounded_by_what_is_left_of_the_runs_wall_time() -> None:
    """The model picks a command's timeout (up to days): a call in flight ran on past
    max_wall_s (5 s of wall time, a test run of 45 s). Each command gets at most what is left."""
    asked: list[float | None] = []

    def commands(op: RunCommand) -> CommandResult:
        asked.append(op.timeout_s)
        return CommandResult(exit_code=0, stdout="", stderr="", duration_s=0.0)

    sandbox = Sandbox.create(backend=FakeBackend(MemoryWorkspace(commands=commands)))
    calls = [
        tool_call("run_tests", {"command": "sleep 45", "timeout_s": 45}),
        tool_call("run_tests", {"command": "ls"}),
    ]
    Agent(ScriptedModel([*calls, "ok"]), limits=RunLimits(max_wall_s=5)).run_sync("go", sandbox=sandbox)
    assert len(asked) == 2 and all(t is not None and 0 < t <= 5 for t in asked)


def test_a_model_that_does_not_answer_is_cut_where_the_runs_wall_time_ends(sbx: Sandbox) -> None:
    """max_wall_s bounds the run, the model's requests included: a stalled stream, or retries
    backing off for minutes, ran on past it (a 0.5 s run waited 20 s here, then succeeded)."""

    async def stalled(request: ModelRequest) -> ModelResponse:
        await asyncio.sleep(20)
        return ModelResponse(text="done at last")

    result = Agent(FunctionModel(stalled), limits=RunLimits(max_wall_s=0.5)).run_sync("go", sandbox=sbx)
    assert result.status == RunStatus.BUDGET
    assert result.error == "the run used its wall time (0.5 s) waiting for the model"
    assert 0.5 <= result.state.elapsed_s < 10


def test_the_acceptance_check_runs_within_what_is_left_of_the_wall_time() -> None:
    """A check of its own timeout (10 minutes by default) ran on past max_wall_s; cut there,
    it decided nothing: the run ends on its budget, not as a failed check."""
    asked: list[float | None] = []

    def commands(op: RunCommand) -> CommandResult:
        asked.append(op.timeout_s)
        return CommandResult(exit_code=124, stdout="", stderr="", duration_s=5.0, timed_out=True)

    sandbox = Sandbox.create(backend=FakeBackend(MemoryWorkspace(commands=commands)))
    limits = RunLimits(max_wall_s=5)
    agent = Agent(ScriptedModel(["done"]), check="pytest -q", check_timeout_s=600, limits=limits)
    result = agent.run_sync("go", sandbox=sandbox)
    assert len(asked) == 1 and asked[0] is not None and 0 < asked[0] <= 5
    assert result.status == RunStatus.BUDGET
    assert result.error == "the run used its wall time (5 s) in the acceptance check"


def test_nothing_a_timed_out_tool_asks_afterwards_reaches_the_sandbox(sbx: Sandbox) -> None:
    gate, finished = threading.Event(), threading.Event()
    refused: list[str] = []

    @tool(timeout_s=0.05)
    def slow_write(ctx: ToolContext) -> str:
        """Block, then write (a blocking tool's thread outlives its cancellation)."""
        gate.wait(10)
        try:
            ctx.sandbox.files.write("late.txt", "too late")
        except ToolTimeout as err:
            refused.append(str(err))
        finally:
            finished.set()
        return "written"

    def release_after_the_timeout(event: AgentEvent) -> None:
        if isinstance(event, ToolReturned):
            assert event.record.error_type == "ToolTimeout"
            gate.set()  # the cancelled call's thread goes on now, past its deadline

    model = ScriptedModel([tool_call("slow_write"), "ok"])
    agent = Agent(model, tools=Toolset([slow_write]), observers=[release_after_the_timeout])
    result = agent.run_sync("go", sandbox=sbx)
    assert result.steps[0].tool_calls[0].error_type == "ToolTimeout"
    assert finished.wait(10)
    assert not sbx.files.exists("late.txt")
    assert refused and "WriteFile was not started" in refused[0]


def test_a_command_tools_exit_code_is_recorded_not_parsed() -> None:
    def commands(op: RunCommand) -> CommandResult:
        return CommandResult(exit_code=3, stdout="", stderr="boom\n", duration_s=0.01)

    sandbox = Sandbox.create(backend=FakeBackend(MemoryWorkspace(commands=commands)))
    model = ScriptedModel([tool_call("shell", {"command": "make"}), "it failed"])
    result = Agent(model, tools=default_toolset().including(shell)).run_sync("build", sandbox=sandbox)
    [record] = result.steps[0].tool_calls
    assert record.exit_code == 3 and "exit code 3" in record.observation


def test_an_interrupted_run_keeps_its_step_in_progress_and_resumes_it() -> None:
    from stockade.agent import MemoryCheckpointer
    from stockade.exceptions import RunInterrupted

    sandbox = Sandbox.create(backend=FakeBackend())
    calls: list[ToolCalled] = []

    def stopper(event: AgentEvent) -> None:  # the first call is interrupted, as Ctrl-C would
        if isinstance(event, ToolCalled):
            calls.append(event)
            if len(calls) == 1:
                raise RunInterrupted("stopped by SIGINT", run_id="r")

    checkpoints = MemoryCheckpointer()
    model = ScriptedModel([tool_call("list_files"), "done"])
    agent = Agent(model, observers=[stopper], checkpointer=checkpoints)
    first = agent.run_sync("go", sandbox=sandbox, run_id="r")
    assert first.status == RunStatus.INTERRUPTED and first.status.resumable and not first.status.finished
    assert first.steps == () and first.state.current is not None  # the step in progress is kept
    again = agent.run_sync(sandbox=sandbox, resume="r")
    assert again.status == RunStatus.SUCCESS and again.answer == "done"
    assert [c.call.name for c in again.steps[0].tool_calls] == ["list_files"]  # the call ran, once


def _grinding(stopped: threading.Event) -> Toolset:
    @tool
    def grind(ctx: ToolContext) -> str:
        """Host-side work of hours (a thread no one can kill), checking in as built-in tools do."""
        try:
            while True:
                checkpoint()
                time.sleep(0.01)
        finally:
            stopped.set()

    return Toolset([grind])


def test_a_tools_long_host_work_ends_with_the_runs_wall_time(sbx: Sandbox) -> None:
    """A call's worker thread ran on after max_wall_s (asyncio stops waiting, the thread does
    not), and run_sync waited for it: hours for one apply_patch. It stops at its checkpoint."""
    stopped = threading.Event()
    started = time.monotonic()
    agent = Agent(
        ScriptedModel([tool_call("grind", {}), "done"]),
        tools=_grinding(stopped),
        limits=RunLimits(max_wall_s=1),
    )
    result = agent.run_sync("go", sandbox=sbx)
    assert time.monotonic() - started < 5 and stopped.is_set()
    assert result.status == RunStatus.BUDGET
    assert "ToolTimeout" in result.steps[0].tool_calls[0].observation


def test_a_tools_long_host_work_ends_when_the_run_is_killed(sbx: Sandbox) -> None:
    stopped = threading.Event()
    switch = KillSwitch("r-grind")
    controls = RuntimeControls(run_id="r-grind", kill_switch=switch)
    agent = Agent(
        ScriptedModel([tool_call("grind", {}), "done"]), tools=controls.wrap_tools(_grinding(stopped))
    )
    threading.Timer(0.5, switch.kill, args=("operator",)).start()
    started = time.monotonic()
    result = agent.run_sync("go", sandbox=controls.protect(sbx), run_id="r-grind")
    assert time.monotonic() - started < 5 and stopped.is_set()
    assert result.status == RunStatus.KILLED and "operator" in (result.error or "")
