"""The process tier's exec chain before bwrap: the launcher against the shell and nsenter.

    sudo python bench/launch_chain.py --rounds 200

Each way starts ``true`` from this Python process as the tier starts bwrap (``Popen``, vfork),
inside three cgroup v1 groups made for the run (memory, pids, cpu; removed after) and as an
unused uid: alone (the raw mechanism: no join, no uid), through ``sh`` joining the groups and
``nsenter -S UID -G UID`` taking the uid (the chain without a compiler), and through the
launcher (``sandbox/launch.c``). Interleaved round by round; medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from stockade.sandbox import _cgroups, _launch
from stockade.types import Mechanism

UID = "65531"


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, close_fds=True, check=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    if _cgroups.detect().mechanism is not Mechanism.CGROUP_V1 or os.geteuid() != 0:
        raise SystemExit("needs root and cgroup v1 (the groups are joined through their tasks files)")
    launcher = _launch.usable()
    true = shutil.which("true")
    nsenter = shutil.which("nsenter")
    if launcher is None or true is None or nsenter is None:
        raise SystemExit("needs a C compiler (the launcher), true and nsenter")
    name = f"stockade-bench-launch-{os.getpid()}"
    groups = [Path("/sys/fs/cgroup", controller, name) for controller in ("memory", "pids", "cpu")]
    for g in groups:
        g.mkdir()
    try:
        files = [str(g / "tasks") for g in groups]
        shell = ["/bin/sh", "-c", _cgroups._ENTER, "sh", "3", *files]
        ways = {
            "alone (no join, no uid)": [true],
            "sh joins, nsenter takes the uid": [*shell, nsenter, "-S", UID, "-G", UID, "--", true],
            "the launcher": _launch.chain(launcher, int(UID), files, [true]),
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for argv in ways.values():
            timed(argv)
        load = os.getloadavg()[0]
        for _ in range(args.rounds):
            for name, argv in ways.items():
                times[name].append(timed(argv))
    finally:
        time.sleep(0.1)  # the last child's exit reaches the groups
        for g in groups:
            g.rmdir()
    alone = statistics.median(times["alone (no join, no uid)"])
    when = time.strftime("%Y-%m-%d %H:%M")
    print(f"The exec chain before bwrap, {when}, {os.cpu_count()} cores, load average {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after, {args.rounds} rounds\n")  # fmt: skip
    print("| way | median | over `true` alone |\n|---|---|---|")
    for name, values in times.items():
        m = statistics.median(values)
        print(f"| {name} | {m * 1e3:.2f} ms | +{(m - alone) * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
