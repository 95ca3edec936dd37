"""How long `scripts/test`'s two workers take, replayed from the tests' measured durations.

The whole suite is not run to compare two ways of handing tests to the workers (it takes the
machine for a quarter of an hour): the durations of its parts, measured one part at a time
(`pytest PART --durations=0`, the microVM's tests in one process), are replayed in a model of
`--dist loadgroup` as `tests/conftest.py` sets it up: one worker takes the microVM's unit
first and runs it in order, the other takes every other test in collection order, and a
worker that is free takes the next. A test marked `alone` first waits for the other worker's
test to end, and the other worker starts nothing until it has ended.

    pytest tests --collect-only -q > collection.txt
    pytest tests -k microvm --durations=0 > microvm.log   # ... and the other parts
    python bench/suite_schedule.py collection.txt microvm.log other.log ... [--vm-factor 1.2]

`--vm-factor` stretches the microVM's tests (a guest under TCG is slower beside the other
worker's tests than alone). Three units are compared: the tests whose id names `microvm`;
those and the tests marked `microvm` (as now); those and the tests marked `alone` (tried,
not kept: docs/benchmarks.md). A model: it knows each test's length alone, not what two tests
at once do to each other, and a test's wait for the lock lands where the order puts it.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DURATION = re.compile(r"^([0-9.]+)s (?:call|setup|teardown)\s+(\S.*)$")


@functools.cache
def marked(path: Path, mark: str) -> frozenset[str]:
    """The names of a test file's functions decorated ``@pytest.mark.<mark>``."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    return frozenset(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and any(ast.unparse(decorator) == f"pytest.mark.{mark}" for decorator in node.decorator_list)
    )


def has_mark(nodeid: str, mark: str) -> bool:
    path, _, name = nodeid.partition("::")
    return name.split("[")[0].rsplit("::", 1)[-1] in marked(ROOT / path, mark)


def durations(logs: Sequence[Path]) -> dict[str, float]:
    """Each test's setup + call + teardown, from pytest's ``--durations=0`` report."""
    found: dict[str, float] = defaultdict(float)
    for log in logs:
        for line in log.read_text().splitlines():
            match = DURATION.match(line)
            if match:
                found[match.group(2).strip()] += float(match.group(1))
    return found


def replay(
    order: Sequence[str], took: dict[str, float], apart: Callable[[str], bool], vm_factor: float
) -> tuple[float, dict[str, float]]:
    """The run's length and each worker's idle seconds."""

    def length(nodeid: str) -> float:
        return took.get(nodeid, 0.0) * (vm_factor if "microvm" in nodeid else 1.0)

    todo: dict[str, list[str]] = {"apart": [n for n in order if apart(n)], "other": []}
    queue = [n for n in order if not apart(n)]
    clock = {"apart": 0.0, "other": 0.0}
    idle = {"apart": 0.0, "other": 0.0}
    while any(todo.values()) or queue:
        worker = min((w for w in clock if todo[w] or queue), key=lambda w: clock[w])
        other = "other" if worker == "apart" else "apart"
        nodeid = todo[worker].pop(0) if todo[worker] else queue.pop(0)
        start = clock[worker]
        if has_mark(nodeid, "alone"):  # it waits for the other's test; the other waits for it
            start = max(start, clock[other])
            idle[worker] += start - clock[worker]
            idle[other] += start + length(nodeid) - clock[other]
            clock[other] = start + length(nodeid)
        clock[worker] = start + length(nodeid)
    return max(clock.values()), idle


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("collection", type=Path, help="pytest --collect-only -q's output")
    parser.add_argument("logs", type=Path, nargs="+", help="pytest --durations=0 reports")
    parser.add_argument("--vm-factor", type=float, nargs="*", default=[1.0, 1.2, 1.4])
    args = parser.parse_args()
    order = [line.strip() for line in args.collection.read_text().splitlines() if "::" in line]
    collected = set(order)
    took = {nodeid: seconds for nodeid, seconds in durations(args.logs).items() if nodeid in collected}
    vm = sum(v for k, v in took.items() if "microvm" in k)
    print(f"{len(order)} tests, {len(took)} with a duration; serial: microVM's {vm:.0f} s, ", end="")
    print(f"the rest {sum(took.values()) - vm:.0f} s")

    units: dict[str, Callable[[str], bool]] = {
        "ids naming microvm": lambda nodeid: "microvm" in nodeid,
        "and the microvm marks (now)": lambda nodeid: "microvm" in nodeid or has_mark(nodeid, "microvm"),
        "and the alone marks (not kept)": lambda nodeid: (
            "microvm" in nodeid or has_mark(nodeid, "microvm") or has_mark(nodeid, "alone")
        ),
    }
    print("| microVM's tests x | " + " | ".join(f"unit: {name}" for name in units) + " |")
    print("|---|" + "---|" * len(units))
    for factor in args.vm_factor:
        cells = []
        for apart in units.values():
            total, idle = replay(order, took, apart, factor)
            cells.append(f"{total:.0f} s (idle {idle['apart']:.0f} / {idle['other']:.0f} s)")
        print(f"| {factor:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
