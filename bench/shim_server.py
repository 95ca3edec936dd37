"""A command through the shim server against one whose shim is a fork of the supervisor (the
command path before the server, which the supervisor falls back to), side by side in one run:
two sandboxes of one tier, one told to start no server (``shim_server: false`` in its
configuration, as gVisor's supervisor tells itself), their commands interleaved.

For each: the command's wall time (p50), the supervisor's minor page faults per command, and
the CPU per command of the sandbox's processes that take part: the supervisor with every
child it reaped (shims and commands: ``/proc/1/stat``'s utime, stime, cutime, cstime, the
supervisor being the sandbox's init) plus the server's own. Read from inside, by a command
before and after the timed ones (the same reading on both sides).

    python bench/shim_server.py [tier] [commands] [none|policy]   # prints a markdown table
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

from stockade import Limits, Sandbox
from stockade.sandbox import _supervised, docker, process
from stockade.types import SandboxRules

RULES = SandboxRules(
    deny=("curl", "wget", "nc", "ssh", "scp", "sudo", "su", "telnet", "ftp", "socat"),
    approve=("rm -r", "git push", "pip install"),
    write=("src/**", "tests/**"),
)
READ = (
    "python3 -c 'import os\n"
    "def f(p):\n"
    '    d = open(f"/proc/{p}/stat", "rb").read()\n'
    '    return d[d.rindex(b")") + 2 :].split()\n'
    "s = f(1)\n"
    "cpu = sum(int(x) for x in s[11:15])\n"
    'for p in os.listdir("/proc"):\n'
    '    if p.isdigit() and f(p)[1] == b"1" and open(f"/proc/{p}/comm").read().strip() == "stockade-shim" '
    "and int(p) != os.getsid(0):\n"
    "        cpu += sum(int(x) for x in f(p)[11:13])\n"
    "print(s[7].decode(), cpu, s[8].decode())'"
)
NO_SERVER = {"on": False}


def _config(original: Any) -> Any:
    def config(*args: Any, **kwargs: Any) -> dict[str, Any]:
        made = dict(original(*args, **kwargs))
        if NO_SERVER["on"]:
            made["shim_server"] = False
        return made

    return config


for module in (process, docker, _supervised):
    module.supervisor_config = _config(module.supervisor_config)  # type: ignore[attr-defined]


def reading(sbx: Sandbox) -> tuple[int, int, int]:
    out = sbx.commands.run(READ).stdout.split()
    return int(out[0]), int(out[1]), int(out[2])


def main() -> None:
    tier = sys.argv[1] if len(sys.argv) > 1 else "process"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 400
    rules = RULES if len(sys.argv) > 3 and sys.argv[3] == "policy" else None
    ticks = os.sysconf("SC_CLK_TCK")
    sandboxes: dict[str, Sandbox] = {}
    try:
        for name in ("fork", "server"):
            NO_SERVER["on"] = name == "fork"
            sandboxes[name] = Sandbox.create(tier, limits=Limits(timeout_s=30), rules=rules)
        NO_SERVER["on"] = False
        for sbx in sandboxes.values():
            for _ in range(20):
                sbx.commands.run("true")
        before = {name: reading(sbx) for name, sbx in sandboxes.items()}
        walls: dict[str, list[float]] = {name: [] for name in sandboxes}
        for _ in range(count):
            for name, sbx in sandboxes.items():
                started = time.perf_counter()
                sbx.commands.run("true")
                walls[name].append(time.perf_counter() - started)
        after = {name: reading(sbx) for name, sbx in sandboxes.items()}
    finally:
        for sbx in sandboxes.values():
            sbx.close()
    load = f"{os.getloadavg()[0]:.2f}"
    print(f"{tier}, {'policy' if rules else 'no policy'}, {count} commands each, load {load}\n")
    print("| | shim forked by the supervisor | shim from the server | server vs fork |")
    print("|---|---|---|---|")
    p50 = {n: statistics.median(w) * 1000 for n, w in walls.items()}
    faults = {n: (after[n][0] - before[n][0]) / count for n in sandboxes}
    cpu = {n: (after[n][1] - before[n][1]) / ticks / count * 1000 for n in sandboxes}
    ratio = p50["server"] / p50["fork"]
    print(f"| command, p50 | {p50['fork']:.2f} ms | {p50['server']:.2f} ms | {ratio:.3f}x |")
    print(f"| supervisor's faults a command | {faults['fork']:.1f} | {faults['server']:.1f} | |")
    children = {n: (after[n][2] - before[n][2]) / count for n in sandboxes}
    print(f"| its children's faults a command | {children['fork']:.1f} | {children['server']:.1f} | |")
    print(
        f"| CPU a command (supervisor, its children, server) | {cpu['fork']:.2f} ms | {cpu['server']:.2f} ms "
        f"| {cpu['server'] / cpu['fork']:.3f}x |"
    )


if __name__ == "__main__":
    main()
