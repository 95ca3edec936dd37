"""Page faults the supervisor takes per command: its minor faults (``/proc/1/stat``, the
supervisor being the sandbox's init) read before and after N commands, divided by N.

Each shim of a command is a fork of the supervisor: every page the supervisor writes while
one lives is copied (a fault); a shim that is not a fork of it (the shim server measured in
docs/benchmarks.md) takes those away. Run it once per version of stockade (a worktree each,
on PYTHONPATH) and alternate them:

    python bench/shim_faults.py [tier] [commands] [policy|none]   # prints one line
"""

from __future__ import annotations

import sys

from stockade import Sandbox
from stockade.types import SandboxRules

RULES = SandboxRules(deny=("curl", "wget", "nc", "ssh"), write=("src/**",))


def faults(sbx: Sandbox) -> int:
    stat = sbx.commands.run("cat /proc/1/stat").stdout
    return int(stat[stat.rindex(")") + 2 :].split()[7])  # minflt: the 10th field


def main() -> None:
    tier = sys.argv[1] if len(sys.argv) > 1 else "process"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    policy = len(sys.argv) > 3 and sys.argv[3] == "policy"
    with Sandbox.create(tier, rules=RULES if policy else None) as sbx:
        for _ in range(20):  # warm: the first commands load what every later one uses
            sbx.commands.run("true")
        before = faults(sbx)
        for _ in range(count):
            sbx.commands.run("true")
        after = faults(sbx)
    print(f"{tier} {'policy' if policy else 'none'}: {(after - before) / count:.1f} faults a command")


if __name__ == "__main__":
    main()
