"""Runtime controls: retry, circuit breakers, rate and spend limits, budgets, kill switch,
anomaly detection. Each is a wrapper or a plain callable, tested alone with a ``ManualClock``;
``stockade.runtime.agent.RuntimeControls`` plugs them into an agent run."""

from stockade.runtime.anomaly import ActionRecord, AnomalyMonitor
from stockade.runtime.breaker import BreakerConfig, Breakers, BreakingBackend, CircuitBreaker
from stockade.runtime.clock import Clock, ManualClock, SystemClock
from stockade.runtime.events import AnomalyAction, BreakerState, Observer, RuntimeEvent
from stockade.runtime.failures import AgentBreaker
from stockade.runtime.kill_sources import FileKillSource, MemoryKillSource, RedisKillSource
from stockade.runtime.killswitch import KillSwitch
from stockade.runtime.limits import Budget, BudgetMeter, LocalWindow, RateLimit, RedisWindow, SpendLimit
from stockade.runtime.retry import (
    AsyncRetryingBackend,
    AsyncRetryingInstance,
    Retrier,
    RetryingBackend,
    RetryingInstance,
    RetryPolicy,
    is_transient,
)

__all__ = [
    "ActionRecord",
    "AgentBreaker",
    "AnomalyAction",
    "AnomalyMonitor",
    "AsyncRetryingBackend",
    "AsyncRetryingInstance",
    "BreakerConfig",
    "BreakerState",
    "Breakers",
    "BreakingBackend",
    "Budget",
    "BudgetMeter",
    "CircuitBreaker",
    "Clock",
    "FileKillSource",
    "KillSwitch",
    "LocalWindow",
    "ManualClock",
    "MemoryKillSource",
    "Observer",
    "RateLimit",
    "RedisKillSource",
    "RedisWindow",
    "Retrier",
    "RetryPolicy",
    "RetryingBackend",
    "RetryingInstance",
    "RuntimeEvent",
    "SpendLimit",
    "SystemClock",
    "is_transient",
]
