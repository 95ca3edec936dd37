"""Isolation tiers behind one interface: ``Sandbox``/``AsyncSandbox`` over a ``Backend``."""

from stockade.sandbox._supervised_calls import TIMEOUT_MARGIN_S
from stockade.sandbox.base import (
    AsyncBackend,
    AsyncInstance,
    Backend,
    Instance,
    SandboxSpec,
    WrapperBackend,
    WrapperInstance,
)
from stockade.sandbox.facade import AsyncSandbox, Sandbox
from stockade.sandbox.pool import PoolStats, SandboxPool
from stockade.sandbox.snapshots import SnapshotStore
from stockade.sandbox.spare import SpareBackend

__all__ = [
    "TIMEOUT_MARGIN_S",
    "AsyncBackend",
    "AsyncInstance",
    "AsyncSandbox",
    "Backend",
    "Instance",
    "PoolStats",
    "Sandbox",
    "SandboxPool",
    "SandboxSpec",
    "SnapshotStore",
    "SpareBackend",
    "WrapperBackend",
    "WrapperInstance",
]
