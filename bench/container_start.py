"""Cold start and run_code latency of the container tiers, against the raw mechanisms.

    python bench/container_start.py [--runs N] [--only runsc] [--platform systrap|ptrace]

Measured in one run, interleaved (so drift hits both sides alike):
* raw: ``docker run --rm --network none IMAGE python3 -c 'print(1)'`` (runc, then
  ``--runtime runsc``), and ``runsc run`` on a minimal bundle of the same rootfs;
* stockade: ``Sandbox.create(...)`` + ``run_code("print(1)")`` (create + first output), and the
  same including ``close()`` (the raw ``--rm`` includes removal too);
* the same through a ``SpareBackend`` whose spare is ready (a create after a pause), with close;
* ``run_code("print(1)")`` p50 on a live sandbox.
Prints a markdown table (medians).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _raw import PRINT1, runsc_run

from stockade import Limits, Sandbox
from stockade.sandbox import SpareBackend, _guest
from stockade.sandbox._docker_settings import DEFAULT_IMAGE
from stockade.sandbox._gvisor_settings import DEFAULT_PLATFORM
from stockade.sandbox._rootfs import find_rootfs
from stockade.sandbox.base import Backend, SandboxSpec
from stockade.sandbox.docker import DockerBackend
from stockade.sandbox.gvisor import RunscBackend


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_docker(runtime: str | None) -> Callable[[], object]:
    argv = ["docker", "run", "--rm", "--network", "none"]
    if runtime:
        argv += ["--runtime", runtime]
    argv += [DEFAULT_IMAGE, "python3", "-c", "print(1)"]
    return lambda: subprocess.run(argv, check=True, capture_output=True)


def bare_config(rootfs: Path, workdir: Path, platform: str) -> dict[str, object]:
    """An OCI config.json of the same rootfs and nothing else (no mounts, masks or cgroup)."""
    return _guest.oci_config(
        SandboxSpec(),
        rootfs=rootfs,
        folder=workdir,
        binds={},
        cgroup="",
        annotations={},
        host=_guest.own_kernel_limits(SandboxSpec(), platform),
    )


def raw_runsc(rootfs: Path, workdir: Path, platform: str) -> Callable[[], object]:
    """``runsc run`` on a bundle with the same rootfs and nothing else, on the tier's platform."""
    return runsc_run(workdir, bare_config(rootfs, workdir, platform), PRINT1, platform)


def ours(backend: Backend, close: bool) -> Callable[[], object]:
    def run() -> object:
        sbx = Sandbox.create(backend=backend, limits=Limits(memory_mb=256))
        assert sbx.run_code("print(1)").logs.stdout == "1\n"
        if close:
            sbx.close()
        else:
            closing.append(sbx)  # closed outside the timed part
        return None

    closing: list[Sandbox] = []
    run.closing = closing  # type: ignore[attr-defined]
    return run


def run_code_p50(backend: Backend, n: int = 300) -> float:
    with Sandbox.create(backend=backend) as sbx:
        for _ in range(20):
            sbx.run_code("print(1)")
        samples = [timed(lambda: sbx.run_code("print(1)")) for _ in range(n)]
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--only", default="", help="measure only the tiers whose name contains this")
    parser.add_argument("--platform", default=DEFAULT_PLATFORM, help="runsc's, without Docker (ours and raw)")
    args = parser.parse_args()
    runs = args.runs
    rootfs = find_rootfs()
    workdir = Path(tempfile.mkdtemp(prefix="stockade-bench-"))
    backends: dict[str, Backend] = {
        "docker (runc)": DockerBackend(),
        "gvisor via docker (runsc)": DockerBackend(runtime="runsc", tier="gvisor", own_kernel=True),
    }
    raws: dict[str, Callable[[], object]] = {
        "docker (runc)": raw_docker(None),
        "gvisor via docker (runsc)": raw_docker("runsc"),
    }
    if rootfs is not None and shutil.which("runsc"):
        runsc = RunscBackend(rootfs=rootfs, platform=args.platform)
        backends["gvisor, runsc without docker"] = runsc
        raws["gvisor, runsc without docker"] = raw_runsc(rootfs, workdir, runsc.platform)
    rows = []
    try:
        for name, backend in backends.items():
            if args.only not in name:
                continue
            Sandbox.create(backend=backend).close()  # warm: image cache, supervisor folder, gc
            raws[name]()
            raw_t, open_t, closed_t, spare_t = [], [], [], []
            start_only = ours(backend, close=False)
            with_close = ours(backend, close=True)
            spare = SpareBackend(backend)
            from_spare = ours(spare, close=True)
            from_spare()  # the first spare
            for _ in range(runs):
                raw_t.append(timed(raws[name]))
                open_t.append(timed(start_only))
                closed_t.append(timed(with_close))
                for sbx in start_only.closing:  # type: ignore[attr-defined]
                    sbx.close()
                start_only.closing.clear()  # type: ignore[attr-defined]
                # A create after a pause: the spare ready, its successor waited for untimed.
                spare.wait_ready(60)
                spare_t.append(timed(from_spare))
                spare.wait_ready(60)
            spare.close()
            raw, first, full, spared = (statistics.median(x) for x in (raw_t, open_t, closed_t, spare_t))
            rows.append((name, raw, first, full, spared, run_code_p50(backend)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"container tiers, median of {runs} cold starts; run_code p50 of 300 on a live sandbox\n")
    print(f"load average {os.getloadavg()[0]:.2f}\n")
    print(
        "| tier | raw mechanism | create + first output | ratio | + close | ratio "
        "| from a ready spare, + close | ratio | run_code p50 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, raw, first, full, spared, p50 in rows:
        print(
            f"| {name} | {raw * 1e3:.0f} ms | {first * 1e3:.0f} ms | {first / raw:.2f}x "
            f"| {full * 1e3:.0f} ms | {full / raw:.2f}x | {spared * 1e3:.0f} ms | {spared / raw:.2f}x "
            f"| {p50 * 1e3:.2f} ms |"
        )


if __name__ == "__main__":
    main()
