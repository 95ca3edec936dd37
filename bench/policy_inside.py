"""What enforcing a policy inside the sandbox costs: a command, and a cold start, with a
20-rule policy against none, side by side in one run (interleaved, so that the machine's
load falls on both alike).

The policy: 10 programs denied (masked, and judged at each exec), 6 argv patterns that need
approval, 4 more denied with arguments, and write rules (Landlock). A command is what an
agent runs most: ``commands.run("true")`` (one exec, the shell's), and a small pipeline
(three execs). Cold start is ``Sandbox.create``, its first command's output back, and its
close; its host part is also given as CPU time (this process's and bwrap's, which a loaded
machine stretches far less than wall time; the sandbox's own processes are killed at close,
never reaped by us, so they are not in it).

The policy runs twice: with the compiled exec judge (the default where the host has a C
compiler: the execs the rules allow whatever their arguments never wake Python) and with every
exec judged in Python (``STOCKADE_EXEC_JUDGE=python``), both interleaved with no policy.

    python bench/policy_inside.py [tier] [rounds]     # prints a markdown table
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections.abc import Callable

from stockade import Limits, Sandbox
from stockade.types import SandboxRules

RULES = SandboxRules(
    deny=(
        "curl", "wget", "nc", "ssh", "scp", "sudo", "su", "telnet", "ftp", "socat",
        "git push -f", "pip install --index-url", "npm publish", "docker run",
    ),
    approve=("rm -r", "git push", "pip install", "npm install", "apt-get install", "chmod -R"),
    write=("src/**", "tests/**", "build/**"),
)  # fmt: skip
LIMITS = Limits(timeout_s=30)
PIPELINE = "ls / | grep -c usr | cat"
WHAT = ("command", "pipeline", "an exec, in a loop of 100", "cold start", "cold start, host CPU")
LOOP = "i=0; while [ $i -lt 100 ]; do /bin/true $i; i=$((i+1)); done"


def p50(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


VARIANTS: dict[str, SandboxRules | None] = {"none": None, "python": RULES, "policy": RULES}


def create(tier: str, name: str) -> Sandbox:
    """A sandbox of the variant ``name``: "python" judges every exec in Python."""
    if name == "python":
        os.environ["STOCKADE_EXEC_JUDGE"] = "python"
    try:
        return Sandbox.create(tier, limits=LIMITS, rules=VARIANTS[name])
    finally:
        os.environ.pop("STOCKADE_EXEC_JUDGE", None)


def measure(tier: str, rounds: int) -> dict[str, dict[str, list[float]]]:
    found: dict[str, dict[str, list[float]]] = {name: {what: [] for what in WHAT} for name in VARIANTS}
    sandboxes = {name: create(tier, name) for name in VARIANTS}
    # The supervisor's threads (the compiled judge is one): on the tiers where it is PID 1.
    threads = {
        name: sbx.commands.run("ls /proc/1/task | wc -l").stdout.strip() for name, sbx in sandboxes.items()
    }
    print(f"supervisor threads: {threads}")
    try:
        for _ in range(rounds):
            for name, sbx in sandboxes.items():  # interleaved: the same load on both
                found[name]["command"].append(timed(lambda s=sbx: s.commands.run("true")))
                found[name]["pipeline"].append(timed(lambda s=sbx: s.commands.run(PIPELINE)))
                if len(found[name]["pipeline"]) % 10 == 1:  # the judge alone, without the round trip
                    found[name]["an exec, in a loop of 100"].append(
                        timed(lambda s=sbx: s.commands.run(LOOP)) / 100
                    )
        for _ in range(max(10, rounds // 5)):
            for name in VARIANTS:
                cpu = cpu_time()
                found[name]["cold start"].append(timed(lambda n=name: cold_start(tier, n)))
                found[name]["cold start, host CPU"].append(cpu_time() - cpu)
    finally:
        for sbx in sandboxes.values():
            sbx.close()
    return found


def cold_start(tier: str, name: str) -> None:
    with create(tier, name) as fresh:
        fresh.commands.run("true")


def cpu_time() -> float:
    """CPU seconds of this process and of the children it reaped (bwrap, setpriv)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def main() -> None:
    tier = sys.argv[1] if len(sys.argv) > 1 else "process"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    before = os.getloadavg()[0]
    found = measure(tier, rounds)
    print(f"load average (1 min) {before:.2f} before, {os.getloadavg()[0]:.2f} after\n")
    print(
        f"| {tier} tier, p50 | no policy | policy, Python judge | policy, compiled judge "
        "| Python judge vs none | compiled judge vs none |"
    )
    print("|---|---|---|---|---|---|")
    for what in WHAT:
        none, python, policy = (p50(found[name][what]) for name in ("none", "python", "policy"))
        versus = [f"{got / none:.3f}x / {got - none:+.2f} ms" for got in (python, policy)]
        print(f"| {what} | {none:.2f} ms | {python:.2f} ms | {policy:.2f} ms | {versus[0]} | {versus[1]} |")


if __name__ == "__main__":
    main()
