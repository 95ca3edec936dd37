"""A tool call's deadline, carried down to the sandbox.

Cancelling a tool's coroutine does not stop a blocking function running in a worker thread,
nor the sandbox command it waits on. So a tool with ``timeout_s`` gets its sandbox through
``DeadlineInstance``: every command and ``run_code`` is given at most the time left as its own
``timeout_s`` (the tier kills the whole process tree then), and once the deadline has passed no
op reaches the sandbox at all. The deadline is the earlier of the tool's own ``timeout_s`` and
the end of the run's wall time (``ToolContext.deadline``): a command the model asks to run for a
week still ends when the run's time does.

Work a tool does on the host (matching a patch, listing, diffing, parsing a report) is bounded
too: the worker thread cannot be killed, so long host loops call ``checkpoint()``, which raises
once the call was given up (its deadline passed, or it was cancelled or timed out: ``Tool.invoke``
stops waiting then) or a check of the caller's (``stopping``: the run's kill switch) says stop.
Between two checkpoints a built-in tool does a bounded, small amount of work, so its thread ends
soon after the run's wall time or a kill: ``asyncio.run`` waits for it before it returns.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

from stockade.exceptions import ToolTimeout
from stockade.sandbox.base import Instance, OpResult, OutputSink, WrapperInstance
from stockade.sandbox.ops import Op, RunCode, RunCommand

__all__ = ["DeadlineInstance", "checkpoint", "stopping"]

# The checks ``checkpoint()`` makes; a worker thread started by ``_threads.off_loop`` (as by
# ``asyncio.to_thread``) sees those of the coroutine that started it (the context is copied).
_STOP_CHECKS: contextvars.ContextVar[tuple[Callable[[], None], ...]] = contextvars.ContextVar(
    "stockade_stop_checks", default=()
)


@contextlib.contextmanager
def stopping(check: Callable[[], None]) -> Iterator[None]:
    """Within the block (and threads started in it), ``checkpoint()`` calls ``check`` too, which
    raises to stop the work (``ToolTimeout``, ``RunKilled``)."""
    token = _STOP_CHECKS.set((*_STOP_CHECKS.get(), check))
    try:
        yield
    finally:
        _STOP_CHECKS.reset(token)


def checkpoint() -> None:
    """A place where long host-side work of a tool call may stop: raises if its call was given
    up or its run was killed. Cheap (a context lookup and a few flags): call it every so often."""
    for check in _STOP_CHECKS.get():
        check()


class DeadlineInstance(WrapperInstance):
    """The same sandbox, bounded by ``deadline`` (a ``clock()`` reading)."""

    def __init__(
        self,
        wrapped: Instance,
        *,
        deadline: float,
        tool: str,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        limit: str | None = None,
    ) -> None:
        super().__init__(wrapped)
        self.deadline = deadline
        self.tool = tool
        self.timeout_s = timeout_s
        self.clock = clock
        self.limit = limit or f"its {timeout_s:g} s timeout"  # what set the deadline, for messages

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        left = self.deadline - self.clock()
        if left <= 0:
            raise ToolTimeout(
                f"{self.tool} ran past {self.limit}; {type(op).__name__} was not started",
                tool=self.tool,
                timeout_s=self.timeout_s,
            )
        if isinstance(op, RunCommand | RunCode):
            bounded = left if op.timeout_s is None else min(op.timeout_s, left)
            op = dataclasses.replace(op, timeout_s=bounded)
        return self.wrapped.handle(op, sink)
