"""Commands through the shim server against commands whose shim is a fork of the supervisor
(the command path before the server, which the supervisor falls back to), side by side in one
run: two sandboxes of the process tier, one told to start no server (``shim_server: false`` in
its configuration, as gVisor's supervisor tells itself), their calls interleaved.

Each sandbox is born in a cgroup v1 ``cpuacct`` group of its own (as in policy_inside.py), so
its CPU is all of its processes' (supervisor, server, zygote, shims, commands, interpreters).
Rows: a command's wall time (p50) and CPU; the supervisor's minor page faults a command (its
``/proc/1/stat``, read by a command before and after); a pool's cycle (reset in place, then a
``run_code``, without a policy), which runs no command but checks the server at each reset; a cold start
(create, first command, close) and its CPU.

    python bench/shim_server.py [commands] [none|policy]   # prints a markdown table
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

from stockade import Limits, Sandbox
from stockade.sandbox import process
from stockade.types import SandboxRules

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from policy_inside import CpuGroups, cpu_groups

RULES = SandboxRules(
    deny=("curl", "wget", "nc", "ssh", "scp", "sudo", "su", "telnet", "ftp", "socat"),
    approve=("rm -r", "git push", "pip install"),
    write=("src/**", "tests/**"),
)
VARIANTS = ("fork", "server")
NO_SERVER = {"on": False}


def _config(original: Any) -> Any:
    def config(*args: Any, **kwargs: Any) -> dict[str, Any]:
        made = dict(original(*args, **kwargs))
        if NO_SERVER["on"]:
            made["shim_server"] = False
        return made

    return config


process.supervisor_config = _config(process.supervisor_config)  # type: ignore[attr-defined]


def create(name: str, rules: SandboxRules | None) -> Sandbox:
    NO_SERVER["on"] = name == "fork"
    try:
        return Sandbox.create("process", limits=Limits(timeout_s=30), rules=rules)
    finally:
        NO_SERVER["on"] = False


def faults(sbx: Sandbox) -> int:
    stat = sbx.commands.run("cat /proc/1/stat").stdout
    return int(stat[stat.rindex(")") + 2 :].split()[7])


def commands(boxes: dict[str, Sandbox], groups: CpuGroups, count: int) -> dict[str, dict[str, float]]:
    """A command's wall time and CPU, and the supervisor's faults, per variant, interleaved."""
    for sbx in boxes.values():
        for _ in range(20):  # warm: the first commands load what every later one uses
            sbx.commands.run("true")
    walls: dict[str, list[float]] = {n: [] for n in VARIANTS}
    cpu = {n: 0.0 for n in VARIANTS}
    before = {n: faults(b) for n, b in boxes.items()}
    for _ in range(count):
        for name, sbx in boxes.items():
            used = groups.used(name)
            started = time.perf_counter()
            sbx.commands.run("true")
            walls[name].append(time.perf_counter() - started)
            cpu[name] += groups.used(name) - used
    after = {n: faults(b) for n, b in boxes.items()}
    return {
        n: {
            "command, p50": statistics.median(walls[n]) * 1000,
            "command, CPU (the sandbox's)": cpu[n] / count * 1000,
            "faults": (after[n] - before[n]) / count,
        }
        for n in VARIANTS
    }


def cycles(boxes: dict[str, Sandbox], groups: CpuGroups, count: int) -> dict[str, dict[str, float]]:
    """A pool's cycle, a reset in place and a run_code, per variant, interleaved."""
    walls: dict[str, list[float]] = {n: [] for n in VARIANTS}
    cpu = {n: 0.0 for n in VARIANTS}
    for _ in range(count):
        for name, sbx in boxes.items():
            used = groups.used(name)
            started = time.perf_counter()
            sbx.reset()
            sbx.run_code("print(1)")
            walls[name].append(time.perf_counter() - started)
            cpu[name] += groups.used(name) - used
    return {
        n: {
            "reset + run_code, p50": statistics.median(walls[n]) * 1000,
            "reset + run_code, CPU": cpu[n] / count * 1000,
        }
        for n in VARIANTS
    }


def cold_starts(groups: CpuGroups, rules: SandboxRules | None, rounds: int) -> dict[str, dict[str, float]]:
    """Create, first command and close, per variant, alternated."""
    walls: dict[str, list[float]] = {n: [] for n in VARIANTS}
    cpu: dict[str, list[float]] = {n: [] for n in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            used = groups.enter(name) or 0.0
            started = time.perf_counter()
            with create(name, rules) as fresh:
                fresh.commands.run("true")
            walls[name].append(time.perf_counter() - started)
            cpu[name].append(groups.leave(name) - used)
    return {
        n: {
            "cold start, p50": statistics.median(walls[n]) * 1000,
            "cold start, CPU": statistics.median(cpu[n]) * 1000,
        }
        for n in VARIANTS
    }


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    rules = RULES if len(sys.argv) > 2 and sys.argv[2] == "policy" else None
    load = os.getloadavg()[0]
    rows: dict[str, dict[str, float]] = {n: {} for n in VARIANTS}
    with cpu_groups(list(VARIANTS)) as groups:
        if not groups.folders:
            sys.exit("needs root and a cgroup v1 cpuacct hierarchy")
        boxes: dict[str, Sandbox] = {}
        try:
            for name in VARIANTS:
                groups.enter(name)
                boxes[name] = create(name, rules)
                groups.leave(name)
            # Under a policy every reset execs a fresh supervisor: no pool cycle measured there.
            parts = [commands(boxes, groups, count)] + (
                [cycles(boxes, groups, count // 4)] if rules is None else []
            )
            for part in parts:
                for name in VARIANTS:
                    rows[name].update(part[name])
        finally:
            for sbx in boxes.values():
                sbx.close()
        for name, found in cold_starts(groups, rules, 20).items():
            rows[name].update(found)
    print(f"process tier, {'policy' if rules else 'no policy'}, {count} commands each, load {load:.2f}\n")
    print("| | shim forked by the supervisor | shim from the server | server vs fork |")
    print("|---|---|---|---|")
    for what in rows["fork"]:
        a, b = rows["fork"][what], rows["server"][what]
        unit = "" if what == "faults" else " ms"
        label = "supervisor's page faults a command" if what == "faults" else what
        print(f"| {label} | {a:.2f}{unit} | {b:.2f}{unit} | {b / a:.3f}x |")


if __name__ == "__main__":
    main()
