"""How late a fork bomb's call is reported past its deadline, and whether the sandbox survives.

Three bombs, each in a fresh sandbox of 64 processes: a shell bomb (`commands.run`, every
process in the call's process group), a Python bomb (`run_code`, `os.fork()` in a loop), and a
bomb whose every process leads its own session and writes nowhere (`commands.run`). Each
call has a short timeout; the figure is the wall time of the call minus that timeout, and a
sandbox the host had to close (its supervisor said nothing for `GRACE_S` past the deadline)
counts as "closed" (with the exception the next call met, and how late the bomb's call came
back). `--busy N` keeps N spinning processes on the host meanwhile, at the sandbox's
priority: what another worker's tests or guests do to a CI run.

    python bench/deadline_bombs.py gvisor --rounds 20 --busy 3
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator

from stockade import Limits, Sandbox, StockadeError

SHELL_TIMEOUT_S = 4.0
CODE_TIMEOUT_S = 3.0
SESSION_TIMEOUT_S = 2.0
PYTHON_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
SESSION_BOMB = (
    "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n"
    "    except OSError:\n        pass\n"
)


def shell(sbx: Sandbox) -> float:
    bomb = f"bomb{secrets.token_hex(4)}"
    started = time.monotonic()
    sbx.commands.run(f"{bomb}() {{ {bomb} | {bomb} & }}; {bomb}; sleep 30", timeout_s=SHELL_TIMEOUT_S)
    return time.monotonic() - started - SHELL_TIMEOUT_S


def code(sbx: Sandbox) -> float:
    started = time.monotonic()
    sbx.run_code(PYTHON_BOMB, timeout_s=CODE_TIMEOUT_S)
    return time.monotonic() - started - CODE_TIMEOUT_S


def session(sbx: Sandbox) -> float:
    sbx.files.write("bomb.py", SESSION_BOMB)
    started = time.monotonic()
    sbx.commands.run("python3 bomb.py >/dev/null 2>&1 </dev/null & sleep 30", timeout_s=SESSION_TIMEOUT_S)
    return time.monotonic() - started - SESSION_TIMEOUT_S


BOMBS: dict[str, Callable[[Sandbox], float]] = {"shell": shell, "code": code, "session": session}


@contextlib.contextmanager
def busy(n: int) -> Iterator[None]:
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def one(tier: str, bomb: Callable[[Sandbox], float]) -> tuple[float, str]:
    """Seconds past the deadline, and what the next call met ("" when it ran)."""
    with Sandbox.create(tier, limits=Limits(pids=64, memory_mb=2048)) as sbx:
        late = bomb(sbx)
        try:
            sbx.commands.run("true")
        except StockadeError as err:
            return late, type(err).__name__
        return late, ""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tier")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--busy", type=int, default=0, help="spinning host processes meanwhile")
    parser.add_argument("--bombs", default=",".join(BOMBS))
    args = parser.parse_args()
    with busy(args.busy):
        for name in args.bombs.split(","):
            rounds = [one(args.tier, BOMBS[name]) for _ in range(args.rounds)]
            done = sorted(late for late, met in rounds if not met)
            closed = ", ".join(f"{met} after {late:.2f} s" for late, met in rounds if met) or "0"
            if done:
                p90 = done[min(len(done) - 1, int(0.9 * len(done)))]
                figures = f"median {statistics.median(done):.2f} s, p90 {p90:.2f} s, max {done[-1]:.2f} s"
            else:
                figures = "no report"
            print(f"{args.tier} {name}: {len(rounds)} rounds, past the deadline {figures}; closed: {closed}")


if __name__ == "__main__":
    main()
