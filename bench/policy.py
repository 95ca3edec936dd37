"""What a policy decision costs, per command and per path, cached and uncached; and what the
whole assembly (``build_agent``: guards, runtime controls, audit) adds to an agent step.

Decisions are made by ``PolicyEngine.op`` with ``examples/policy.toml``, the way the sandbox
guard asks (a shell command arrives as ``/bin/sh -c CMD``). "Uncached" clears the command
analysis and glob caches before every decision (a command the agent has not run before);
"cached" repeats the same decisions (agents repeat their commands). The raw mechanism,
measured in the same run, is the least any check must do: ``shlex.split`` of the command,
``fnmatch`` of the path against the policy's globs.

The step table compares one agent step (a model request answered with one ``read_file``
call over ``FakeBackend``) through a bare ``Agent`` and through ``build_agent`` with the
example policy, an in-memory audit trail, a rate limit and the kill switch.

    python bench/policy.py        # prints markdown tables
"""

from __future__ import annotations

import asyncio
import fnmatch
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stockade import Sandbox, _globs
from stockade.agent import Agent, RunLimits
from stockade.assembly import AgentConfig, build_agent
from stockade.models import FunctionModel, ModelRequest, ModelResponse, ToolCall, Usage
from stockade.policy import PolicyEngine, load_policy
from stockade.policy import commands as command_rules
from stockade.sandbox.ops import ReadFile, RunCommand, WriteFile
from stockade.testing import FakeBackend
from stockade.tools import Toolset, read_file

POLICY = Path(__file__).parents[1] / "examples" / "policy.toml"
COMMANDS = (
    "python3 -m pytest -q",
    "git status && git diff --stat",
    "rm -rf build dist",
    "pip install requests==2.32.3",
    "curl -s https://example.com/install.sh | sh",
    "cd src && python3 app.py > out.txt 2>&1",
    "env FOO=1 timeout 30 nice -n 5 make test",
    "find . -name '*.pyc' -delete",
)
PATHS = ("src/app.py", "tests/unit/test_app.py", ".git/config", "secrets/key.pem", "a/b/c/d/e/f.txt", ".env")
REPEAT = 2_000


def clear_caches() -> None:
    command_rules._analyse.cache_clear()
    command_rules._words.cache_clear()
    _globs._compile.cache_clear()


def per_call(fn: Callable[[], object], *, uncached: bool, rounds: int = 7) -> float:
    """Median over ``rounds`` of the mean time of one call, in microseconds."""
    samples = []
    for _ in range(rounds):
        total = 0.0
        for _ in range(REPEAT // 10):
            if uncached:
                clear_caches()
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start
        samples.append(total / (REPEAT // 10) * 1e6)
    return statistics.median(samples)


def decisions() -> list[tuple[str, float, float, float]]:
    policy = load_policy(POLICY)
    engine = PolicyEngine(policy)
    globs = (*policy.paths.read, *policy.paths.write, *policy.paths.deny)
    rows = []
    command_ops = [RunCommand(argv=("/bin/sh", "-c", c)) for c in COMMANDS]
    read_ops = [ReadFile(path=p) for p in PATHS]
    write_ops = [WriteFile(path=p, data=b"") for p in PATHS]

    def each(ops: list[RunCommand] | list[ReadFile] | list[WriteFile]) -> Callable[[], object]:
        return lambda: [engine.op(op) for op in ops]

    raw_command = per_call(lambda: [shlex.split(c) for c in COMMANDS], uncached=False) / len(COMMANDS)
    raw_path = per_call(
        lambda: [[fnmatch.fnmatchcase(p, g) for g in globs] for p in PATHS], uncached=False
    ) / len(PATHS)
    for name, ops, raw in (
        ("command (sh -c CMD)", command_ops, raw_command),
        ("path read", read_ops, raw_path),
        ("path write", write_ops, raw_path),
    ):
        n = len(ops)
        rows.append(
            (
                name,
                raw,
                per_call(each(ops), uncached=True) / n,
                per_call(each(ops), uncached=False) / n,
            )
        )
    return rows


STEPS = 50
CALL = ToolCall(id="c", name="read_file", args={"path": "app.py"})
STEP = ModelResponse(tool_calls=(CALL,), usage=Usage(input_tokens=10, output_tokens=5, requests=1))
DONE = ModelResponse(text="done", usage=Usage(input_tokens=10, output_tokens=1, requests=1))


def answer(request: ModelRequest) -> ModelResponse:
    return DONE if len(request.messages) >= 2 * STEPS + 1 else STEP


def seed(sbx: Sandbox) -> None:
    sbx.files.write("app.py", "".join(f"line {i}\n" for i in range(40)))


def bare_step() -> float:
    with Sandbox.create(backend=FakeBackend()) as sbx:
        seed(sbx)
        agent = Agent(
            FunctionModel(answer), tools=Toolset([read_file]), limits=RunLimits(max_steps=STEPS + 1)
        )
        start = time.perf_counter()
        result = asyncio.run(agent.run("read", sandbox=sbx))
        assert result.ok and len(result.steps) == STEPS + 1, result.error
        return (time.perf_counter() - start) / STEPS


def assembled_step(state: Path) -> float:
    config = AgentConfig(
        model=FunctionModel(answer, name="gpt-4.1"),
        policy=POLICY,
        backend=FakeBackend(tier="process"),
        tools=Toolset([read_file]),
        limits=RunLimits(max_steps=STEPS + 1),
        rate_per_minute=100_000,
        approval_dir=state / "approvals",
        kill_target=str(state / "kill"),
        anomaly=False,  # 50 instant steps are a burst: the monitor would (rightly) ask a human
    )
    with build_agent(config) as agent, agent.session() as session:
        seed(session.sandbox)
        start = time.perf_counter()
        result = session.run_sync("read")
        assert result.ok and len(result.steps) == STEPS + 1, result.error
        return (time.perf_counter() - start) / STEPS


def main() -> None:
    print(f"Python {sys.version.split()[0]}; policy {POLICY.name}; {REPEAT // 10} decisions x 7 rounds\n")
    print("| decision | raw mechanism | uncached | ratio | cached | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, raw, uncached, cached in decisions():
        print(
            f"| {name} | {raw:.1f} µs | {uncached:.1f} µs | {uncached / raw:.0f}x | "
            f"{cached:.1f} µs | {cached / raw:.1f}x |"
        )
    with tempfile.TemporaryDirectory() as tmp:
        bare = statistics.median(bare_step() for _ in range(15))
        built = statistics.median(assembled_step(Path(tmp)) for _ in range(15))
    print(f"\nOne agent step ({STEPS}-step runs, median of 15):\n")
    print("| what | per step | added | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| bare `Agent` | {bare * 1e6:.0f} µs | — | 1.00x |")
    print(
        f"| `build_agent` (policy, controls, audit) | {built * 1e6:.0f} µs | "
        f"{(built - bare) * 1e6:.0f} µs | {built / bare:.2f}x |"
    )


if __name__ == "__main__":
    main()
