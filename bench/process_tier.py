"""Process tier: cold start, run_code latency, command latency, idle memory, pool latency.

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

from stockade import Sandbox
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
    loop = "import sys\nfor line in sys.stdin:\n    exec(line)\n    print('ok', flush=True)"
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


def idle_memory_mb(count: int, warm: bool) -> float:
    """Average PSS of a live idle sandbox when ``count`` of them run side by side."""
    sandboxes = [Sandbox.create() for _ in range(count)]
    try:
        if warm:
            for sbx in sandboxes:
                sbx.run_code("")
        time.sleep(0.5)
        return sum(sandbox_memory_kb(s) for s in sandboxes) / count / 1024
    finally:
        for sbx in sandboxes:
            sbx.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    n = args.rounds
    rows: list[tuple[str, str, str, str]] = []

    def add(name: str, value: str, ratio: str = "", note: str = "") -> None:
        rows.append((name, value, ratio, note))

    plain = timed(lambda: subprocess.run(PRINT1, env={}, check=True, capture_output=True), n)
    bwrap = timed(lambda: subprocess.run([*RAW_BWRAP, *PRINT1], env={}, check=True, capture_output=True), n)

    def first_output() -> None:
        sbx = Sandbox.create()
        assert sbx.commands.run(["echo", "1"]).stdout == "1\n"
        created.append(sbx)

    created: list[Sandbox] = []
    first_output()  # the first use builds the seccomp filter and the shared files
    ours = timed(first_output, n)
    closing = timed(lambda: created.pop().close(), n)
    add("python3 -c print(1), no sandbox", f"{p50(plain):.1f} ms")
    add("raw strict bwrap + python3 -c print(1)", f"{p50(bwrap):.1f} ms", "1.00x", "mechanism")
    add(
        "cold start: create sandbox + first command's output", f"{p50(ours):.1f} ms",
        f"{p50(ours) / p50(bwrap):.2f}x", "target 1.3x",
    )  # fmt: skip
    add("close (kill everything, free cgroup, tmpfs, folders)", f"{p50(closing):.1f} ms")

    raw_loop = raw_persistent_interpreter(n * 10)
    with Sandbox.create() as sbx:
        sbx.run_code("x = 0")
        code = timed(lambda: sbx.run_code("print(1)"), n * 10)
        cmd = timed(lambda: sbx.commands.run(["true"]), n * 3)
    add("persistent interpreter in raw bwrap, one exec", f"{p50(raw_loop):.2f} ms", "1.00x", "mechanism")
    add(
        "run_code('print(1)') on a live sandbox, p50", f"{p50(code):.2f} ms",
        f"{p50(code) / p50(raw_loop):.2f}x", "target < 1 ms",
    )  # fmt: skip
    add("commands.run(['true']) on a live sandbox, p50", f"{p50(cmd):.2f} ms")
    add(
        "idle memory per live sandbox, 8 side by side (PSS)",
        f"{idle_memory_mb(8, False):.1f} MB",
        "",
        "target < 15 MB",
    )
    add("... the same with each one's interpreter started", f"{idle_memory_mb(8, True):.1f} MB")

    with SandboxPool("process", size=4) as pool:
        with pool.acquire():
            pass
        time.sleep(1.0)
        pooled_t = []
        for _ in range(n * 3):
            t = time.perf_counter()
            with pool.acquire() as sbx:
                sbx.run_code("print(1)")
            pooled_t.append(time.perf_counter() - t)
            time.sleep(0.02)  # the caller's own work between uses (not timed)
    add("pool acquire + run_code('print(1)') + release, p50", f"{p50(pooled_t):.2f} ms", "", "target < 5 ms")

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
