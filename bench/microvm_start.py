"""One microVM start from its boot image, step by step: where the time goes.

    python bench/microvm_start.py [--runs N]

Each run goes through the steps ``MicroVMBackend.start`` takes from a boot image, timed one by
one, with the CPU time QEMU used in each (all its threads) and how many blocks of guest code
TCG had translated by the end of it (QMP ``info jit``):

* QEMU started (the exec chain, QEMU's own start, its monitor's greeting) and the image's
  device state loaded (``-incoming defer``, ``migrate-incoming``): the part a QEMU started
  ahead takes off a start;
* ``cont`` and the reseed (the guest runs for the first time: its root helper's answer);
* the supervisor's handshake (its configuration, ``ready``);
* the first ``run_code("print(1)")`` (the interpreter process forked, the code compiled and run).

Then ``run_code`` again, to show what the first one paid for (translating code TCG had not
seen in this QEMU). The same, interleaved, from the ready image (the boot image configured,
its interpreter started): cont and reseed, the interpreter told to reseed, the first run.
The images are built before the runs (in a temporary store) and not counted. Prints
markdown tables (medians, min-max) and the load average.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from stockade import SnapshotStore
from stockade.sandbox import _guest, _rules, microvm
from stockade.sandbox._microvm_instance import VMBoundary
from stockade.sandbox._microvm_launch import Launch
from stockade.sandbox._microvm_settings import START_TIMEOUT_S
from stockade.sandbox._supervised_config import sandbox_id, supervisor_config
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.ops import RunCode

STEPS = (
    "QEMU started, its monitor up",
    "device state loaded (guest stopped)",
    "cont + reseed (the guest's first run)",
    "handshake (configuration, ready)",
    "first run_code print(1)",
    "second run_code print(1)",
)


def qemu_cpu_ms(pid: int) -> float:
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/schedstat") as fh:
            total += int(fh.read().split()[0])
    return total / 1e6


class Timeline:
    """One start's steps: {step: (wall ms, QEMU CPU ms, blocks translated so far)}."""

    def __init__(self, boundary: VMBoundary) -> None:
        self.monitor = boundary.monitor()
        deadline = time.monotonic() + 10
        while (pid := boundary.qemu_pid()) is None and time.monotonic() < deadline:
            time.sleep(0.001)  # its jail starts it a few milliseconds after the launch
        assert pid is not None, "QEMU is not running in its jail"
        self.pid = pid
        self.out: dict[str, tuple[float, float, int]] = {}
        self.cpu = 0.0
        self.last = time.perf_counter()

    def step(self, name: str) -> None:
        now, used = time.perf_counter(), qemu_cpu_ms(self.pid)
        jit = self.monitor.command("human-monitor-command", command_line="info jit")
        found = re.search(r"TB count\s+(\d+)", str(jit))
        self.out[name] = ((now - self.last) * 1000, used - self.cpu, int(found.group(1)) if found else -1)
        self.last, self.cpu = time.perf_counter(), used  # the question to QEMU is not counted


def launch(
    backend: microvm.MicroVMBackend, spec: SandboxSpec, masks: tuple[str, ...], ram: Path, device: Path
) -> tuple[VMBoundary, Any, Timeline, float]:
    """QEMU started on an image, its state loaded and its guest stopped (two steps timed)."""
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    start = time.perf_counter()
    boundary, stream = backend._launch(
        spec, sandbox_id(spec), masks, Launch(ram=ram, incoming=True, fds=(fd,))
    )
    timeline = Timeline(boundary)
    timeline.last = start
    timeline.step(STEPS[0])
    timeline.monitor.load(fd, ignore_shared=True, run=False)
    os.close(fd)
    timeline.step(STEPS[1])
    return boundary, stream, timeline, start


def one_start(backend: microvm.MicroVMBackend) -> dict[str, tuple[float, float, int]]:
    """{step: (wall ms, QEMU CPU ms, blocks translated so far)}"""
    spec = SandboxSpec()
    enforcement = backend._plan(spec)
    rules = _rules.plan(spec, root=backend.rootfs, can_mask=True, can_confine=True)
    boot = backend._boot_image(spec, rules.masks)
    assert boot is not None, backend._boot_failed
    boundary, stream, timeline, start = launch(backend, spec, rules.masks, *boot)
    instance = backend._instance(
        boundary.rundir.name.removeprefix("vm-"),
        spec=spec,
        enforcement=enforcement,
        boundary=boundary,
        stream=stream,
        masks=rules.masks,
    )
    try:
        timeline.monitor.command("cont")
        boundary.reseed()
        timeline.step(STEPS[2])
        config = supervisor_config(spec, _guest.own_kernel_limits(spec).rlimits, None)
        config["report_oom"] = True
        instance.handshake(config, START_TIMEOUT_S, rules)
        timeline.step(STEPS[3])
        first_runs(instance, timeline, start, STEPS[4:])
    finally:
        instance.close()
    return timeline.out


def first_runs(instance: Any, timeline: Timeline, start: float, steps: tuple[str, ...]) -> None:
    """The first run_code and the second (what the first paid for), and the total."""
    instance.execute(RunCode(code="print(1)"))
    total = (time.perf_counter() - start) * 1000
    timeline.step(steps[0])
    instance.execute(RunCode(code="print(1)"))
    timeline.step(steps[1])
    timeline.out["create + first print(1), as timed here"] = (total, qemu_cpu_ms(timeline.pid), 0)


READY_STEPS = (
    "QEMU started, its monitor up",
    "device state loaded (guest stopped)",
    "cont + reseed (the guest's first run)",
    "the interpreter told to reseed",
    "first run_code print(1)",
    "second run_code print(1)",
)


def ready_start(backend: microvm.MicroVMBackend) -> dict[str, tuple[float, float, int]]:
    """The same from the ready image: no handshake, the interpreter already there."""
    spec = SandboxSpec()
    rules = _rules.plan(spec, root=backend.rootfs, can_mask=True, can_confine=True)
    enforcement = backend._plan(spec)
    config = backend._config(spec)
    name = backend._ready.name(backend._machine_key(spec, rules.masks), config, rules, enforcement)
    ready = backend._ready.find(backend.snapshot_store, name, refused=lambda: None)
    assert ready is not None, backend._ready.refused
    boundary, stream, timeline, start = launch(backend, spec, rules.masks, ready.ram, ready.device)
    instance = backend._instance(
        boundary.rundir.name.removeprefix("vm-"),
        spec=spec,
        enforcement=enforcement,
        boundary=boundary,
        stream=stream,
        masks=rules.masks,
    )
    try:
        timeline.monitor.command("cont")
        boundary.reseed()
        timeline.step(READY_STEPS[2])
        instance.reseed()
        timeline.step(READY_STEPS[3])
        first_runs(instance, timeline, start, READY_STEPS[4:])
    finally:
        instance.close()
    return timeline.out


def table(title: str, runs: list[dict[str, tuple[float, float, int]]]) -> None:
    print(f"\n{title}\n")
    print("| step | wall ms | QEMU CPU ms | blocks translated (total) |")
    print("|---|---|---|---|")
    for name in runs[0]:
        wall = [r[name][0] for r in runs]
        cpu = [r[name][1] for r in runs]
        blocks = statistics.median(r[name][2] for r in runs)
        print(
            f"| {name} | {statistics.median(wall):.0f} ({min(wall):.0f}-{max(wall):.0f}) "
            f"| {statistics.median(cpu):.0f} | {blocks:.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = SnapshotStore(Path(tmp))
        backend = microvm.MicroVMBackend(snapshot_store=store, start_ahead=False, ready_images=False)
        builder = microvm.MicroVMBackend(snapshot_store=store, start_ahead=False)
        backend.start(SandboxSpec()).close()  # builds the boot image: not counted
        builder.start(SandboxSpec()).close()  # and the ready image, in the background
        builder.wait_ahead(300)
        before = os.getloadavg()
        runs, ready = [], []
        for _ in range(args.runs):  # interleaved
            runs.append(one_start(backend))
            ready.append(ready_start(builder))
    after = os.getloadavg()
    print(f"{args.runs} runs each, interleaved, load average {before[0]:.1f} -> {after[0]:.1f}")
    table("From the boot image", runs)
    table("From the ready image", ready)


if __name__ == "__main__":
    main()
