"""What a policy's masks cost a microVM's cold boot: a denial masks a few programs, an
allowlist every unlisted program of the image (~300), all mounted by one process in the
guest's init (two busybox mounts each took 6-20 s more of a boot under TCG).

    python bench/microvm_masks.py [--runs N]

Cold boots only (no boot image, no ready image, nothing started ahead), the two policies
alternated: wall time of create + the first command, and QEMU's CPU time (all its threads) until the first
command answered, which the host's other load moves less. Prints a markdown table (medians).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from stockade import Limits, Sandbox, SandboxRules
from stockade.sandbox import microvm

POLICIES = {
    "deny uname": SandboxRules(deny=("uname",)),
    "allow ls, cat, python3, true": SandboxRules(allow=("ls", "cat", "python3", "true")),
}


def _qemu_cpu_s(sandbox_id: str) -> float:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"qemu" in cmdline.split(b"\0")[0] and sandbox_id.encode() in cmdline:
            tasks = proc / "task"
            return sum(int((t / "schedstat").read_text().split()[0]) for t in tasks.iterdir()) / 1e9
    raise LookupError(f"no QEMU for {sandbox_id}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    backend = microvm.MicroVMBackend(boot_snapshots=False, ready_images=False, start_ahead=False)
    limits = Limits(memory_mb=256, timeout_s=30, pids=64)
    wall: dict[str, list[float]] = {name: [] for name in POLICIES}
    cpu: dict[str, list[float]] = {name: [] for name in POLICIES}
    try:
        for _ in range(args.runs):
            for name, rules in POLICIES.items():
                began = time.perf_counter()
                with Sandbox.create("microvm", backend=backend, limits=limits, rules=rules) as sandbox:
                    sandbox.commands.run(["true"])  # what a user waits for: the first answer too
                    wall[name].append(time.perf_counter() - began)
                    cpu[name].append(_qemu_cpu_s(sandbox.id))
    finally:
        backend.close()
    print("| policy | create + first command, wall | QEMU's CPU to the first command |")
    print("|---|---|---|")
    for name in POLICIES:
        print(f"| {name} | {statistics.median(wall[name]):.2f} s | {statistics.median(cpu[name]):.2f} s |")


if __name__ == "__main__":
    main()
