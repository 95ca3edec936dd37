"""Snapshots: a microVM started from its boot image against a cold boot, and what pause,
resume, snapshot and fork cost on the process tier, gVisor and the microVM.

    python bench/snapshots.py [--runs N] [--tiers process,gvisor,microvm] [--first-starts]

Side by side in one run, interleaved (drift hits every row alike):
* microVM cold: ``MicroVMBackend(boot_snapshots=False)``: create + ``run_code("print(1)")``;
* microVM from its boot image, QEMU started at create (``start_ahead=False,
  ready_images=False``): the same, restored from the image (built once, before the runs,
  and not counted);
* microVM from its boot image with a QEMU started ahead (``ready_images=False``): the same,
  once the QEMU the previous start started ahead is ready (waited for, not counted: a create
  that comes sooner starts its own, as the row above);
* microVM from its ready image (the default: a QEMU started ahead too): the boot image
  configured as such a sandbox is and its interpreter started (built in the background after
  the first start, before the runs, not counted);
* the same two ways (boot image with a QEMU started ahead; ready image) for a sandbox with
  rules (a masked program, an argv rule, a write rule) and for one with a variable of the
  caller's, each on a backend of its own;
* per tier: ``snapshot()`` of a sandbox holding a 1 MiB workspace and a started interpreter,
  ``pause()``, ``Sandbox.resume(id)`` + ``run_code``, and a fork: ``Sandbox.create(snapshot=...)``
  + ``run_code``;
* gVisor in both its modes, each a row of its own: as a Docker runtime (``gvisor/docker``, this
  host's default; checkpointed with the engine's runsc state, restored by stockade's runsc)
  and on stockade's own runsc (``gvisor/runsc``); each against its own cold start (create +
  ``run_code``) and its files snapshots (``memory=False``).
* with ``--first-starts`` (the microVM only, instead of the rest): the FIRST start of a
  configuration never seen before (rules with a write path of its own each time; the same
  masks, so the same boot image), interleaved: as it comes (from the boot image, its ready
  image built in the background after it, waited for before the next, not counted), and
  after ``prepare_for`` (a deploy step, a pool's start: counted in a row of its own) built its
  ready image and started a QEMU ahead on it (waited for, not counted).
Prints markdown tables (medians) and the machine's load.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stockade import Limits, Sandbox, SandboxRules, SnapshotStore
from stockade.sandbox import microvm
from stockade.sandbox.base import Backend, SandboxSpec
from stockade.sandbox.gvisor import GVisorBackend

COLD = "microvm cold: create + run_code print(1)"
WARM = "microvm from its boot image, QEMU started at create: create + run_code print(1)"
AHEAD = "microvm from its boot image, QEMU started ahead: create + run_code print(1)"
READY = "microvm from its ready image, QEMU started ahead: create + run_code print(1)"
GVISOR_MODES = ("gvisor/docker", "gvisor/runsc")
RULES = "microvm with rules, from its ready image (the default): create + run_code print(1)"
ENVS = "microvm with a caller's variable, from its ready image (the default): create + run_code print(1)"
RULES_BOOT = "microvm with rules, from the boot image, QEMU started ahead: create + run_code print(1)"
ENVS_BOOT = (
    "microvm with a caller's variable, from the boot image, QEMU started ahead: create + run_code print(1)"
)
FIRST = "microvm, a new configuration's first start, as it comes: create + run_code print(1)"
FIRST_READY = "microvm, a new configuration's first start after prepare_for: create + run_code print(1)"
PREPARE = "microvm: prepare_for a new configuration (its ready image built; a deploy step)"
# A policy of the common kind: a denied program (masked), an argv rule (each exec judged), writes
# to one folder (Landlock).
POLICY = SandboxRules(deny=("curl", "git push"), write=("src/**",))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def first_print(
    backend: microvm.MicroVMBackend,
    *,
    rules: SandboxRules | None = None,
    envs: dict[str, str] | None = None,
) -> float:
    start = time.perf_counter()
    with Sandbox.create("microvm", backend=backend, rules=rules, envs=envs) as sbx:
        sbx.run_code("print(1)")
        return time.perf_counter() - start


@functools.cache
def backend_of(label: str) -> tuple[str, Backend | None]:
    """``gvisor/docker`` and ``gvisor/runsc``: the gVisor tier in that mode (one backend per
    mode for the whole run, as a program keeps one); a tier otherwise."""
    tier, _, mode = label.partition("/")
    if mode == "docker":
        return tier, GVisorBackend(mode="docker")
    if mode == "runsc":
        return tier, GVisorBackend(mode="runsc")
    return tier, None


def cold(name: str, rows: dict[str, list[float]]) -> None:
    tier, backend = backend_of(name)
    start = time.perf_counter()
    with Sandbox.create(tier, backend=backend, limits=Limits(memory_mb=256)) as sbx:
        sbx.run_code("print(1)")
    rows[f"{name} cold: create + run_code"].append(time.perf_counter() - start)


def lifecycle(
    name: str, store: SnapshotStore, rows: dict[str, list[float]], *, memory: bool | None = None
) -> None:
    label = f"{name} (files)" if memory is False else name
    tier, backend = backend_of(name)
    sbx = Sandbox.create(tier, backend=backend, limits=Limits(memory_mb=256))
    try:
        sbx.files.write("data.bin", os.urandom(1 << 20))
        sbx.run_code("x = 41")
        start = time.perf_counter()
        snap = sbx.snapshot(store=store, memory=memory)
        rows[f"{label} snapshot ({snap.kind})"].append(time.perf_counter() - start)
        start = time.perf_counter()
        with Sandbox.create(snapshot=snap, store=store, backend=backend) as fork:
            fork.run_code("print(1)")
            rows[f"{label} fork: create from the snapshot + run_code"].append(time.perf_counter() - start)
        if memory is not False:
            start = time.perf_counter()
            sbx.pause(store=store)
            rows[f"{label} pause"].append(time.perf_counter() - start)
            start = time.perf_counter()
            sbx = Sandbox.resume(sbx.id, store=store, backend=backend)
            sbx.run_code("print(1)")
            rows[f"{label} resume + run_code"].append(time.perf_counter() - start)
        store.delete(snap)
    finally:
        sbx.close()


def microvm_starts(store: SnapshotStore, runs: int, rows: dict[str, list[float]]) -> None:
    """The three ways a microVM starts, interleaved."""
    cold_vm = microvm.MicroVMBackend(boot_snapshots=False)
    warm = microvm.MicroVMBackend(snapshot_store=store, start_ahead=False, ready_images=False)
    ahead = microvm.MicroVMBackend(snapshot_store=store, ready_images=False)
    ready = microvm.MicroVMBackend(snapshot_store=store)
    first_print(warm)  # builds the boot image: once per machine shape, not counted
    first_print(ahead)  # its first QEMU started ahead
    first_print(ready)  # its ready image, built in the background
    ready.wait_ahead(300)
    first_print(ready)  # its QEMU started ahead for the ready image
    # A sandbox with rules, and one with a variable of the caller's (a token, say): from their
    # ready images (the default backend), and from the boot image with a QEMU started ahead
    # (ready images off: how they started before ready images served them). A backend each.
    policy, env = microvm.MicroVMBackend(snapshot_store=store), microvm.MicroVMBackend(snapshot_store=store)
    policy_boot = microvm.MicroVMBackend(snapshot_store=store, ready_images=False)
    env_boot = microvm.MicroVMBackend(snapshot_store=store, ready_images=False)
    for backend in (policy, policy_boot):
        first_print(backend, rules=POLICY)
    for backend in (env, env_boot):
        first_print(backend, envs={"API_TOKEN": "secret"})
    for backend in (policy, env, policy_boot, env_boot):
        backend.wait_ahead(300)
    if warm._boot_failed or ready._boot_failed or ready._ready.refused:
        raise SystemExit(f"no boot or ready image: {warm._boot_failed} {ready._ready.refused}")
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    try:
        for _ in range(runs):
            rows.setdefault(COLD, []).append(first_print(cold_vm))
            rows.setdefault(WARM, []).append(first_print(warm))
            for name, backend in ((AHEAD, ahead), (READY, ready)):
                if backend.wait_ahead(60) is None:
                    raise SystemExit("no QEMU was started ahead")
                rows.setdefault(name, []).append(first_print(backend))
            for name, backend in ((RULES_BOOT, policy_boot), (RULES, policy)):
                backend.wait_ahead(60)
                rows.setdefault(name, []).append(first_print(backend, rules=POLICY))
            for name, backend in ((ENVS_BOOT, env_boot), (ENVS, env)):
                backend.wait_ahead(60)
                rows.setdefault(name, []).append(first_print(backend, envs={"API_TOKEN": "secret"}))
    finally:
        for backend in (ahead, ready, policy, env, policy_boot, env_boot):
            backend.close()


def first_starts(store: SnapshotStore, runs: int, rows: dict[str, list[float]]) -> None:
    """A new configuration's first start, as it comes and after ``prepare_for``, interleaved."""
    backend = microvm.MicroVMBackend(snapshot_store=store)
    first_print(backend, rules=POLICY)  # the boot image of these rules' machine (their masks)
    backend.wait_ahead(300)
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    try:
        for i in range(runs):
            # Each its own configuration: a write path never asked for before (the masks stay).
            asis = SandboxRules(deny=POLICY.deny, write=(f"first-{i}/**",))
            prepared = SandboxRules(deny=POLICY.deny, write=(f"ahead-{i}/**",))
            rows.setdefault(FIRST, []).append(first_print(backend, rules=asis))
            backend.wait_ahead(300)  # its ready image, built in the background: not counted
            start = time.perf_counter()
            made = backend.prepare_for(SandboxSpec(rules=prepared))
            rows.setdefault(PREPARE, []).append(time.perf_counter() - start)
            if made != "ready image":
                raise SystemExit(f"prepare_for made no ready image: {made} {backend._ready.refused}")
            backend.wait_ahead(60)  # the QEMU it started ahead on the image (a deploy step's, long ready)
            rows.setdefault(FIRST_READY, []).append(first_print(backend, rules=prepared))
            backend.wait_ahead(300)
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tiers", default="process,microvm")
    parser.add_argument("--first-starts", action="store_true", help="only a new configuration's first start")
    args = parser.parse_args()
    if args.first_starts:
        args.tiers = ""
    named = [tier for tier in args.tiers.split(",") if tier]
    tiers = [t for tier in named for t in (GVISOR_MODES if tier == "gvisor" else (tier,))]
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["STOCKADE_SNAPSHOT_DIR"] = tmp  # the tiers' own boot images too, gone after
        store = SnapshotStore(Path(tmp))
        rows: dict[str, list[float]] = {}
        if args.first_starts:
            first_starts(store, args.runs, rows)
        if "microvm" in tiers:
            microvm_starts(store, args.runs, rows)
        for _ in range(args.runs):
            for tier in tiers:
                kinds: tuple[bool | None, ...] = (None, False) if tier in GVISOR_MODES else (None,)
                if tier in GVISOR_MODES:
                    rows.setdefault(f"{tier} cold: create + run_code", [])
                    cold(tier, rows)
                for memory in kinds:
                    label = f"{tier} (files)" if memory is False else tier
                    kept = "files" if tier == "process" or memory is False else "memory"
                    rows.setdefault(f"{label} snapshot ({kept})", [])
                    rows.setdefault(f"{label} fork: create from the snapshot + run_code", [])
                    if memory is not False:
                        rows.setdefault(f"{label} pause", [])
                        rows.setdefault(f"{label} resume + run_code", [])
                    lifecycle(tier, store, rows, memory=memory)
    report(rows, tiers, args.runs)


def report(rows: dict[str, list[float]], tiers: list[str], runs: int) -> None:
    load = os.getloadavg()
    print(f"{runs} runs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    print("| measurement | median | min | max |")
    print("|---|---|---|---|")
    for name, values in rows.items():
        if values:
            med, low, high = statistics.median(values), min(values), max(values)
            print(f"| {name} | {med * 1000:.0f} ms | {low * 1000:.0f} ms | {high * 1000:.0f} ms |")
    if "microvm" in tiers:
        cold_med = statistics.median(rows[COLD])
        for name in (WARM, AHEAD, READY, RULES_BOOT, RULES, ENVS_BOOT, ENVS):
            med, under = statistics.median(rows[name]), sum(v < 0.5 for v in rows[name])
            print(f"\n{name}: {cold_med / med:.1f}x faster than cold; {under}/{len(rows[name])} under 0.5 s")
    for name in (FIRST, FIRST_READY):
        if rows.get(name):
            print(f"\n{name}: {sum(v < 0.5 for v in rows[name])}/{len(rows[name])} under 0.5 s")


if __name__ == "__main__":
    main()
