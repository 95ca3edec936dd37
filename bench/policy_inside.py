"""What enforcing a policy inside the sandbox costs: a command, and a cold start, with a
20-rule policy against none, side by side in one run (interleaved, so that the machine's
load falls on both alike; each variant after each other as often; six sandboxes of each,
taken in turn, since two sandboxes of one variant differ by up to 7% on a command).

The policy: 10 programs denied (masked, and judged at each exec), 6 argv patterns that need
approval, 4 more denied with arguments, and write rules (Landlock). A command is what an
agent runs most: ``commands.run("true")`` (one exec, the shell's), and a small pipeline
(three execs). Cold start is ``Sandbox.create``, its first command's output back, and its
close; its host part is also given as CPU time (this process's and bwrap's, which a loaded
machine stretches far less than wall time; the sandbox's own processes are killed at close,
never reaped by us, so they are not in it), and so is all of its CPU, the sandbox's
included, where the host has cgroup v1's cpuacct (``CpuGroups``).

The policy runs twice: with the compiled exec judge (the default where the host has a C
compiler: the execs the rules allow whatever their arguments never wake Python) and with every
exec judged in Python (``STOCKADE_EXEC_JUDGE=python``), both interleaved with no policy.

    python bench/policy_inside.py [tier] [rounds]     # prints a markdown table

The process tier's sandboxes start here as bubblewrap execs them (``exec``), so that their CPU
is theirs to count; ``STOCKADE_PROCESS_START=template`` measures the default start (a fork of
the backend's warm template), without the CPU rows.
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator

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
WHAT = (
    "command",
    "command, all CPU",
    "pipeline",
    "an exec, in a loop of 100",
    "cold start",
    "cold start, host CPU",
    "cold start, all CPU",
)
CPUACCT = "/sys/fs/cgroup/cpuacct"  # cgroup v1's CPU accounting, where the host has it
LOOP = "i=0; while [ $i -lt 100 ]; do /bin/true $i; i=$((i+1)); done"
SANDBOXES = 6  # of each variant, taken in turn


def p50(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


VARIANTS: dict[str, SandboxRules | None] = {
    "none": None,
    "python": RULES,
    "policy": RULES,
}


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
    if os.environ.get("STOCKADE_PROCESS_START") == "template":
        run(tier, rounds, found, CpuGroups({}))  # forks of the template: not our CPU to count
        return found
    with cpu_groups(list(VARIANTS)) as groups:
        run(tier, rounds, found, groups)
    return found


def turned(names: list[str], round_: int) -> list[str]:
    """The variants in the order of this round: a variant's work can outlast its reply (the
    Python judge's), and what always ran after it would pay for it. Turning one order does
    not change who follows whom (none, python, policy, none...): every other round runs the
    order backwards, and each turns, so that each variant follows each other as often."""
    order = names if round_ % 2 == 0 else names[::-1]
    turn = round_ // 2 % len(names)
    return order[turn:] + order[:turn]


def run(tier: str, rounds: int, found: dict[str, dict[str, list[float]]], groups: CpuGroups) -> None:
    sandboxes: dict[str, list[Sandbox]] = {name: [] for name in VARIANTS}
    try:
        for _ in range(SANDBOXES):
            for name in VARIANTS:  # each born in its variant's group (where the host has them)
                groups.enter(name)
                sandboxes[name].append(create(tier, name))
                groups.leave(name)
        # The supervisor's threads (the compiled judge is one): on the tiers where it is PID 1.
        threads = {
            name: group[0].commands.run("ls /proc/1/task | wc -l").stdout.strip()
            for name, group in sandboxes.items()
        }
        print(f"supervisor threads: {threads}")
        for group in sandboxes.values():
            for sbx in group:
                for _ in range(5):  # the first commands of a sandbox are not its usual ones
                    sbx.commands.run("true")
        commands(sandboxes, rounds, found, groups)
        for round_ in range(max(10, rounds // 5)):
            for name in turned(list(VARIANTS), round_):
                cpu = cpu_time()
                used = groups.enter(name)
                found[name]["cold start"].append(timed(lambda n=name: cold_start(tier, n)))
                found[name]["cold start, host CPU"].append(cpu_time() - cpu)
                if used is not None:  # all of it: the sandbox's, bwrap's and ours
                    found[name]["cold start, all CPU"].append(groups.leave(name) - used)
    finally:
        for group in sandboxes.values():
            for sbx in group:
                sbx.close()


Found = dict[str, dict[str, list[float]]]  # variant -> row -> samples (s)


def commands(sandboxes: dict[str, list[Sandbox]], rounds: int, found: Found, groups: CpuGroups) -> None:
    """The command rows. Each round on the next of each variant's sandboxes: two sandboxes of
    one variant differ by up to 7% on a command (where their memory lies), as much as is
    measured here; the p50 in each is printed."""
    per_sandbox: dict[str, list[list[float]]] = {name: [[] for _ in range(SANDBOXES)] for name in sandboxes}
    for round_ in range(rounds):
        at = round_ % SANDBOXES
        for name in turned(list(sandboxes), round_):
            sbx = sandboxes[name][at]
            cpu = cpu_time() + groups.used(name)
            took = timed(lambda s=sbx: s.commands.run("true"))
            found[name]["command"].append(took)
            per_sandbox[name][at].append(took)
            if groups.folders:  # the sandbox's CPU and ours: what a loaded machine stretches least
                found[name]["command, all CPU"].append(cpu_time() + groups.used(name) - cpu)
            found[name]["pipeline"].append(timed(lambda s=sbx: s.commands.run(PIPELINE)))
            if len(found[name]["pipeline"]) % 10 == 1:  # the judge alone, without the round trip
                looped = timed(lambda s=sbx: s.commands.run(LOOP))
                found[name]["an exec, in a loop of 100"].append(looped / 100)
    spread = {name: [f"{p50(got):.2f}" for got in per_sandbox[name]] for name in sandboxes}
    print(f"a command's p50 (ms) in each sandbox of a variant: {spread}")


class CpuGroups:
    """A cpuacct group per variant: a cold start is made with this thread in its variant's
    group, so that what it starts (bwrap, the supervisor, the command) is born there, and
    the group's usage is the start's CPU, the sandbox's own included, which the rusage of
    this process cannot see (the sandbox's processes are killed at close, never reaped by
    us). This thread moves every thread of ours (``tasks``: no wait on the kernel's global lock)."""

    def __init__(self, folders: dict[str, str]) -> None:
        self.folders = folders

    def _join(self, folder: str) -> None:
        # Every thread of ours, not only this one: bwrap is forked by the thread that lives
        # as long as the process (``_lasting.spawn``), born in whichever group came first; left
        # there, it would put every later sandbox in that variant's group.
        for thread in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"{folder}/tasks", "w") as fh:
                fh.write(thread)  # suppress: a thread that ended meanwhile

    def _used(self, name: str) -> float:
        with open(f"{self.folders[name]}/cpuacct.usage") as fh:
            return int(fh.read()) / 1e9

    def used(self, name: str) -> float:
        """CPU seconds of the variant's group so far (0 without groups)."""
        return self._used(name) if self.folders else 0.0

    def enter(self, name: str) -> float | None:
        if not self.folders:
            return None
        self._join(self.folders[name])
        return self._used(name)

    def leave(self, name: str) -> float:
        if not self.folders:
            return 0.0
        self._join(self.folders[""])
        return self._used(name)


@contextlib.contextmanager
def cpu_groups(names: list[str]) -> Iterator[CpuGroups]:
    base = f"{CPUACCT}/stockade-bench-policy-{os.getpid()}"
    folders = {name: f"{base}/{name or 'host'}" for name in ["", *names]}
    try:
        for folder in (base, *folders.values()):
            os.mkdir(folder)
    except OSError:  # no cgroup v1 accounting here, or not root: that row stays empty
        folders = {}
    groups = CpuGroups(folders)
    try:
        if folders:
            groups._join(folders[""])
        yield groups
    finally:
        if folders:
            # Every thread of ours, not only this one: a thread started inside (a spare's
            # starter, a pool's) was born in the host's group and would keep it from going.
            for thread in os.listdir("/proc/self/task"):
                # suppress: a thread that ended meanwhile
                with contextlib.suppress(OSError), open(f"{CPUACCT}/tasks", "w") as fh:
                    fh.write(thread)
            # And what lives on in them: a process tier's template lives as long as its backend.
            for folder in folders.values():
                with open(f"{folder}/tasks") as fh:
                    alive = fh.read().split()
                for task in alive:
                    with contextlib.suppress(OSError), open(f"{CPUACCT}/tasks", "w") as fh:
                        fh.write(task)
            for folder in (*folders.values(), base):
                for _ in range(50):  # the last processes of a sandbox may still be exiting
                    try:
                        os.rmdir(folder)
                        break
                    except OSError:
                        time.sleep(0.1)


def cold_start(tier: str, name: str) -> None:
    with create(tier, name) as fresh:
        fresh.commands.run("true")


def cpu_time() -> float:
    """CPU seconds of this process and of the children it reaped (bwrap, setpriv)."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def main() -> None:
    tier = sys.argv[1] if len(sys.argv) > 1 else "process"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    # The process tier's sandboxes forked from its template are not our children: their CPU
    # would go to the cpuacct group the template was born in, not to each variant's.
    os.environ.setdefault("STOCKADE_PROCESS_START", "exec")
    before = os.getloadavg()[0]
    found = measure(tier, rounds)
    print(f"load average (1 min) {before:.2f} before, {os.getloadavg()[0]:.2f} after\n")
    print(
        f"| {tier} tier, p50 | no policy | policy, Python judge | policy, compiled judge "
        "| Python judge vs none | compiled judge vs none |"
    )
    print("|---|---|---|---|---|---|")
    for what in WHAT:
        if not found["none"][what]:
            continue  # no CPU accounting on this host
        none, python, policy = (p50(found[name][what]) for name in ("none", "python", "policy"))
        versus = [f"{got / none:.3f}x / {got - none:+.2f} ms" for got in (python, policy)]
        print(f"| {what} | {none:.2f} ms | {python:.2f} ms | {policy:.2f} ms | {versus[0]} | {versus[1]} |")


if __name__ == "__main__":
    main()
