"""A sandbox's ``approver``: what it may be, and what of its answer lets an exec run.

Only an explicit yes runs the exec: ``True`` or ``Choice.APPROVED``. Anything else is a
refusal, with its reason in the exec's record: ``bool(answer)`` let ``Choice.DENIED`` (a
non-empty string) and an async approver's coroutine (never awaited) run ``rm -r`` unasked.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from stockade import exceptions as exc
from stockade._display import visible
from stockade.sandbox._interrupt import CUT

if TYPE_CHECKING:
    import asyncio

    from stockade.policy.approval_book import Choice
    from stockade.types import ExecRecord

__all__ = [
    "ANSWER_BY",
    "Approver",
    "AsyncApprover",
    "Refusal",
    "answered",
    "check_approver",
    "cut_requested",
    "on_loop",
]

# How often a worker thread waiting for an async approver looks whether its caller gave up.
CUT_POLL_S = 0.05

# When (``time.monotonic()``) the exec being asked about stops waiting: what is left of its
# call's ``Limits.approval_wait_s``, set by whoever asks. An async approver not done by then
# is cancelled and the exec refused: the supervisor has let its wait go by then, and a thread
# held past it holds the call for good. None: no limit known.
ANSWER_BY: contextvars.ContextVar[float | None] = contextvars.ContextVar("stockade_answer_by", default=None)


@dataclass(frozen=True)
class Refusal:
    """A no that stockade gave on the approver's behalf (it did not answer in time, its call
    was cancelled), with why: shown with the exec's rule as any refusal's reason."""

    why: str


# ``Sandbox``'s: called in the thread that runs the call.
Approver: TypeAlias = "Callable[[ExecRecord], bool | Choice]"
# ``AsyncSandbox``'s may also be ``async def``: awaited on the loop the sandbox was created on.
AsyncApprover: TypeAlias = "Callable[[ExecRecord], bool | Choice | Awaitable[bool | Choice]]"


def check_approver(approver: object, *, asynchronous: bool = False) -> None:
    """An approver given is callable; to a blocking ``Sandbox``, not an ``async def``."""
    if approver is None:
        return
    if not callable(approver):
        raise exc.InvalidArgument(
            f"approver must be callable, got {type(approver).__name__}",
            argument="approver",
            fix="give a function of an ExecRecord that answers True (or Choice.APPROVED) to allow",
        )
    if not asynchronous and inspect.iscoroutinefunction(approver):
        raise exc.InvalidArgument(
            "approver is an async function: a blocking Sandbox cannot await it",
            argument="approver",
            fix="give a plain function, or create the sandbox with AsyncSandbox.create",
        )


def answered(answer: object) -> tuple[bool, str]:
    """Whether ``answer`` lets the exec run, and, where it is not a plain yes or no, why it
    was taken as a no (shown with the exec's rule)."""
    from stockade.policy.approval_book import Choice  # lazily: the policy package imports the tiers

    if answer is True or answer is Choice.APPROVED:
        return True, ""
    if isinstance(answer, Refusal):
        return False, answer.why
    if answer is False or answer is None or answer is Choice.DENIED:
        return False, ""
    if inspect.isawaitable(answer):
        if inspect.iscoroutine(answer):
            answer.close()  # never run: no "was never awaited" warning, no half-done approver
        return False, "the approver returned an awaitable, which is not awaited here"
    shown = visible(repr(answer))[:80]
    return False, f"the approver answered {shown}, not True or Choice.APPROVED"


def on_loop(approver: AsyncApprover, loop: asyncio.AbstractEventLoop) -> Approver:
    """``approver`` called from the worker thread an ``AsyncSandbox``'s call runs in: what it
    returns to await (an ``async def``'s coroutine) is awaited on ``loop``, the caller's, while
    the thread waits for the answer: until ``ANSWER_BY`` at most, or the call's cancel."""
    import asyncio

    def ask(record: ExecRecord) -> Any:
        answer = approver(record)
        if not inspect.isawaitable(answer):
            return answer
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop or loop.is_closed() or not loop.is_running():
            # on the loop's own thread it would wait for itself; a loop gone awaits nothing
            return answer  # ``answered`` closes it, and refuses
        future = asyncio.run_coroutine_threadsafe(_awaited(answer), loop)
        cut = CUT.get()
        answer_by = ANSWER_BY.get()
        while True:
            wait = CUT_POLL_S if cut is not None else None
            if answer_by is not None:
                left = answer_by - time.monotonic()
                if left <= 0:
                    future.cancel()
                    return Refusal("the approver did not answer within the call's approval_wait_s")
                wait = left if wait is None else min(wait, left)
            try:
                return future.result(wait)
            except concurrent.futures.TimeoutError:
                if cut is not None and cut.requested:
                    # The caller gave up (its task cancelled): the approver is cancelled with
                    # it, and a yes it would give later lets nothing run.
                    future.cancel()
                    return Refusal("the call was cancelled while the approver was asked")

    return ask


def cut_requested() -> bool:
    """Whether the task this thread's call runs for was cancelled (``_interrupt``): then an
    approver's answer, however late, lets no exec of the call run."""
    cut = CUT.get()
    return cut is not None and cut.requested


async def _awaited(answer: Awaitable[Any]) -> Any:
    return await answer
