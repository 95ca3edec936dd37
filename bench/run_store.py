"""What a run store checkpoint costs, early and late in a long run.

One agent run of 200 steps (each: one model request answered with one ``read_file`` of a
40-line file, over the shipped ``FakeBackend``) saves its state after every node. Each save
is timed by a wrapping checkpointer, and the saves of steps 1-10 are compared with those of
steps 191-200. The raw mechanism, measured in the same run, is one single-row INSERT in its
own transaction on a database opened the same way: the floor of any durable write. For
contrast, ``JsonFileCheckpointer`` rewrites the whole state each time.

    python bench/run_store.py [--steps 200] [--repeat 3] [--postgres URL]   # prints a markdown table
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from stockade import Sandbox
from stockade.agent import Agent, Checkpointer, JsonFileCheckpointer, RunLimits, RunState
from stockade.models import FunctionModel, ModelRequest, ModelResponse, ToolCall, Usage
from stockade.runs import RunStore, open_run_store
from stockade.testing import FakeBackend

CALL = ToolCall(id="c", name="read_file", args={"path": "app.py"})
STEP = ModelResponse(tool_calls=(CALL,), usage=Usage(input_tokens=10, output_tokens=5, requests=1))
DONE = ModelResponse(text="done", usage=Usage(input_tokens=10, output_tokens=1, requests=1))
WINDOW = 10


class Timed:
    """A checkpointer that times each save of ``inner``, by the step the run is at."""

    def __init__(self, inner: Checkpointer) -> None:
        self.inner = inner
        self.by_step: dict[int, list[float]] = {}

    def save(self, state: RunState) -> None:
        start = time.perf_counter()
        self.inner.save(state)
        elapsed = time.perf_counter() - start
        self.by_step.setdefault(len(state.steps) + 1, []).append(elapsed)

    def load(self, run_id: str) -> RunState | None:
        return self.inner.load(run_id)

    def window(self, first: int, last: int) -> float:
        return statistics.median(t for step in range(first, last + 1) for t in self.by_step.get(step, []))


def run(checkpointer: Timed, steps: int) -> None:
    def answer(request: ModelRequest) -> ModelResponse:
        return DONE if len(request.messages) >= 2 * steps + 1 else STEP

    sbx = Sandbox.create(backend=FakeBackend())
    sbx.files.write("app.py", "".join(f"line {i}: some code here\n" for i in range(40)))
    agent = Agent(FunctionModel(answer), checkpointer=checkpointer, limits=RunLimits(max_steps=steps + 5))
    result = asyncio.run(agent.run("bench", sandbox=sbx, run_id=f"bench-{uuid.uuid4().hex[:8]}"))
    assert result.ok and len(result.steps) == steps + 1, result.status


def raw_insert(store: RunStore, repeats: int = 400) -> float:
    """One small row, one transaction: what any durable checkpoint costs at least."""
    table = f"{store.ns}_bench_raw"
    store.db.write([(f"CREATE TABLE IF NOT EXISTS {table} (k TEXT PRIMARY KEY, body TEXT NOT NULL)", [()])])
    body = "x" * 600  # about the size of a checkpoint row
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        store.db.write([(f"INSERT INTO {table} VALUES (?, ?)", [(uuid.uuid4().hex, body)])])
        times.append(time.perf_counter() - start)
    store.db.write([(f"DROP TABLE {table}", [()])])
    return statistics.median(times)


def measure(make: Callable[[], RunStore], steps: int) -> tuple[float, float, float]:
    """The raw INSERT, and the median save at the start and at the end of one run."""
    store = make()
    try:
        floor = raw_insert(store)
        timed = Timed(store)
        run(timed, steps)
    finally:
        store.close()
    return floor, timed.window(1, WINDOW), timed.window(steps - WINDOW + 1, steps)


def row(name: str, samples: list[tuple[float, float, float]]) -> str:
    floor, early, late = (statistics.median(s[i] for s in samples) for i in range(3))
    return (
        f"| {name} | {floor * 1e3:.3f} ms | {early * 1e3:.3f} ms ({early / floor:.2f}x) | "
        f"{late * 1e3:.3f} ms ({late / floor:.2f}x) | {late / early:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3, help="runs per checkpointer (medians are shown)")
    parser.add_argument("--postgres", help="also measure a PostgreSQL run store at this URL")
    args = parser.parse_args()
    steps: int = args.steps
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sqlite = [
            measure(lambda: open_run_store(f"sqlite:///{tmp}/audit.db"), steps) for _ in range(args.repeat)
        ]
        rows.append(row("RunStore, SQLite file", sqlite))
        if args.postgres:
            namespace = f"bench_{uuid.uuid4().hex[:8]}"
            postgres = [
                measure(lambda: open_run_store(args.postgres, namespace=namespace), steps)
                for _ in range(args.repeat)
            ]
            rows.append(row("RunStore, PostgreSQL (local)", postgres))
            import psycopg

            with psycopg.connect(args.postgres, autocommit=True) as conn:
                for table in (
                    "runs",
                    "checkpoints",
                    "messages",
                    "steps",
                    "tool_calls",
                    "retries",
                    "approvals",
                ):
                    conn.execute(f"DROP TABLE IF EXISTS {namespace}_{table}".encode())
        json_file = Timed(JsonFileCheckpointer(Path(tmp) / "json"))
        run(json_file, steps)
        early, late = json_file.window(1, WINDOW), json_file.window(steps - WINDOW + 1, steps)
        rows.append(
            f"| JsonFileCheckpointer (whole state) | - | {early * 1e3:.3f} ms | {late * 1e3:.3f} ms | "
            f"{late / early:.2f} |"
        )
    late_steps = f"{steps - WINDOW + 1}-{steps}"
    print(f"Checkpoint save cost, median of the saves at steps 1-{WINDOW} and {late_steps}\n")
    print(f"| checkpointer | raw INSERT (same run) | steps 1-{WINDOW} | steps {late_steps} | late/early |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
