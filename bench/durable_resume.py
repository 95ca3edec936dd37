"""What durability costs: bytes stored per step, time per tool call, and the time to resume.

A project of ``--files`` files (~2 KB of text each) is the seed of a run on the process tier
whose every step changes one file (``write_file``), ``--steps`` steps, with a ``RunStore``
(SQLite in a temporary folder, or ``--postgres URL``) as checkpointer. Measured:

- per step, the bytes the store added for the workspace (compressed contents and the rows
  naming what changed) and for the checkpoint and ledger (messages, steps, calls);
- per tool call, the time the store takes to record the workspace and the call (listing the
  workspace, reading what changed, one transaction), set against the call itself;
- resuming: the run is stopped halfway (an exception out of the loop, as a crash leaves it),
  then resumed in a new sandbox: the time to take the lease and load the state, and to put
  the workspace back, set against seeding a sandbox with the same folder (``upload_dir``,
  the raw mechanism).

    python bench/durable_resume.py [--files 200] [--steps 20] [--postgres URL]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from stockade import Sandbox
from stockade.agent import Agent, AgentEvent, RunLimits, ToolCalled, ToolReturned
from stockade.agent.state import ToolCallRecord
from stockade.models import FunctionModel, ModelRequest, ModelResponse, ToolCall, Usage
from stockade.models.messages import AssistantMessage
from stockade.runs import RunStore
from stockade.runs._db import Database, PostgresDatabase, SQLiteDatabase

TABLES = (
    "runs",
    "checkpoints",
    "messages",
    "steps",
    "tool_calls",
    "retries",
    "approvals",
    "seeds",
    "run_seeds",
    "leases",
    "calls_started",
    "blobs",
    "workspace",
)


class Stop(Exception):
    """Out of the loop at a chosen step, as a crash would leave the run."""


class TimedStore(RunStore):
    """Times each record of the workspace and the call that changed it."""

    def __init__(self, db: Database, namespace: str) -> None:
        super().__init__(db, namespace=namespace)
        self.record_s: list[float] = []

    def record_workspace(
        self, run_id: str, sandbox: Sandbox, *, call: tuple[int, ToolCallRecord] | None = None
    ) -> int:
        started = time.perf_counter()
        try:
            return super().record_workspace(run_id, sandbox, call=call)
        finally:
            if call is not None:  # the first record, of the seed, is not a step's
                self.record_s.append(time.perf_counter() - started)


def text(n: int, version: int) -> str:
    return "".join(f"line {i} of file {n}, version {version}: {'x' * 40}\n" for i in range(30))


def make_project(root: Path, files: int) -> None:
    for n in range(files):
        path = root / f"pkg{n % 10}" / f"mod{n}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text(n, 0))


def model(files: int, steps: int) -> FunctionModel:
    def answer(request: ModelRequest) -> ModelResponse:
        step = sum(1 for m in request.messages if isinstance(m, AssistantMessage)) + 1
        if step > steps:
            return ModelResponse(text="done", usage=Usage(input_tokens=1, output_tokens=1, requests=1))
        n = (step * 7) % files
        call = ToolCall(
            id=f"c{step}",
            name="write_file",
            args={"path": f"pkg{n % 10}/mod{n}.py", "content": text(n, step)},
        )
        return ModelResponse(tool_calls=(call,), usage=Usage(input_tokens=1, output_tokens=1, requests=1))

    return FunctionModel(answer)


def stored_bytes(store: RunStore, run_id: str) -> tuple[int, int]:
    """(workspace bytes, checkpoint and ledger bytes) the store holds for the run."""
    ns, q = store.ns, store.db.query
    usage = store.workspace_usage(run_id)
    rows = q(
        "SELECT COALESCE(SUM(LENGTH(path) + COALESCE(LENGTH(body), 0)), 0) "
        f"FROM {ns}_workspace WHERE run_id = ?",
        (run_id,),
    )
    state = 0
    for table in ("checkpoints", "messages", "steps", "tool_calls"):
        state += int(
            str(
                q(f"SELECT COALESCE(SUM(LENGTH(body)), 0) FROM {ns}_{table} WHERE run_id = ?", (run_id,))[0][
                    0
                ]
            )
        )
    return usage.blob_bytes + int(str(rows[0][0])), state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--postgres", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "project"
        make_project(root, args.files)
        url = args.postgres or f"sqlite:///{tmp}/runs.db"
        namespace = f"b_{uuid.uuid4().hex[:8]}"
        call_s: list[float] = []
        resume_load: list[float] = []
        resume_restore: list[float] = []
        seed_s: list[float] = []
        per_step_ws: list[float] = []
        per_step_state: list[float] = []
        db: Database = PostgresDatabase(url) if args.postgres else SQLiteDatabase(f"{tmp}/runs.db")
        with TimedStore(db, namespace) as store:
            for round_ in range(args.rounds):
                run_id = f"bench-{round_}"
                started: dict[str, float] = {}

                def observe(event: AgentEvent, started: dict[str, float] = started) -> None:
                    if isinstance(event, ToolCalled):
                        if event.step == args.steps // 2 + 1 and "stopped" not in started:
                            started["stopped"] = 1.0
                            raise Stop
                        started[event.call.id] = time.perf_counter()
                    elif isinstance(event, ToolReturned):
                        call_s.append(time.perf_counter() - started[event.record.call.id])

                agent = Agent(
                    model(args.files, args.steps),
                    checkpointer=store,
                    observers=[observe],
                    limits=RunLimits(max_steps=args.steps + 2),
                )
                with Sandbox.create("process", workspace=root) as sbx, contextlib.suppress(Stop):
                    agent.run_sync("edit", sandbox=sbx, run_id=run_id)
                # resume in a new, empty sandbox (another machine, say)
                with Sandbox.create("process") as fresh:
                    t0 = time.perf_counter()
                    lease = store.claim(run_id, new=False)
                    state = store.load(run_id)
                    t1 = time.perf_counter()
                    store.restore_workspace(run_id, fresh)
                    t2 = time.perf_counter()
                    lease.release()
                    resume_load.append(t1 - t0)
                    resume_restore.append(t2 - t1)
                    assert state is not None
                    result = agent.run_sync(resume=run_id, sandbox=fresh)
                    assert result.ok, result.error
                with Sandbox.create("process") as raw:
                    t0 = time.perf_counter()
                    raw.files.upload_dir(root)
                    seed_s.append(time.perf_counter() - t0)
                ws, st = stored_bytes(store, run_id)
                per_step_ws.append(ws / (args.steps + 1))
                per_step_state.append(st / (args.steps + 1))
            if args.postgres:
                tables = ", ".join(f"{namespace}_{t}" for t in TABLES)
                store.db.write([(f"DROP TABLE IF EXISTS {tables}", [()])])
        record_s = store.record_s
        size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        med = statistics.median
        print(
            f"{args.files} files ({size / 1024:.0f} KiB), {args.steps} steps, {args.rounds} rounds, "
            f"{'PostgreSQL' if args.postgres else 'SQLite'}\n"
        )
        rows = [
            ("workspace bytes stored per step, first run", f"{per_step_ws[0]:,.0f} B", "its seed included"),
            ("... later runs of the same seed, p50", f"{med(per_step_ws[1:] or per_step_ws):,.0f} B", ""),
            ("checkpoint + ledger bytes per step", f"{med(per_step_state):,.0f} B", ""),
            ("write_file call, p50", f"{med(call_s) * 1000:.2f} ms", "the record below included"),
            ("record the workspace and the call, p50", f"{med(record_s) * 1000:.2f} ms", "one transaction"),
            ("resume: lease + load the state, p50", f"{med(resume_load) * 1000:.1f} ms", ""),
            (
                "resume: restore the workspace, p50",
                f"{med(resume_restore) * 1000:.1f} ms",
                "into a new sandbox",
            ),
            (
                "seed a new sandbox with the folder, p50",
                f"{med(seed_s) * 1000:.1f} ms",
                "upload_dir: mechanism",
            ),
        ]
        print("| measurement | value | note |\n|---|---|---|")
        for name, value, note in rows:
            print(f"| {name} | {value} | {note} |")


if __name__ == "__main__":
    main()
