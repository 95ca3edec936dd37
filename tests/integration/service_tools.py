"""Tools the workers of ``test_service_distributed`` load (``stockade worker --tools``): a
payment outside the sandbox (not idempotent: each one appends a line to a host file), and a
slow step that says when it started (the moment the test kills its worker)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from stockade.tools import ToolContext, default_toolset, tool


def _folder() -> Path:
    return Path(os.environ["STOCKADE_TEST_EFFECTS"])


@tool
def pay(ctx: ToolContext, invoice: str) -> str:
    """Pay an invoice (outside the sandbox; not idempotent).

    Args:
        invoice: the invoice number.
    """
    with (_folder() / "payments.log").open("a") as log:
        log.write(f"{invoice} {ctx.idempotency_key}\n")
    return f"paid {invoice}"


@tool
def slow_step(ctx: ToolContext, seconds: float) -> str:
    """Wait (the test kills the worker meanwhile).

    Args:
        seconds: how long.
    """
    (_folder() / "slow-started").write_text(f"{os.getpid()} {os.getpgid(0)}\n")
    time.sleep(seconds)
    return "waited"


toolset = default_toolset().including(pay, slow_step)
