"""Throughput: many small independent programs, each with its own test, per tier.

    python bench/throughput.py [--programs N] [--tiers process,docker,gvisor]

Every program runs in a fresh or reset sandbox (a pooled sandbox is reset between programs:
no program sees another's files, processes or interpreter state). The peer, llm-sandbox,
runs the same programs in one reused session (its fastest mode) on the same image, in the
same run. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

from stockade.sandbox.pool import SandboxPool

WORKERS = 2  # the machine's cores


def program(i: int) -> str:
    return (
        f"def f(x):\n    return x * {i}\n\n"
        f"def test_f():\n    assert f(2) == {2 * i}\n\ntest_f()\nprint('ok')\n"
    )


def ours(tier: str, programs: int) -> float:
    def one(pool: SandboxPool, i: int) -> bool:
        with pool.acquire() as sbx:
            sbx.files.write("prog.py", program(i))  # each program ships its own file
            return sbx.run_code(program(i)).logs.stdout == "ok\n"

    with SandboxPool(tier, size=WORKERS + 2, max_uses=100_000) as pool:
        with pool.acquire():
            pass
        time.sleep(2.0)  # let the pool fill
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(WORKERS) as ex:
            ok = list(ex.map(lambda i: one(pool, i), range(programs)))
        elapsed = time.perf_counter() - start
    assert all(ok), "a program failed"
    return programs / elapsed


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
    args = parser.parse_args()
    rows = []
    for tier in args.tiers.split(","):
        rate = ours(tier, args.programs)
        peer_rate = peer(tier, max(args.programs // 10, 20))
        ratio = f"{rate / peer_rate:.1f}x" if peer_rate else "-"
        peer_text = f"{peer_rate:.1f}/s" if peer_rate else "-"
        rows.append((tier, f"{rate:.0f}/s", peer_text, ratio, f"{pool_latency_ms(tier):.2f} ms"))
    print(f"Throughput, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, Python {sys.version.split()[0]}")
    print()
    columns = ["tier", "stockade pool, reset per program", "llm-sandbox, reused session", "ratio"]
    print("| " + " | ".join([*columns, "pool acquire + print(1) p50"]) + " |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
