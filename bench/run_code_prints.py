"""A print-heavy program: ``for i in range(N): print(i)`` through ``run_code``, through
``commands.run`` (``python3 -c``, whose stdout on a pipe is buffered; ``python3 -u -c``, a
write a print, as ``run_code``'s unbuffered stdout; a shell's loop of N ``echo``s, a write a
line; and ``head -c 10**8 /dev/zero``, a writer faster than any gather, which must not wait
for one) and through ``python3 -c`` in a strict bubblewrap (buffered, and ``-u``). And how late
a streamed line reaches ``on_stdout``: a cell (and a ``python3 -u`` command) printing
``time.time()`` every 10 ms, each line's arrival against the time it holds (one clock: the
host's and the sandbox's kernel are one on these tiers).

    python bench/run_code_prints.py [--tiers process,docker] [--prints 100000] [--rounds 3]

Prints a markdown table: medians over the rounds, min-max. The rows of one tier are
interleaved round by round, so that a change of the machine's load moves each of them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable

from _raw import RAW_BWRAP

from stockade import Sandbox
from stockade.sandbox.base import Backend
from stockade.sandbox.docker import DockerBackend
from stockade.sandbox.process import ProcessBackend

TICKS = 30
BULK = 10**8  # bytes through commands.run's stdout (past output_bytes: counted, not kept)


def loop(n: int) -> str:
    return f"for i in range({n}): print(i)"


def expected(n: int) -> str:
    return "".join(f"{i}\n" for i in range(n))


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def echo_loop(n: int) -> str:
    return f"i=0; while [ $i -lt {n} ]; do echo $i; i=$((i + 1)); done"


def stream_delays(sbx: Sandbox, command: bool = False) -> list[float]:
    """How late each of TICKS lines reached ``on_stdout`` after the cell (or the command)
    printed it."""
    arrived: list[tuple[float, str]] = []
    code = f"import time\nfor _ in range({TICKS}):\n    print(repr(time.time())); time.sleep(0.01)"

    def seen(text: str) -> None:
        arrived.append((time.time(), text))

    if command:
        sbx.commands.run(["python3", "-u", "-c", code], on_stdout=seen)
    else:
        sbx.run_code(code, on_stdout=seen)
    delays, held = [], ""
    for at, text in arrived:  # a line may come in parts (a print is two writes): its last part's time
        *lines, held = (held + text).split("\n")
        delays += [at - float(line) for line in lines]
    assert len(delays) == TICKS, arrived
    return delays


def measure(backend: Backend, n: int, rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {
        "run_code": [],
        "command": [],
        "command -u": [],
        "echo loop": [],
        "bulk": [],
        "stream": [],
        "command stream": [],
    }
    want = expected(n)
    with Sandbox.create(backend=backend) as sbx:
        sbx.run_code("1")  # the interpreter started, not timed

        def code() -> None:
            ex = sbx.run_code(loop(n))
            assert ex.error is None and ex.logs.stdout == want, ex.error

        def command(*argv: str) -> Callable[[], None]:
            def run() -> None:
                r = sbx.commands.run(list(argv))
                assert r.exit_code == 0 and r.stdout == want, r.stderr

            return run

        def bulk() -> None:
            r = sbx.commands.run(["head", "-c", str(BULK), "/dev/zero"])
            assert r.exit_code == 0 and r.stdout_bytes == BULK, r.stderr

        for _ in range(rounds):
            out["run_code"].append(timed(code))
            out["command"].append(timed(command("python3", "-c", loop(n))))
            out["command -u"].append(timed(command("python3", "-u", "-c", loop(n))))
            out["echo loop"].append(timed(command("sh", "-c", echo_loop(n))))
            out["bulk"].append(timed(bulk))
            out["stream"] += stream_delays(sbx)
            out["command stream"] += stream_delays(sbx, command=True)
    return out


def raw(n: int, rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"raw": [], "raw -u": []}
    want = expected(n).encode()
    for _ in range(rounds):
        for row, flags in (("raw", []), ("raw -u", ["-u"])):
            argv = [*RAW_BWRAP, "/usr/bin/python3", *flags, "-c", loop(n)]
            t = time.perf_counter()
            done = subprocess.run(argv, env={}, check=True, capture_output=True)
            out[row].append(time.perf_counter() - t)
            assert done.stdout == want
    return out


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:,.1f} ({min(xs) * 1000:,.1f}-{max(xs) * 1000:,.1f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiers", default="process,docker")
    ap.add_argument("--prints", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    backends: dict[str, Callable[[], Backend]] = {"process": ProcessBackend, "docker": DockerBackend}
    print(f"load average {os.getloadavg()[0]:.1f}, {args.prints:,} prints, {args.rounds} rounds")
    print("| tier | run | ms | streamed line's delay ms (p50, min-max) |")
    print("|---|---|---|---|")
    for tier in args.tiers.split(","):
        got = measure(backends[tier](), args.prints, args.rounds)
        print(f"| {tier} | run_code | {fmt(got['run_code'])} | {fmt(got['stream'])} |")
        print(f"| {tier} | commands.run `python3 -c` | {fmt(got['command'])} | |")
        unbuffered = f"{fmt(got['command -u'])} | {fmt(got['command stream'])}"
        print(f"| {tier} | commands.run `python3 -u -c` | {unbuffered} |")
        print(f"| {tier} | commands.run echo loop | {fmt(got['echo loop'])} | |")
        print(f"| {tier} | commands.run `head -c 10**8` | {fmt(got['bulk'])} | |")
    got = raw(args.prints, args.rounds)
    print(f"| raw bwrap | `python3 -c` | {fmt(got['raw'])} | |")
    print(f"| raw bwrap | `python3 -u -c` | {fmt(got['raw -u'])} | |")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
