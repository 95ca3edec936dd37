"""Isolation tiers behind one interface: ``Sandbox``/``AsyncSandbox`` over a ``Backend``."""

from stockade.sandbox.base import AsyncBackend, AsyncInstance, Backend, Instance, SandboxSpec
from stockade.sandbox.facade import AsyncSandbox, Sandbox

__all__ = ["AsyncBackend", "AsyncInstance", "AsyncSandbox", "Backend", "Instance", "Sandbox", "SandboxSpec"]
