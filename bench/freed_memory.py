"""What zeroing freed memory costs: a command, run_code, an upload, a reset, and a start.

    python bench/freed_memory.py TIER [--runs N] [--starts N]

A sandbox's guest kernel zeroes the pages it frees (the microVM boots with init_on_free=1)
and the supervisor's heap overwrites the chunks it frees (glibc's M_PERTURB): measured by
running this script once with the code before the change and once after (the same host,
alternated), compared side by side. Per run: ``commands.run("true")``, ``run_code("1")``, an
upload of 2 MiB, ``reset()`` after a user left 2 MiB in /tmp, the heap and the workspace. Then
``--starts`` starts: on the microVM a cold boot (no boot image) and a start from the ready
image (built first, not counted), each to its first command; on gVisor a start. Prints one
JSON line of medians and ranges, in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stockade import Limits, Sandbox, SnapshotStore
from stockade.sandbox.base import Backend

LEFT = "open('/tmp/a', 'w').write('x' * (2 << 20)); held = 'y' * (2 << 20)"


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def backends(tier: str, store: SnapshotStore) -> tuple[Backend | None, Backend | None]:
    """(cold, from an image): the microVM's without and with its boot and ready images."""
    if tier != "microvm":
        return None, None
    from stockade.sandbox import microvm

    cold = microvm.MicroVMBackend(boot_snapshots=False, start_ahead=False)
    return cold, microvm.MicroVMBackend(snapshot_store=store, start_ahead=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tier", choices=("microvm", "gvisor"))
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--starts", type=int, default=3)
    args = parser.parse_args()
    limits = Limits(memory_mb=256, timeout_s=60)
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as root:
        cold, warm = backends(args.tier, SnapshotStore(Path(root)))
        try:
            with Sandbox.create(args.tier, backend=warm, limits=limits) as sbx:  # builds the images
                sbx.commands.run("true")
                for _ in range(args.runs):
                    times.setdefault("command", []).append(timed(lambda: sbx.commands.run("true")))
                    times.setdefault("run_code", []).append(timed(lambda: sbx.run_code("1")))
                    blob = os.urandom(2 << 20)
                    times.setdefault("upload 2 MiB", []).append(timed(lambda b=blob: sbx.files.write("b", b)))
                    sbx.run_code(LEFT)
                    times.setdefault("reset", []).append(timed(sbx.reset))
            for _ in range(args.starts):
                for name, backend in (("cold boot", cold), ("start from image", warm)):
                    if name == "cold boot" and args.tier != "microvm":
                        continue

                    def start(backend: Backend | None = backend) -> None:
                        with Sandbox.create(args.tier, backend=backend, limits=limits) as sbx:
                            sbx.commands.run("true")

                    times.setdefault(name, []).append(timed(start))
        finally:
            for backend in (cold, warm):
                if backend is not None:
                    backend.close()
    figures = {name: summary(values) for name, values in times.items()}
    print(json.dumps(figures | {"load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
