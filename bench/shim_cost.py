"""What the shim costs a command: a supervisor-sized Python process runs ``sh -c true``
(found in ``PATH``, its output on a pipe the supervisor drains) four ways. Each shim is
stockade's own and does its real work: it leads a session of its own, is a child
subreaper, puts the command at nice 19 and first for the OOM killer, closes every other
fd, enters ``/``, starts the command, kills what it left and reaps every child.

    python bench/shim_cost.py [--rounds 30] [--block 20] [--rss-mb 12]

* **no shim (raw)**: the command spawned directly, in a session of its own: the floor every
  ratio is set against;
* **fork**: the supervisor forks the Python shim (``reaper.spawn_shim``: the fork copies
  the supervisor's page tables, and every page either side writes while the shim lives is
  copied again), which ``posix_spawnp``s the command;
* **zygote**: a fork of the supervisor made once forks each Python shim on request (over a
  socket, with the output pipe passed along) and reports its status: the fork moves, it
  does not go;
* **compiled**: the supervisor ``posix_spawn``s the compiled shim (``supervisor/shim.c``,
  as ``reaper.spawn_program`` does: vfork, nothing of the supervisor copied), which
  vforks the command.

Outside any sandbox (no rules, no namespaces): the shim's own cost, not a command's. Here
``/proc`` holds every process of the host: the Python shim looks through it after every
command, the compiled one only when the command left a process (none does here). The
supervisor's size is a ballast of small objects (``--rss-mb``; a process tier's supervisor
holds ~12 MB resident, ~6 MB of it anonymous). The supervisor here does nothing per command
but the spawn and the reads: its faults are a floor (the real one writes ~180 pages a command
while its shim lives). Blocks of each way alternated; medians of the commands' wall times,
and the CPU and minor faults of the supervisor and the zygote per command. Needs a C
compiler (``gcc`` or ``cc``) for the compiled way.
"""

from __future__ import annotations

import argparse
import array
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stockade.sandbox import _shim
from stockade.sandbox.supervisor import reaper

COMMAND = ["sh", "-c", "true"]
ENV = {"PATH": "/usr/bin:/bin"}


def python_shim(out_w: int) -> int:
    """The Python shim around the command, forked from this process (``reaper.spawn_shim``)."""
    return reaper.spawn_shim(reaper.spawned(COMMAND, ENV, "/"), (0, out_w, 2))


def drain(fd: int) -> None:
    while os.read(fd, 4096):
        pass
    os.close(fd)


def by_fork() -> None:
    r, w = os.pipe()
    pid = python_shim(w)
    os.close(w)
    drain(r)
    os.waitpid(pid, 0)


def zygote(sock: socket.socket) -> None:
    """Fork a shim per request (the pipe's write end comes with it); answer pid and status."""
    while True:
        msg, ancillary, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(4))
        if not msg:
            os._exit(0)
        fds = array.array("i")
        fds.frombytes(ancillary[0][2])
        pid = python_shim(fds[0])
        os.close(fds[0])
        _, status = os.waitpid(pid, 0)
        sock.sendall(pid.to_bytes(8, "big") + status.to_bytes(8, "big"))


def by_zygote(sock: socket.socket) -> None:
    r, w = os.pipe()
    sock.sendmsg([b"C"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [w]).tobytes())])
    os.close(w)
    drain(r)
    reply = b""
    while len(reply) < 16:
        reply += sock.recv(16 - len(reply))


def by_compiled(shim: str) -> None:
    r, w = os.pipe()
    actions = [(os.POSIX_SPAWN_DUP2, w, 1), (os.POSIX_SPAWN_CLOSE, r)]
    pid = os.posix_spawn(shim, ["shim", "-", "-", "/", *COMMAND], ENV, file_actions=actions, setsid=True)
    os.close(w)
    drain(r)
    os.waitpid(pid, 0)


def by_no_shim() -> None:
    """The raw mechanism: the command itself, spawned in a session of its own; nothing reaps
    what it leaves behind, and nothing confines it."""
    r, w = os.pipe()
    actions = [(os.POSIX_SPAWN_DUP2, w, 1), (os.POSIX_SPAWN_CLOSE, r)]
    pid = os.posix_spawnp(COMMAND[0], COMMAND, ENV, file_actions=actions, setsid=True)
    os.close(w)
    drain(r)
    os.waitpid(pid, 0)


def cpu_and_faults(pids: list[int]) -> tuple[float, int]:
    """This process's CPU and minor faults, plus those of ``pids`` (from /proc)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    cpu, faults = own.ru_utime + own.ru_stime, own.ru_minflt
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        faults += int(fields[7])
    return cpu, faults


def resident_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def build_shim(folder: Path) -> str | None:
    built = _shim.build(folder)
    return str(built) if built is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--rss-mb", type=int, default=12)
    args = parser.parse_args()
    ballast: list[bytearray] = []  # small objects, as a Python heap is, up to --rss-mb resident
    while resident_mb() < args.rss_mb:
        ballast.extend(bytearray(64) for _ in range(1000))
    os.environ["PATH"] = ENV["PATH"]  # where posix_spawnp looks, as the shims do in ENV's
    with tempfile.TemporaryDirectory() as tmp:
        shim = build_shim(Path(tmp))
        ours, theirs = socket.socketpair()
        zpid = os.fork()
        if zpid == 0:
            ours.close()
            zygote(theirs)
        theirs.close()
        ways: dict[str, Callable[[], None]] = {
            "no shim (raw)": by_no_shim,
            "fork": by_fork,
            "zygote": lambda: by_zygote(ours),
        }
        if shim is not None:
            ways["compiled"] = lambda: by_compiled(shim)
        walls: dict[str, list[float]] = {name: [] for name in ways}
        cpus: dict[str, list[float]] = {name: [] for name in ways}
        faults: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, way in ways.items():
                cpu0, faults0 = cpu_and_faults([zpid])
                for _ in range(args.block):
                    started = time.perf_counter()
                    way()
                    walls[name].append(time.perf_counter() - started)
                cpu1, faults1 = cpu_and_faults([zpid])
                cpus[name].append((cpu1 - cpu0) / args.block)
                faults[name].append((faults1 - faults0) / args.block)
        ours.close()
        os.waitpid(zpid, 0)
    load = os.getloadavg()[0]
    print(f"supervisor resident: {resident_mb():.0f} MiB ({len(ballast)} ballast objects); load {load:.2f}")
    print(f"{args.rounds} blocks of {args.block} `{' '.join(COMMAND)}` a way, alternated; medians\n")
    print("| way | a command, wall | supervisor + zygote CPU | their minor faults |")
    print("|---|---|---|---|")
    base = statistics.median(walls["no shim (raw)"])
    for name in ways:
        wall = statistics.median(walls[name])
        print(
            f"| {name} | {wall * 1e3:.2f} ms ({wall / base:.2f}x) | "
            f"{statistics.median(cpus[name]) * 1e6:.0f} us | {statistics.median(faults[name]):.1f} |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
