"""Process tier: cold start, run_code latency, command latency, idle memory, pool latency.

    python bench/process_tier.py [--rounds N]

Prints a markdown table. Every figure is set against the raw mechanism doing the same work,
measured in the same run: a strict bwrap running ``python3 -c 'print(1)'`` for a cold start
(create + the first ``print(1)`` back, through ``run_code`` and through a command; close is
its own row), a persistent interpreter in bwrap for ``run_code`` on a live sandbox. The cold
starts are interleaved round by round, so that a change of the machine's load moves both sides.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from _raw import PRINT1, RAW_BWRAP
from policy_inside import CpuGroups, cpu_groups

from stockade import Sandbox
from stockade.sandbox import SpareBackend
from stockade.sandbox.pool import SandboxPool
from stockade.sandbox.process import ProcessBackend


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


def cold_starts(rounds: int, groups: CpuGroups) -> dict[str, list[float]]:
    """The same work on each side, interleaved: one round runs each once, in turn.

    "code" and "command" are ``Sandbox.create()`` and the first ``print(1)`` back (through
    ``run_code``, which starts the sandbox's interpreter, and through a command); "create"
    is the part of "code" until the sandbox is ready, "close" the close after it; "spare"
    is create + ``run_code`` through a ``SpareBackend`` whose spare is ready. "cpu_raw",
    "cpu_code" and "cpu_command" are the CPU time of raw bwrap's run and of "code" and
    "command" with their close: every process's, host and sandbox (each born in a cpuacct
    group of its row's, where the host has cgroup v1's; ``CpuGroups``; a sandbox forked from
    the template counts through the template's group).
    """
    out: dict[str, list[float]] = {
        k: []
        for k in (
            "plain", "raw", "code", "create", "command", "close", "spare",
            "cpu_raw", "cpu_code", "cpu_command",
        )
    }  # fmt: skip

    def cpu(name: str, action: Callable[[], object]) -> None:
        # A sandbox forked from the process tier's template is the template's child, not
        # ours: its CPU goes to the template's group, whose growth meanwhile is the row's too.
        template = groups.used("template")
        before = groups.enter(name)
        try:
            action()
        finally:
            after = groups.leave(name)
        if before is not None:
            out[f"cpu_{name}"].append(after - before + groups.used("template") - template)

    spare = SpareBackend(ProcessBackend())

    def raw(argv: list[str]) -> float:
        t = time.perf_counter()
        done = subprocess.run(argv, env={}, check=True, capture_output=True)
        elapsed = time.perf_counter() - t
        assert done.stdout == b"1\n"
        return elapsed

    def by_code() -> None:
        t = time.perf_counter()
        sbx = Sandbox.create()
        ready = time.perf_counter()
        ex = sbx.run_code("print(1)")
        done = time.perf_counter()
        assert ex.logs.stdout == "1\n", ex
        out["code"].append(done - t)
        out["create"].append(ready - t)
        t = time.perf_counter()
        sbx.close()
        out["close"].append(time.perf_counter() - t)

    def by_command() -> None:
        t = time.perf_counter()
        sbx = Sandbox.create()
        result = sbx.commands.run(PRINT1)
        out["command"].append(time.perf_counter() - t)
        assert result.stdout == "1\n", result
        sbx.close()

    def from_spare() -> None:
        # Timed once the spare is ready (a create after a pause), and its successor is
        # waited for untimed, so that no start in the background overlaps the next round.
        spare.wait_ready(30)
        t = time.perf_counter()
        sbx = Sandbox.create(backend=spare)
        ex = sbx.run_code("print(1)")
        out["spare"].append(time.perf_counter() - t)
        assert ex.logs.stdout == "1\n", ex
        sbx.close()
        spare.wait_ready(30)

    groups.enter("template")  # where the default backend's template is born (if it has one)
    try:
        with Sandbox.create() as sbx:  # the first use builds the seccomp filter and the shared files
            sbx.run_code("print(1)")
    finally:
        groups.leave("template")
    Sandbox.create(backend=spare).close()  # the first spare
    try:
        for _ in range(rounds):
            cpu("raw", lambda: out["raw"].append(raw([*RAW_BWRAP, *PRINT1])))
            cpu("code", by_code)
            out["plain"].append(raw(PRINT1))
            cpu("command", by_command)
            from_spare()
    finally:
        spare.close()
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
    parser.add_argument("--cold-only", action="store_true", help="only the cold start rows")
    args = parser.parse_args()
    n = args.rounds
    rows: list[tuple[str, str, str, str]] = []

    def add(name: str, value: str, ratio: str = "", note: str = "") -> None:
        rows.append((name, value, ratio, note))

    load_before = os.getloadavg()
    with cpu_groups(["raw", "code", "command", "template"]) as groups:
        cold = cold_starts(n, groups)
    raw = cold["raw"]
    add("python3 -c print(1), no sandbox", f"{p50(cold['plain']):.1f} ms")
    add("raw strict bwrap + python3 -c print(1)", f"{p50(raw):.1f} ms", "1.00x", "mechanism")
    add(
        "cold start: create + run_code('print(1)') output", f"{p50(cold['code']):.1f} ms",
        f"{p50(cold['code']) / p50(raw):.2f}x", "target 1.3x",
    )  # fmt: skip
    add(
        "... of which create (supervisor ready)", f"{p50(cold['create']):.1f} ms",
        f"{p50(cold['create']) / p50(raw):.2f}x",
    )  # fmt: skip
    add(
        "cold start: create + commands.run python3 -c print(1)", f"{p50(cold['command']):.1f} ms",
        f"{p50(cold['command']) / p50(raw):.2f}x", "target 1.3x",
    )  # fmt: skip
    add("close (kill everything, free cgroup, tmpfs, folders)", f"{p50(cold['close']):.1f} ms")
    if cold["cpu_raw"]:
        cpu_raw = p50(cold["cpu_raw"])
        add("CPU: raw strict bwrap + python3 -c print(1)", f"{cpu_raw:.1f} ms", "1.00x", "all processes")
        for key, what in (("cpu_code", "run_code"), ("cpu_command", "commands.run")):
            add(
                f"CPU: create + first {what} + close", f"{p50(cold[key]):.1f} ms",
                f"{p50(cold[key]) / cpu_raw:.2f}x", "host and sandbox",
            )  # fmt: skip
    add(
        "create from a ready spare (SpareBackend) + run_code('print(1)')", f"{p50(cold['spare']):.1f} ms",
        f"{p50(cold['spare']) / p50(raw):.2f}x", "at or below raw",
    )  # fmt: skip
    if not args.cold_only:
        live_rows(n, add)
    load_after = os.getloadavg()
    print(
        f"Process tier, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
        f"Python {sys.version.split()[0]}, "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print()
    print("| measurement | value | ratio | note |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def live_rows(n: int, add: Callable[..., None]) -> None:
    """run_code and commands on a live sandbox, idle memory, a pool's latency."""
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


if __name__ == "__main__":
    main()
