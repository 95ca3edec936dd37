"""Throughput: many small independent programs, each with its own test, per tier.

    python bench/throughput.py [--programs N] [--tiers process,docker,gvisor] [--cpu]

Every program runs in a fresh or reset sandbox (a pooled sandbox is reset between programs:
no program sees another's files, processes or interpreter state). The peer, llm-sandbox,
runs the same programs in one reused session (its fastest mode) on the same image, in the
same run. Prints a markdown table.

``--cpu`` adds the CPU time each program costs, host and sandbox together, on the process
tier: a rate on a shared machine says as much of the others' load as of ours, a CPU time
much less (at 100% of 2 cores, 8 ms a program is 250 programs/s). It needs root and a
cgroup v1 ``cpuacct`` hierarchy of its own (this script joins a group there, which the
sandboxes' processes stay in: the tier moves them into memory, pids and cpu groups only).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator

from stockade.sandbox.pool import SandboxPool

WORKERS = 2  # the machine's cores


def program(i: int) -> str:
    return (
        f"def f(x):\n    return x * {i}\n\n"
        f"def test_f():\n    assert f(2) == {2 * i}\n\ntest_f()\nprint('ok')\n"
    )


CPUACCT = "/sys/fs/cgroup/cpuacct"


@contextlib.contextmanager
def cpu_group() -> Iterator[Callable[[], float] | None]:
    """A cpuacct group this process joins (its children are born in it): a reader of the
    milliseconds of CPU it has used, or None where there is no such hierarchy."""
    group = f"{CPUACCT}/stockade-bench-{os.getpid()}"
    try:
        os.mkdir(group)
    except OSError:
        yield None
        return
    try:
        with open(f"{group}/cgroup.procs", "w") as fh:
            fh.write(str(os.getpid()))

        def used_ms() -> float:
            with open(f"{group}/cpuacct.usage") as fh:
                return int(fh.read()) / 1e6

        yield used_ms
    finally:
        with open(f"{CPUACCT}/cgroup.procs", "w") as fh:
            fh.write(str(os.getpid()))
        for _ in range(50):  # its last processes may still be exiting
            try:
                os.rmdir(group)
                break
            except OSError:
                time.sleep(0.1)


def ours(tier: str, programs: int, used_ms: Callable[[], float] | None = None) -> tuple[float, float | None]:
    """Programs a second, and the CPU milliseconds a program (with ``used_ms``)."""

    def one(pool: SandboxPool, i: int) -> bool:
        with pool.acquire() as sbx:
            sbx.files.write("prog.py", program(i))  # each program ships its own file
            return sbx.run_code(program(i)).logs.stdout == "ok\n"

    with SandboxPool(tier, size=WORKERS + 2, max_uses=100_000) as pool:
        with pool.acquire():
            pass
        time.sleep(2.0)  # let the pool fill
        cpu_before = used_ms() if used_ms is not None else 0.0
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(WORKERS) as ex:
            ok = list(ex.map(lambda i: one(pool, i), range(programs)))
        elapsed = time.perf_counter() - start
        time.sleep(0.5)  # the last members' resets
        cpu = (used_ms() - cpu_before) / programs if used_ms is not None else None
    assert all(ok), "a program failed"
    return programs / elapsed, cpu


def pool_latency_ms(tier: str, rounds: int = 60) -> float:
    """p50 of acquire + run_code('print(1)') + release, with the caller's own work between uses."""
    import statistics

    with SandboxPool(tier, size=4) as pool:
        with pool.acquire():
            pass
        time.sleep(2.0)
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            with pool.acquire() as sbx:
                sbx.run_code("print(1)")
            samples.append(time.perf_counter() - start)
            time.sleep(0.05)  # not timed
    return statistics.median(samples) * 1000


def peer(tier: str, programs: int) -> float | None:
    try:
        from llm_sandbox import SandboxBackend, SandboxSession
    except ImportError:
        return None
    if tier == "process":
        session = SandboxSession(lang="python", backend=SandboxBackend.BUBBLEWRAP)
    elif tier == "docker":
        image = os.environ.get("STOCKADE_IMAGE", "stockade-sandbox:latest")
        session = SandboxSession(
            lang="python", backend=SandboxBackend.DOCKER, image=image, skip_environment_setup=True
        )
    else:
        return None
    with session:
        session.run("print(1)")
        start = time.perf_counter()
        for i in range(programs):
            result = session.run(program(i))
            assert result.stdout.strip() == "ok", result
        return programs / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", type=int, default=300)
    parser.add_argument("--tiers", default="process,docker,gvisor")
    parser.add_argument("--cpu", action="store_true", help="CPU per program (process tier, root, cgroup v1)")
    args = parser.parse_args()
    rows = []
    load = os.getloadavg()[0]
    for tier in args.tiers.split(","):
        with cpu_group() if args.cpu and tier == "process" else contextlib.nullcontext() as used_ms:
            rate, cpu = ours(tier, args.programs, used_ms)
        peer_rate = peer(tier, max(args.programs // 10, 20))
        ratio = f"{rate / peer_rate:.1f}x" if peer_rate else "-"
        peer_text = f"{peer_rate:.1f}/s" if peer_rate else "-"
        row = [tier, f"{rate:.0f}/s", peer_text, ratio, f"{pool_latency_ms(tier):.2f} ms"]
        rows.append([*row, f"{cpu:.2f} ms" if cpu is not None else "-"] if args.cpu else row)
    print(f"Throughput, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, Python {sys.version.split()[0]}")
    print(f"load average at the start: {load:.2f}")
    print()
    columns = ["tier", "stockade pool, reset per program", "llm-sandbox, reused session", "ratio"]
    columns.append("pool acquire + print(1) p50")
    if args.cpu:
        columns.append("CPU a program (host + sandbox)")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for cells in rows:
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
