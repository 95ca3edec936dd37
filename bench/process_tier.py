"""Process tier: cold start, run_code latency, command latency, idle memory, throughput.

    python bench/process_tier.py [--rounds N]

Prints a markdown table. Every figure is set against the raw mechanism measured in the same
run: plain python3, a strict bwrap running python3, and a persistent interpreter in bwrap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from stockade import Limits, Sandbox
from stockade.sandbox.pool import SandboxPool

RAW_BWRAP = [
    "bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
    "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
    "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
    "--uid", "1000", "--gid", "1000", "--clearenv",
]  # fmt: skip
PRINT1 = ["/usr/bin/python3", "-c", "print(1)"]


def timed(fn: object, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        out.append(time.perf_counter() - t)
    return out


def p50(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def raw_persistent_interpreter(rounds: int) -> list[float]:
    """The floor for run_code: a python loop inside bwrap answering over pipes."""
    loop = "import sys\nfor line in sys.stdin:\n    exec(line)\n    sys.stdout.write('ok\\n'); sys.stdout.flush()"
    proc = subprocess.Popen(
        [*RAW_BWRAP, "/usr/bin/python3", "-u", "-c", loop],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={},
    )  # fmt: skip
    assert proc.stdin and proc.stdout
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        proc.stdin.write(b"x = 1\n")
        proc.stdin.flush()
        proc.stdout.readline()
        out.append(time.perf_counter() - t)
    proc.kill()
    proc.wait()
    return out


def sandbox_memory_kb(sbx: Sandbox) -> int:
    """Proportional set size of every process of the sandbox (its cgroup), in KiB."""
    boundary = sbx.instance.boundary  # type: ignore[attr-defined]
    pids = boundary.cgroup.pids() if boundary.cgroup else [boundary.proc.pid]
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def throughput(programs: int) -> tuple[float, float]:
    """Independent programs, each with its own files and test, on a pool (2 workers)."""
    import concurrent.futures

    def one(pool: SandboxPool, i: int) -> bool:
        with pool.acquire() as sbx:
            sbx.files.write("prog.py", f"def f():\n    return {i}\n")
            r = sbx.commands.run(["python3", "-c", f"import prog; assert prog.f() == {i}; print('ok')"])
            return r.stdout == "ok\n"

    with SandboxPool("process", size=4, max_uses=1000) as pool:
        with pool.acquire():
            pass
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            ok = list(ex.map(lambda i: one(pool, i), range(programs)))
        elapsed = time.perf_counter() - t
    assert all(ok)

    def raw_one(i: int) -> None:
        subprocess.run([*RAW_BWRAP, *PRINT1], env={}, check=True, capture_output=True)

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        list(ex.map(raw_one, range(programs)))
    raw_elapsed = time.perf_counter() - t
    return programs / elapsed, programs / raw_elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    n = args.rounds
    rows: list[tuple[str, str, str, str]] = []

    plain = timed(lambda: subprocess.run(PRINT1, env={}, check=True, capture_output=True), n)
    bwrap = timed(lambda: subprocess.run([*RAW_BWRAP, *PRINT1], env={}, check=True, capture_output=True), n)

    def cold() -> None:
        with Sandbox.create(limits=Limits(timeout_s=30)) as sbx:
            assert sbx.commands.run(PRINT1).stdout == "1\n"

    def cold_echo() -> None:
        with Sandbox.create() as sbx:
            assert sbx.commands.run(["echo", "1"]).stdout == "1\n"

    cold()  # first use builds the seccomp filter and shared files
    ours = timed(cold, n)
    ours_echo = timed(cold_echo, n)
    rows.append(("python3 -c print(1), no sandbox", f"{p50(plain):.1f} ms", "", ""))
    rows.append(("raw strict bwrap + python3 -c print(1)", f"{p50(bwrap):.1f} ms", "1.00x", "mechanism"))
    rows.append(
        ("cold start: create + run python3 print(1) + close", f"{p50(ours):.1f} ms",
         f"{p50(ours) / p50(bwrap):.2f}x", "target 1.3x")
    )  # fmt: skip
    rows.append(
        ("cold start: create + first output (echo) + close", f"{p50(ours_echo):.1f} ms",
         f"{p50(ours_echo) / p50(bwrap):.2f}x", "target 1.3x")
    )  # fmt: skip

    raw_loop = raw_persistent_interpreter(n * 10)
    with Sandbox.create() as sbx:
        sbx.run_code("x = 0")
        code = timed(lambda: sbx.run_code("print(1)"), n * 10)
        cmd = timed(lambda: sbx.commands.run(["true"]), n * 3)
        time.sleep(0.5)
        idle_kb = sandbox_memory_kb(sbx)
    rows.append(
        ("persistent interpreter in raw bwrap, one exec", f"{p50(raw_loop):.2f} ms", "1.00x", "mechanism")
    )
    rows.append(
        ("run_code('print(1)') on a live sandbox, p50", f"{p50(code):.2f} ms",
         f"{p50(code) / p50(raw_loop):.2f}x", "target < 1 ms")
    )  # fmt: skip
    rows.append(("commands.run(['true']) on a live sandbox, p50", f"{p50(cmd):.2f} ms", "", ""))
    rows.append(
        (
            "idle memory of a live sandbox (PSS, all processes)",
            f"{idle_kb / 1024:.1f} MB",
            "",
            "target < 15 MB",
        )
    )

    with SandboxPool("process", size=2) as pool:
        with pool.acquire():
            pass
        time.sleep(0.5)

        def pooled() -> None:
            with pool.acquire() as sbx:
                sbx.run_code("print(1)")

        pooled_t = timed(pooled, n * 3)
    rows.append(
        ("pool acquire + run_code('print(1)') + release, p50", f"{p50(pooled_t):.2f} ms", "", "target < 5 ms")
    )

    ours_tp, raw_tp = throughput(max(100, n * 5))
    rows.append(("throughput: independent programs/s (pool, 2 workers)", f"{ours_tp:.0f}/s",
                 f"{ours_tp / raw_tp:.2f}x", "vs one raw bwrap per program"))  # fmt: skip
    rows.append(
        ("throughput: one raw bwrap per program (2 workers)", f"{raw_tp:.0f}/s", "1.00x", "mechanism")
    )

    print(
        f"Process tier, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, Python {sys.version.split()[0]}"
    )
    print()
    print("| measurement | value | ratio | note |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
