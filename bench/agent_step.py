"""What the agent loop adds per step, on top of the model and the sandbox.

A step here is one model request answered with one ``read_file`` call, over the shipped
``FakeBackend`` (in-memory workspace) and a ``FunctionModel`` that answers at once. The raw
mechanism, measured in the same run, is the same model call plus the same tool call made
directly (in a worker thread, as the loop runs blocking tools). The difference is the
loop's own cost: state, events, guards, observation bounding, checkpoint.

    python bench/agent_step.py        # prints a markdown table
"""

from __future__ import annotations

import asyncio
import statistics
import time

from stockade import Sandbox
from stockade.agent import Agent, MemoryCheckpointer, RunLimits
from stockade.models import FunctionModel, ModelRequest, ModelResponse, ToolCall, Usage
from stockade.testing import FakeBackend
from stockade.tools import ToolContext, read_file

STEPS = 50
RUNS = 40
CALL = ToolCall(id="c", name="read_file", args={"path": "app.py"})
STEP_RESPONSE = ModelResponse(tool_calls=(CALL,), usage=Usage(input_tokens=10, output_tokens=5, requests=1))
DONE = ModelResponse(text="done", usage=Usage(input_tokens=10, output_tokens=1, requests=1))


def answer(request: ModelRequest) -> ModelResponse:
    return DONE if len(request.messages) >= 2 * STEPS + 1 else STEP_RESPONSE


def sandbox() -> Sandbox:
    sbx = Sandbox.create(backend=FakeBackend())
    sbx.files.write("app.py", "".join(f"line {i}\n" for i in range(40)))
    return sbx


async def raw_steps(sbx: Sandbox) -> float:
    """The model call and the tool call, nothing else."""
    model = FunctionModel(answer)
    request = ModelRequest(system="", messages=())
    ctx = ToolContext(sandbox=sbx)
    start = time.perf_counter()
    for _ in range(STEPS):
        await model.request(request)
        await read_file.invoke(ctx, read_file.validate(CALL.args))
    return (time.perf_counter() - start) / STEPS


async def loop_steps(sbx: Sandbox, checkpointer: MemoryCheckpointer | None) -> float:
    agent = Agent(FunctionModel(answer), checkpointer=checkpointer, limits=RunLimits(max_steps=STEPS + 5))
    start = time.perf_counter()
    result = await agent.run("bench", sandbox=sbx)
    elapsed = time.perf_counter() - start
    assert result.ok and len(result.steps) == STEPS + 1, result
    return elapsed / (STEPS + 1)


async def main() -> None:
    sbx = sandbox()
    raw, bare, checkpointed = [], [], []
    await loop_steps(sbx, None)  # warm up imports and caches
    for _ in range(RUNS):
        raw.append(await raw_steps(sbx))
        bare.append(await loop_steps(sbx, None))
        checkpointed.append(await loop_steps(sbx, MemoryCheckpointer()))
    r = statistics.median(raw)
    print(f"agent step overhead ({STEPS}-step runs, median of {RUNS}; FakeBackend, FunctionModel)\n")
    print("| what | per step | overhead vs raw | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| raw: model call + tool call | {r * 1e6:.0f} µs | — | 1.00x |")
    for name, samples in (("agent loop", bare), ("agent loop + MemoryCheckpointer (JSON)", checkpointed)):
        m = statistics.median(samples)
        print(f"| {name} | {m * 1e6:.0f} µs | {(m - r) * 1e6:.0f} µs | {m / r:.2f}x |")


if __name__ == "__main__":
    asyncio.run(main())
