"""A process for ``test_sandbox_forks``: it starts a sandbox and leases another from a pool on
TIER, forks a child that exits normally without touching them, then one that tries to use
them, and prints a JSON report of what each side saw.

    python fork_child.py TIER
"""

from __future__ import annotations

import json
import os
import sys
import time

from stockade import Sandbox, SandboxPool
from stockade.exceptions import StockadeError


def attempt(sbx: Sandbox) -> dict[str, object]:
    """In a child: a call on the parent's sandbox, and what came of it."""
    started = time.monotonic()
    try:
        said, kind = repr(sbx.commands.run("echo hi", timeout_s=1)), ""
    except StockadeError as error:
        said, kind = str(error), type(error).__name__
    return {"error": kind, "said": said, "seconds": time.monotonic() - started}


def outputs(*sandboxes: Sandbox) -> list[str]:
    try:
        return [s.commands.run("echo hi").stdout for s in sandboxes]
    except StockadeError as error:
        return [f"{type(error).__name__}: {error}"]


report: dict[str, object] = {}
with Sandbox.create(sys.argv[1]) as sbx, SandboxPool(sys.argv[1], size=1) as pool, pool.acquire() as leased:
    if os.fork() == 0:
        sys.exit(0)  # a child that never touches them, ending as a program does
    os.wait()
    report["after_exit"] = outputs(sbx, leased)
    read, write = os.pipe()
    if os.fork() == 0:
        os.close(read)
        tried = [attempt(sbx), attempt(leased)]
        with os.fdopen(write, "w") as pipe:
            json.dump(tried, pipe)
        sys.exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        report["child_use"] = json.load(pipe)
    os.wait()
    report["after_use"] = outputs(sbx, leased)
print(json.dumps(report))
