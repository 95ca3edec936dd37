"""Where gVisor's cold start goes (runsc without Docker): the raw runs that bound it, and ours
split in two, interleaved in one run.

    python bench/gvisor_start.py [--runs N] [--platform systrap|ptrace]

Raw ``runsc run`` on a bundle of the offline rootfs, to its exit (as in ``container_start.py``):
``/bin/true`` (runsc's own boot and teardown), ``python3 -S -c pass`` (a Python start),
``python3 -c 'print(1)'`` (the raw mechanism's row), and the first two again with the bundle
stockade writes for a sandbox (its mounts, masks, limits), what our configuration costs runsc.
Ours: ``Sandbox.create`` (to the supervisor's ``ready``), then the first ``run_code("print(1)")``
(the zygote's fork, its load, the interpreter's fork), then the second. Then, inside one
sandbox each, how long a fork of a small Python takes on each platform (``os.fork`` + exit +
wait, six in a row): the first ``run_code`` makes two. Prints a markdown table (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _raw import PRINT1, runsc_run
from container_start import bare_config, timed

from stockade import Limits, Sandbox
from stockade.sandbox._gvisor_settings import DEFAULT_PLATFORM
from stockade.sandbox._rootfs import find_rootfs
from stockade.sandbox.gvisor import RunscBackend

OURS = ("ours: `Sandbox.create`", "ours: first `run_code`", "ours: second `run_code`")
FORKS = """
import os, time
took = []
for _ in range(6):
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    took.append((time.perf_counter() - started) * 1000)
print(sorted(took)[len(took) // 2])
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--platform", default=DEFAULT_PLATFORM, help="runsc's, for ours and the raw runs")
    args = parser.parse_args()
    rootfs = find_rootfs()
    if rootfs is None or not shutil.which("runsc"):
        raise SystemExit("needs runsc and the offline rootfs: bash scripts/setup-docker.sh")
    backend = RunscBackend(rootfs=rootfs, platform=args.platform)
    workdir = Path(tempfile.mkdtemp(prefix="stockade-bench-"))
    try:
        with Sandbox.create(backend=backend, limits=Limits(memory_mb=256)):  # its config.json, while it lives
            ours_config = json.loads(next(backend.state_dir.glob("gv-*/config.json")).read_text())
            plain = bare_config(rootfs, workdir, backend.platform)
            pass_ = ["python3", "-S", "-c", "pass"]
            raws = {
                "raw `runsc run`, `/bin/true`": runsc_run(workdir, plain, ["/bin/true"], backend.platform),
                "raw, `python3 -S -c pass`": runsc_run(workdir, plain, pass_, backend.platform),
                "raw, `python3 -c 'print(1)'`": runsc_run(workdir, plain, PRINT1, backend.platform),
                "our bundle, `/bin/true`": runsc_run(workdir, ours_config, ["/bin/true"], backend.platform),
                "our bundle, `python3 -S -c pass`": runsc_run(workdir, ours_config, pass_, backend.platform),
            }
            found: dict[str, list[float]] = {name: [] for name in raws}
            for name in OURS:
                found[name] = []
            for _ in range(args.runs):
                for name, run in raws.items():
                    found[name].append(timed(run))
                started = time.perf_counter()
                sbx = Sandbox.create(backend=backend, limits=Limits(memory_mb=256))
                created = time.perf_counter()
                sbx.run_code("print(1)")
                first = time.perf_counter()
                sbx.run_code("print(1)")
                parts = (created - started, first - created, time.perf_counter() - first)
                for name, took in zip(OURS, parts, strict=True):
                    found[name].append(took)
                sbx.close()
        forks = {}
        for platform in ("systrap", "ptrace"):
            run = runsc_run(workdir, plain, ["python3", "-S", "-c", FORKS], platform)
            forks[platform] = statistics.median(float(run().decode()) for _ in range(3))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"gVisor without Docker ({backend.platform}), medians of {args.runs}, interleaved")
    print(f"load average {os.getloadavg()[0]:.2f}\n")
    print("| what | ms |\n|---|---|")
    for name, samples in found.items():
        print(f"| {name} | {statistics.median(samples) * 1e3:.1f} |")
    for platform, ms in forks.items():
        print(f"| a fork of `python3 -S` inside, {platform} (median of 3 runs of 6) | {ms:.1f} |")


if __name__ == "__main__":
    main()
