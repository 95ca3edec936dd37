"""The process tier's cold start of several versions of stockade, round by round.

    python bench/cold_versions.py --rounds 40 NAME=SRC[,VAR=VALUE...] [NAME=SRC ...]

Each ``SRC`` is a ``src`` folder (a checkout of another commit: ``git archive COMMIT src``),
with the environment variables its worker runs with, if any (one version's code measured both
ways: ``exec=src template=src,STOCKADE_PROCESS_START=template``).
One worker process per version imports stockade from its folder (its supervisor ships into
its sandboxes); each round asks every worker, in a new random order, for the rows of
``process_tier.py --cold-only``: raw bwrap + ``python3 -c 'print(1)'``, ``Sandbox.create()``
+ ``run_code('print(1)')`` (and the create alone), ``Sandbox.create()`` + a command running
``python3 -c 'print(1)'``. A change of the machine's load then falls on every version alike
within a round: each ratio is taken per round, against the median of that round's raw runs,
and the median of those is printed. Blocks of whole runs (``process_tier.py`` A/B/A/B)
cannot resolve a few milliseconds on a loaded 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from _raw import PRINT1, RAW_BWRAP  # stockade-free: a worker imports its own version after

ROWS = ("raw", "code", "command")


def worker() -> None:
    """One version: answers each row asked on stdin with its timings as a JSON line."""
    from stockade import Sandbox

    with Sandbox.create() as sbx:  # the first use builds the seccomp filter and shared files
        sbx.run_code("print(1)")
    print("ready", flush=True)
    for line in sys.stdin:
        row = line.strip()
        started = time.perf_counter()
        if row == "raw":
            subprocess.run([*RAW_BWRAP, *PRINT1], env={}, check=True, capture_output=True)
            out = {"raw": time.perf_counter() - started}
        elif row == "code":
            sbx = Sandbox.create()
            created = time.perf_counter()
            ex = sbx.run_code("print(1)")
            done = time.perf_counter()
            sbx.close()
            assert ex.logs.stdout == "1\n", ex
            out = {"code": done - started, "create": created - started}
        else:
            sbx = Sandbox.create()
            result = sbx.commands.run(PRINT1)
            done = time.perf_counter()
            sbx.close()
            assert result.stdout == "1\n", result
            out = {"command": done - started}
        print(json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("versions", nargs="+", help="NAME=SRC[,VAR=VALUE...]: a version's src folder")
    args = parser.parse_args()
    workers: dict[str, subprocess.Popen[str]] = {}
    for version in args.versions:
        name, _, rest = version.partition("=")
        src, *settings = rest.split(",")
        workers[name] = subprocess.Popen(
            [sys.executable, __file__, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.path.abspath(src), **dict(s.split("=", 1) for s in settings)},
        )
    found: dict[str, dict[str, list[float]]] = {n: {k: [] for k in (*ROWS, "create")} for n in workers}
    load_before = os.getloadavg()[0]
    try:
        for proc in workers.values():
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for _ in range(args.rounds):
            order = list(workers)
            random.shuffle(order)
            for row in ROWS:
                for name in order:
                    proc = workers[name]
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(row + "\n")
                    proc.stdin.flush()
                    for key, value in json.loads(proc.stdout.readline()).items():
                        found[name][key].append(value)
    finally:
        for proc in workers.values():
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait()
    raw = [statistics.median(found[n]["raw"][i] for n in found) for i in range(args.rounds)]
    print(
        f"Process tier's cold start by version, {time.strftime('%Y-%m-%d %H:%M')}, {args.rounds} rounds, "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; raw bwrap + print(1) "
        f"{statistics.median(raw) * 1000:.1f} ms (median of the rounds' medians)"
    )
    print()
    print("| version | create + run_code | of which create | run_code after create | create + command |")
    print("|---|---|---|---|---|")
    for name, rows in found.items():

        def ratio(key: str, rows: dict[str, list[float]] = rows) -> str:
            per_round = [rows[key][i] / raw[i] for i in range(args.rounds)]
            return f"{statistics.median(rows[key]) * 1000:.1f} ms ({statistics.median(per_round):.2f}x)"

        after = statistics.median(c - k for c, k in zip(rows["code"], rows["create"], strict=True)) * 1000
        print(f"| {name} | {ratio('code')} | {ratio('create')} | {after:.1f} ms | {ratio('command')} |")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
