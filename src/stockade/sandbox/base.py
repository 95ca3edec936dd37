"""The plug point: a tier is a ``Backend`` that starts ``Instance``s.

Twin interfaces, as in httpx: ``Backend.start`` / ``Instance.execute`` / ``Instance.close``
for threads, ``AsyncBackend.astart`` / ``AsyncInstance.aexecute`` / ``AsyncInstance.aclose``
for asyncio. One class may implement both (``stockade.testing.FakeBackend`` does).
Cross-cutting behaviour (retry, audit, policy) wraps these interfaces; it is never a flag:
a wrapper subclasses ``WrapperInstance`` / ``WrapperBackend`` and overrides what it changes.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from stockade.sandbox._approver import Approver
from stockade.sandbox.ops import Op
from stockade.types import (
    CommandResult,
    EgressRecord,
    Enforcement,
    EntryInfo,
    Execution,
    JudgedExecs,
    Limits,
    Listing,
    NetworkPolicy,
    SandboxRules,
    Snapshot,
    TierReport,
)

__all__ = [
    "AsyncBackend",
    "AsyncInstance",
    "Backend",
    "Instance",
    "OpResult",
    "OutputSink",
    "SandboxSpec",
    "ThreadedAsyncBackend",
    "WrapperBackend",
    "WrapperInstance",
]

# Called with (1 for stdout | 2 for stderr, raw bytes) as output arrives.
OutputSink = Callable[[int, bytes], None]
# What the ops of ``stockade.sandbox.ops`` answer, whichever it was: what ``handle`` returns.
OpResult = CommandResult | Execution | JudgedExecs | bytes | EntryInfo | Listing | Snapshot | None
R = TypeVar("R")


@dataclass(frozen=True, kw_only=True)
class SandboxSpec:
    """Everything a tier needs to start one sandbox."""

    limits: Limits = field(default_factory=Limits)
    network: NetworkPolicy = field(default_factory=NetworkPolicy)
    envs: Mapping[str, str] = field(default_factory=dict)
    allow_weaker: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)
    rules: SandboxRules | None = None
    # Asked, on the host, about an exec the rules send for approval; only True (or
    # Choice.APPROVED) lets it run (``_approver.answered``). Without one, such an exec is refused.
    approver: Approver | None = None
    # Start from this snapshot: its memory where the tier took it and can restore it, else
    # a fresh sandbox holding its files.
    snapshot: Snapshot | None = None
    # The id to give the sandbox (a paused one comes back under its own); a new one if None.
    sandbox_id: str | None = None
    # Told, on the host, of every request through the sandbox's egress proxy (the audit).
    egress_observer: Callable[[EgressRecord], None] | None = None


class Instance(abc.ABC):
    """One live sandbox."""

    id: str
    tier: str
    enforcement: Enforcement
    # What the sandbox was started from, where a tier starts from something made ahead: the
    # microVM's "cold boot", "boot image", "ready image" or "memory snapshot"; "" elsewhere.
    started_from: str = ""
    # The rules the sandbox was started with (``SandboxSpec.rules``); None: none, or not known.
    # What of them its kernel holds is ``enforcement``'s to say.
    rules: SandboxRules | None = None

    def execute(self, op: Op[R], sink: OutputSink | None = None) -> R:
        """Run ``op``; what comes back is what the op says (``RunCommand`` -> ``CommandResult``).

        ``sink`` gets output as it arrives (see ``OutputSink``)."""
        # handle() answers each op with the op's own result type: that is its contract
        return cast(R, self.handle(op, sink))

    @abc.abstractmethod
    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        """Execute one operation. ``execute`` is its typed front door."""

    @abc.abstractmethod
    def close(self) -> None:
        """Kill every process of the sandbox and release its resources. Idempotent."""

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the sandbox can still run ops (pools hand out only live ones)."""

    def cut_running(self) -> None:
        """Stop what runs in the sandbox now (its commands, its code), as their timeout would:
        their ops return, timed out, and the sandbox and its files stay. From any thread; a
        tier that cannot does nothing (the op then runs to its end)."""
        return None  # such a tier: its ops end at their own timeout


class Backend(abc.ABC):
    """One isolation tier on this host."""

    tier: str

    @abc.abstractmethod
    def probe(self) -> TierReport:
        """Whether this tier works here and how it would enforce each limit."""

    @abc.abstractmethod
    def start(self, spec: SandboxSpec) -> Instance:
        """Start a sandbox, or raise ``LimitNotEnforceable`` / ``SandboxStartError``."""

    def prepare_for(self, spec: SandboxSpec) -> str:
        """Build now whatever makes starting sandboxes like ``spec`` fast on this tier (the
        microVM's boot and ready images), so that no start pays for it; what the next such
        start will start from (``Instance.started_from``). Most tiers have nothing to build."""
        return ""

    def unwalled_network(self) -> str | None:
        """Why a whole network (``NetworkPolicy(enabled=True)``) here would reach this host,
        its private network or other sandboxes, or None: walled off, or refused by the tier
        itself. A tier that does not say is taken as not walled."""
        return f"the {self.tier} tier does not say its whole network is walled off"


class WrapperInstance(Instance):
    """Delegates everything to ``wrapped``; a subclass overrides what it changes (usually
    ``handle``), as ``WrapperModel`` does for models. ``alive`` is the wrapped sandbox's: a
    dead sandbox under a wrapper must not look alive to a pool."""

    def __init__(self, wrapped: Instance) -> None:
        self.wrapped = wrapped
        self.id = wrapped.id
        self.tier = wrapped.tier
        self.enforcement = wrapped.enforcement
        self.started_from = wrapped.started_from
        self.rules = wrapped.rules

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        return self.wrapped.handle(op, sink)

    def close(self) -> None:
        self.wrapped.close()

    @property
    def alive(self) -> bool:
        return self.wrapped.alive

    def cut_running(self) -> None:
        self.wrapped.cut_running()


class WrapperBackend(Backend):
    """Delegates to ``wrapped``; a subclass overrides ``start`` to wrap what it starts."""

    def __init__(self, wrapped: Backend) -> None:
        self.wrapped = wrapped
        self.tier = wrapped.tier

    def probe(self) -> TierReport:
        return self.wrapped.probe()

    def start(self, spec: SandboxSpec) -> Instance:
        return self.wrapped.start(spec)

    def prepare_for(self, spec: SandboxSpec) -> str:
        return self.wrapped.prepare_for(spec)

    def unwalled_network(self) -> str | None:
        return self.wrapped.unwalled_network()


class AsyncInstance(abc.ABC):
    id: str
    tier: str
    enforcement: Enforcement
    started_from: str = ""  # as ``Instance.started_from``

    async def aexecute(self, op: Op[R], sink: OutputSink | None = None) -> R:
        """Run ``op``; what comes back is what the op says, as for ``Instance.execute``."""
        return cast(R, await self.ahandle(op, sink))

    @abc.abstractmethod
    async def ahandle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        """Execute one operation. ``aexecute`` is its typed front door."""

    @abc.abstractmethod
    async def aclose(self) -> None: ...

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """As ``Instance.alive``; asked without waiting."""


class AsyncBackend(abc.ABC):
    tier: str

    @abc.abstractmethod
    async def astart(self, spec: SandboxSpec) -> AsyncInstance: ...


# How long a cancelled task waits for its call's thread to end (a start to be closed): a
# cut call ends within a request, a start is not cut but finished and closed.
CUT_WAIT_S = 60.0


async def in_thread(
    fn: Callable[[], R], *, orphan: Callable[[R], None] | None = None, interruptible: bool = True
) -> R:
    """``fn()`` in a thread of its own (``stockade._threads``: never the loop's default
    executor, which queues), cut as a Ctrl-C cuts it in the main thread when the awaiting
    task is cancelled (unless not ``interruptible``: a close): the thread is told
    (``_interrupt``) and waited for, shielded from further cancels, for up to ``CUT_WAIT_S``;
    what it returned all the same is given to ``orphan`` (a started sandbox is closed); only
    then does the task's ``CancelledError`` go on. Nothing of the call lands after it; a call
    cancelled before its thread took it up raises at once."""
    import asyncio  # lazily: importing stockade must stay cheap
    import contextvars

    from stockade._threads import submit
    from stockade.sandbox._interrupt import CUT, Cut, Interrupted

    cut = Cut()
    context = contextvars.copy_context()
    if interruptible:
        context.run(CUT.set, cut)

    def run() -> R:
        result = context.run(fn)
        if cut.finish():  # its task was cancelled meanwhile: nobody takes what it returned
            if orphan is not None:
                orphan(result)
            raise Interrupted
        return result

    loop = asyncio.get_running_loop()
    job = submit(run)
    done = asyncio.wrap_future(job)
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        if job.cancel():  # never started: nothing ran, nothing to wait for or let go of
            raise
        finished = cut.request()
        deadline = loop.time() + CUT_WAIT_S
        while not done.done() and loop.time() < deadline:
            try:
                await asyncio.wait({done}, timeout=deadline - loop.time())
            except asyncio.CancelledError:
                continue  # cancelled again (a second Ctrl-C): the thread still ends first
        if not done.done():  # past the wait: its end (Interrupted, mostly) is nobody's
            done.add_done_callback(lambda ended: ended.exception())
        elif not done.cancelled() and done.exception() is None and finished and orphan is not None:
            # It returned just before the cancel: let go of it here, as the thread would have.
            let_go = asyncio.wrap_future(submit(orphan, done.result()))
            while not let_go.done() and loop.time() < deadline:
                try:
                    await asyncio.wait({let_go}, timeout=deadline - loop.time())
                except asyncio.CancelledError:
                    continue
        raise


class _ThreadedInstance(AsyncInstance):
    """An ``Instance`` driven from asyncio: each blocking call runs in a worker thread, cut
    when the awaiting task is cancelled (``in_thread``)."""

    def __init__(self, inner: Instance) -> None:
        self.inner = inner
        self.id = inner.id
        self.tier = inner.tier
        self.enforcement = inner.enforcement
        self.started_from = inner.started_from

    @property
    def alive(self) -> bool:
        return self.inner.alive

    async def ahandle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        return await in_thread(lambda: self.inner.handle(op, sink))

    async def aclose(self) -> None:
        # A close is never cut short: a cancelled task still waits for it to end.
        await in_thread(self.inner.close, interruptible=False)


class ThreadedAsyncBackend(AsyncBackend):
    """The async twin of any blocking ``Backend``.

    The sandbox machinery blocks on pipes and subprocesses; a worker thread per call keeps
    the event loop free without a second implementation of every tier. A start whose task
    is cancelled is finished, then closed, before the task's ``CancelledError`` goes on.
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.tier = inner.tier

    async def astart(self, spec: SandboxSpec) -> AsyncInstance:
        instance = await in_thread(lambda: self.inner.start(spec), orphan=_close)
        return _ThreadedInstance(instance)


def _close(instance: Instance) -> None:
    instance.close()
