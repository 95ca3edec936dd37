"""Snapshots: a microVM started from its boot image against a cold boot, and what pause,
resume, snapshot and fork cost on the process tier and the microVM.

    python bench/snapshots.py [--runs N]

Side by side in one run, interleaved (drift hits every row alike):
* microVM cold: ``MicroVMBackend(boot_snapshots=False)``: create + ``run_code("print(1)")``;
* microVM from its boot image (the default): the same, restored from the image (built once,
  before the runs, and not counted);
* per tier: ``snapshot()`` of a sandbox holding a 1 MiB workspace and a started interpreter,
  ``pause()``, ``Sandbox.resume(id)`` + ``run_code``, and a fork: ``Sandbox.create(snapshot=...)``
  + ``run_code``.
Prints markdown tables (medians) and the machine's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stockade import Limits, Sandbox, SnapshotStore
from stockade.sandbox import microvm


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def first_print(backend: microvm.MicroVMBackend) -> float:
    start = time.perf_counter()
    with Sandbox.create("microvm", backend=backend) as sbx:
        sbx.run_code("print(1)")
        return time.perf_counter() - start


def lifecycle(tier: str, store: SnapshotStore, rows: dict[str, list[float]]) -> None:
    sbx = Sandbox.create(tier, limits=Limits(memory_mb=256))
    try:
        sbx.files.write("data.bin", os.urandom(1 << 20))
        sbx.run_code("x = 41")
        start = time.perf_counter()
        snap = sbx.snapshot(store=store)
        rows[f"{tier} snapshot ({snap.kind})"].append(time.perf_counter() - start)
        start = time.perf_counter()
        with Sandbox.create(snapshot=snap, store=store) as fork:
            fork.run_code("print(1)")
            rows[f"{tier} fork: create from the snapshot + run_code"].append(time.perf_counter() - start)
        start = time.perf_counter()
        sbx.pause(store=store)
        rows[f"{tier} pause"].append(time.perf_counter() - start)
        start = time.perf_counter()
        sbx = Sandbox.resume(sbx.id, store=store)
        sbx.run_code("print(1)")
        rows[f"{tier} resume + run_code"].append(time.perf_counter() - start)
        store.delete(snap)
    finally:
        sbx.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tiers", default="process,microvm")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["STOCKADE_SNAPSHOT_DIR"] = tmp  # the tiers' own boot images too, gone after
        store = SnapshotStore(Path(tmp))
        cold = microvm.MicroVMBackend(boot_snapshots=False)
        warm = microvm.MicroVMBackend(snapshot_store=store)
        first_print(warm)  # builds the boot image: once per machine shape, not counted
        if warm._boot_failed:
            raise SystemExit(f"no boot image: {warm._boot_failed}")
        rows: dict[str, list[float]] = {}
        for _ in range(args.runs):
            rows.setdefault("microvm cold: create + run_code print(1)", []).append(first_print(cold))
            rows.setdefault("microvm from its boot image: create + run_code print(1)", []).append(
                first_print(warm)
            )
        for _ in range(args.runs):
            for tier in args.tiers.split(","):
                for name in (
                    f"{tier} snapshot (files)" if tier == "process" else f"{tier} snapshot (memory)",
                    f"{tier} fork: create from the snapshot + run_code",
                    f"{tier} pause",
                    f"{tier} resume + run_code",
                ):
                    rows.setdefault(name, [])
                lifecycle(tier, store, rows)
    load = os.getloadavg()
    print(f"{args.runs} runs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    print("| measurement | median | min | max |")
    print("|---|---|---|---|")
    for name, values in rows.items():
        if values:
            med, low, high = statistics.median(values), min(values), max(values)
            print(f"| {name} | {med * 1000:.0f} ms | {low * 1000:.0f} ms | {high * 1000:.0f} ms |")
    cold_med = statistics.median(rows["microvm cold: create + run_code print(1)"])
    warm_med = statistics.median(rows["microvm from its boot image: create + run_code print(1)"])
    print(f"\nboot image against cold boot: {cold_med / warm_med:.1f}x faster")


if __name__ == "__main__":
    main()
