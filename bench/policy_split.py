"""Where a command's extra time under a policy goes: the same commands on two sandboxes of
the process tier side by side (no policy, the 20-rule policy of ``policy_inside.py``), in
blocks alternated between them, and for each block, read from the host: the CPU of each of
the supervisor's threads (its main thread, and the compiled judge's where it runs) from
``/proc/PID/task/TID/schedstat``, their context switches (voluntary, involuntary) and page
faults, the whole sandbox's CPU (a cpuacct group per sandbox, cgroup v1), and this
process's own CPU (the host's part: the request, the frames, the records parsed).

    python bench/policy_split.py [blocks] [commands a block] [command]   # prints a table

Run as root (the cpuacct groups); the figures are per command, medians over the blocks.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time

from policy_inside import LIMITS, RULES, cpu_groups

from stockade import Sandbox
from stockade.types import SandboxRules

# The policy, and its two halves: its write rules alone (Landlock in each shim) and its
# command rules alone (the listener and the judge).
SPLITS: dict[str, SandboxRules | None] = {
    "none": None,
    "policy": RULES,
    "writes": SandboxRules(write=RULES.write),
    "commands": SandboxRules(deny=RULES.deny, approve=RULES.approve),
}
VARIANTS = {name: SPLITS[name] for name in ("none", "policy")}


def supervisor_pid(group: str) -> int:
    """The sandbox's init (its NSpid ends in 1) among the processes of its cpuacct group."""
    with open(f"{group}/cgroup.procs") as fh:
        pids = [int(line) for line in fh if line.strip()]
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as fh:
                status = dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)
        except OSError:
            continue
        nspid = status.get("NSpid", "").split()
        if len(nspid) > 1 and nspid[-1] == "1" and status.get("Name", "").startswith("python"):
            return pid
    raise RuntimeError(f"no supervisor in {group}")


def threads(pid: int) -> dict[str, tuple[float, ...]]:
    """Per thread (the first is the main one, named "main"; the others "judge"): CPU ns,
    voluntary and involuntary switches, minor faults."""
    out: dict[str, tuple[float, ...]] = {}
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        base = f"/proc/{pid}/task/{tid}"
        with open(f"{base}/schedstat") as fh:
            ns = int(fh.read().split()[0])
        with open(f"{base}/status") as fh:
            status = dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)
        with open(f"{base}/stat") as fh:
            stat = fh.read()
        minflt = int(stat[stat.rindex(")") + 2 :].split()[7])
        name = "main" if tid == pid else "judge"
        out[name] = (
            ns / 1e3,
            float(status["voluntary_ctxt_switches"]),
            float(status["nonvoluntary_ctxt_switches"]),
            float(minflt),
        )
    return out


def own_cpu_us() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return (used.ru_utime + used.ru_stime) * 1e6


FIELDS = ("cpu us", "voluntary", "involuntary", "faults")


def measure(command: str, blocks: int, per_block: int) -> dict[str, dict[str, list[float]]]:
    """Per variant, per figure: its value per command in each block."""
    found: dict[str, dict[str, list[float]]] = {name: {} for name in VARIANTS}
    with cpu_groups(list(VARIANTS)) as groups:
        if not groups.folders:
            raise SystemExit("needs cgroup v1's cpuacct and root")
        sandboxes: dict[str, Sandbox] = {}
        try:
            for name, rules in VARIANTS.items():
                groups.enter(name)
                sandboxes[name] = Sandbox.create("process", limits=LIMITS, rules=rules)
                groups.leave(name)
            pids = {name: supervisor_pid(groups.folders[name]) for name in VARIANTS}
            for sbx in sandboxes.values():
                for _ in range(20):  # warm
                    sbx.commands.run(command)
            for _ in range(blocks):
                for name, sbx in sandboxes.items():
                    t0, g0, h0 = threads(pids[name]), groups.used(name), own_cpu_us()
                    w0 = time.perf_counter()
                    for _ in range(per_block):
                        sbx.commands.run(command)
                    wall = (time.perf_counter() - w0) * 1e6
                    t1, g1, h1 = threads(pids[name]), groups.used(name), own_cpu_us()
                    block = {"wall us": wall, "sandbox cpu us": (g1 - g0) * 1e6, "host cpu us": h1 - h0}
                    for thread, now in t1.items():
                        was = t0.get(thread, (0.0,) * len(FIELDS))
                        block.update({f"{thread} {f}": now[i] - was[i] for i, f in enumerate(FIELDS)})
                    for what, value in block.items():
                        found[name].setdefault(what, []).append(value / per_block)
        finally:
            for sbx in sandboxes.values():
                sbx.close()
    return found


def main() -> None:
    blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    # The process tier's sandboxes forked from its template are not our children: their CPU
    # would go to the cpuacct group the template was born in, not to each variant's.
    os.environ.setdefault("STOCKADE_PROCESS_START", "exec")
    per_block = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    command = sys.argv[3] if len(sys.argv) > 3 else "true"
    if len(sys.argv) > 4:  # e.g. none,writes,commands,policy
        VARIANTS.clear()
        VARIANTS.update({name: SPLITS[name] for name in sys.argv[4].split(",")})
    before_load = os.getloadavg()[0]
    found = measure(command, blocks, per_block)
    print(f"load average (1 min) {before_load:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(
        f"{blocks} blocks of {per_block} `{command}` a variant, alternated; per command, medians of blocks\n"
    )
    others = [name for name in VARIANTS if name != "none"]
    print("| per command | no policy | " + " | ".join(f"{name}, over none" for name in others) + " |")
    print("|---|---|" + "---|" * len(others))
    for what in found[others[-1]]:
        none = statistics.median(found["none"][what]) if what in found["none"] else 0.0
        cells = []
        for name in others:
            got = statistics.median(found[name][what]) if what in found[name] else 0.0
            cells.append(f"{got:.1f} ({got - none:+.1f})")
        print(f"| {what} | {none:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
