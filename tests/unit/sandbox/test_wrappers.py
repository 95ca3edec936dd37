"""Every sandbox wrapper (policy, audit, telemetry, retry, breaker, kill switch, tool deadline,
fault injection, an MCP call's cancel) is the sandbox it wraps, except for what it changes: id,
tier, enforcement, liveness, closing, cutting what runs and the backend's probe all come from
below."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

import pytest

from stockade.audit.log import AuditLog
from stockade.audit.sandbox import AuditedBackend
from stockade.audit.stores import MemoryStore
from stockade.policy.guards import GuardedBackend, OpContext
from stockade.runtime.breaker import Breakers, BreakingBackend
from stockade.runtime.killswitch import KillSwitch
from stockade.runtime.retry import Retrier, RetryingBackend
from stockade.sandbox.base import Backend, Instance, SandboxSpec, WrapperBackend, WrapperInstance
from stockade.sandbox.facade import Sandbox
from stockade.sandbox.ops import Op, RunCommand
from stockade.sandbox.pool import _Lease
from stockade.server.mcp_tools import _CancellableInstance
from stockade.testing import FakeBackend, FakeInstance, FaultInjectingBackend
from stockade.tools.base import ToolContext
from stockade.tools.deadline import DeadlineInstance
from stockade.types import CommandResult

# The modules that define wrappers: every subclass they define must be listed below.
WRAPPER_MODULES = (
    "stockade.audit.sandbox",
    "stockade.observability.sandbox",
    "stockade.policy.guards",
    "stockade.runtime.breaker",
    "stockade.runtime.killswitch",
    "stockade.runtime.retry",
    "stockade.sandbox.pool",
    "stockade.server.mcp_tools",
    "stockade.testing",
    "stockade.tools.deadline",
)


def _allow(ctx: OpContext, op: Op[Any]) -> Op[Any]:
    return op


def _traced(inner: Backend) -> Backend:
    from stockade.observability.sandbox import TracedBackend
    from stockade.observability.telemetry import Telemetry

    return TracedBackend(inner, Telemetry())


def _faulty(inner: Backend) -> Backend:
    return FaultInjectingBackend(inner, path="never-read")


def _killable(inner: Backend) -> Instance:
    return KillSwitch(run_id="wrapped").attach(inner.start(SandboxSpec()))


def _deadline(inner: Backend) -> Instance:
    return DeadlineInstance(
        inner.start(SandboxSpec()), deadline=time.monotonic() + 60, tool="t", timeout_s=60
    )


BACKENDS: dict[str, Callable[[Backend], Backend]] = {
    "AuditedBackend": lambda inner: AuditedBackend(inner, AuditLog(MemoryStore()), run_id="r"),
    "BreakingBackend": lambda inner: BreakingBackend(inner, Breakers()),
    "FaultInjectingBackend": _faulty,
    "GuardedBackend": lambda inner: GuardedBackend(inner, _allow, OpContext()),
    "RetryingBackend": lambda inner: RetryingBackend(inner, Retrier()),
    "TracedBackend": _traced,
}


def _cancellable(inner: Backend) -> Instance:
    started = inner.start(SandboxSpec())
    return _CancellableInstance(started, ToolContext(sandbox=Sandbox(started)))


# Instance wrappers that no backend wrapper above starts.
INSTANCES: dict[str, Callable[[Backend], Instance]] = {
    "KillableInstance": _killable,
    "DeadlineInstance": _deadline,
    "_Lease": lambda inner: _Lease(inner.start(SandboxSpec())),  # a pool member's, per acquire
    "_CancellableInstance": _cancellable,  # an MCP call's, which its client may cancel
}


def _subclasses(cls: type) -> set[str]:
    for name in WRAPPER_MODULES:
        importlib.import_module(name)
    found: set[str] = set()
    stack: list[type] = list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        if sub.__module__.startswith("stockade."):
            found.add(sub.__name__)
        stack.extend(sub.__subclasses__())
    return found


def test_every_wrapper_of_the_package_is_checked_here() -> None:
    pytest.importorskip("opentelemetry.sdk")
    assert _subclasses(WrapperBackend) == set(BACKENDS)
    started = {type(make(FakeBackend()).start(SandboxSpec())).__name__ for make in BACKENDS.values()}
    assert _subclasses(WrapperInstance) == started | set(INSTANCES)


def _started_by(make: Callable[[Backend], Backend]) -> Callable[[Backend], Instance]:
    return lambda inner: make(inner).start(SandboxSpec())


def _wrapped_instances() -> list[tuple[str, Callable[[Backend], Instance]]]:
    return [(name, _started_by(make)) for name, make in BACKENDS.items()] + list(INSTANCES.items())


@pytest.mark.parametrize(
    ("name", "make"), _wrapped_instances(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_wrapped_sandbox_is_the_sandbox_below(name: str, make: Callable[[Backend], Instance]) -> None:
    if name == "TracedBackend":
        pytest.importorskip("opentelemetry.sdk")
    backend = FakeBackend(tier="below")
    wrapped = make(backend)
    inner: FakeInstance = backend.instances[-1]
    assert (wrapped.id, wrapped.tier, wrapped.enforcement) == (inner.id, "below", inner.enforcement)
    assert wrapped.alive
    result = wrapped.execute(RunCommand(argv=("true",)))
    assert isinstance(result, CommandResult) and inner.ops
    wrapped.cut_running()  # what runs is cut below, where it runs
    assert inner.cuts == 1
    inner.close()  # died underneath: the wrapper must not say it is alive
    assert not wrapped.alive
    inner.closed = False
    wrapped.close()
    assert inner.closed and not wrapped.alive


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_a_wrapped_backend_probes_and_names_the_tier_below(name: str) -> None:
    if name == "TracedBackend":
        pytest.importorskip("opentelemetry.sdk")
    backend = BACKENDS[name](FakeBackend(tier="below"))
    assert backend.tier == "below"
    assert backend.probe() == FakeBackend(tier="below").probe()


def test_the_fault_injector_fails_the_reads_it_is_told_to_once_armed() -> None:
    from stockade.exceptions import ResourceContention
    from stockade.sandbox.ops import ReadFile, WriteFile

    faults = FaultInjectingBackend(FakeBackend(), path="log.txt", armed=False, times=2)
    sbx = faults.start(SandboxSpec())
    sbx.execute(WriteFile(path="log.txt", data=b"x"))
    assert sbx.execute(ReadFile(path="log.txt")) == b"x"  # not armed yet
    faults.arm()
    for _ in range(2):
        with pytest.raises(ResourceContention, match="injected"):
            sbx.execute(ReadFile(path="log.txt"))
    assert sbx.execute(ReadFile(path="log.txt")) == b"x" and faults.injected == 2
