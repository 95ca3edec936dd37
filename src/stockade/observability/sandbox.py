"""Traced sandboxes: a span (and a duration metric) per operation, as a wrapper.

``TracedBackend(backend, telemetry)`` traces each start and returns ``TracedInstance``s;
each operation is a ``sandbox.<op>`` span carrying the sandbox id and tier, the command's
arguments (redacted, capped) and exit code, and output sizes. It composes with auditing in
either order: ``TracedBackend(AuditedBackend(backend, log, run_id=...), telemetry)``.
"""

from __future__ import annotations

import time
from typing import Any

from stockade.observability.telemetry import Telemetry
from stockade.sandbox.base import (
    Backend,
    Instance,
    OpResult,
    OutputSink,
    SandboxSpec,
    WrapperBackend,
    WrapperInstance,
)
from stockade.sandbox.ops import Op, RunCode, RunCommand
from stockade.types import CommandResult, Execution

__all__ = ["TracedBackend", "TracedInstance"]

_OP_NAMES = {
    "RunCommand": "command",
    "RunCode": "run_code",
    "ReadFile": "read_file",
    "WriteFile": "write_file",
    "MakeDir": "make_dir",
    "Stat": "stat",
    "ListDir": "list_dir",
    "Remove": "remove",
    "PutArchive": "put_archive",
    "GetArchive": "get_archive",
    "Reset": "reset",
}


def _request(op: Op[Any]) -> dict[str, object]:
    if isinstance(op, RunCommand):
        return {"process.command_args": list(op.argv), "stockade.env_names": sorted(op.envs) or None}
    if isinstance(op, RunCode):
        return {"stockade.code_bytes": len(op.code.encode())}
    path = getattr(op, "path", None)
    return {"stockade.path": path}


def _response(result: OpResult) -> dict[str, object]:
    if isinstance(result, CommandResult):
        return {
            "process.exit.code": result.exit_code,
            "stockade.timed_out": result.timed_out,
            "stockade.stdout_bytes": result.stdout_bytes,
            "stockade.stderr_bytes": result.stderr_bytes,
        }
    if isinstance(result, Execution):
        return {
            "stockade.timed_out": result.timed_out,
            "stockade.execution.error": None if result.error is None else result.error.name,
        }
    if isinstance(result, bytes):
        return {"stockade.bytes": len(result)}
    return {}


class TracedInstance(WrapperInstance):
    def __init__(self, wrapped: Instance, telemetry: Telemetry) -> None:
        super().__init__(wrapped)
        self.telemetry = telemetry

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        name = _OP_NAMES.get(type(op).__name__, type(op).__name__.lower())
        attributes = {"stockade.sandbox.id": self.id, "stockade.sandbox.tier": self.tier, **_request(op)}
        start = time.perf_counter()
        outcome = "error"
        try:
            with self.telemetry.span(f"sandbox.{name}", attributes) as span:
                result = self.wrapped.handle(op, sink)
                span.set_attributes(self.telemetry.attributes(_response(result)))
                outcome = "ok"
                return result
        finally:
            self.telemetry.sandbox_duration.record(
                time.perf_counter() - start,
                {
                    "stockade.sandbox.tier": self.tier,
                    "stockade.sandbox.op": name,
                    "stockade.outcome": outcome,
                },
            )

    def close(self) -> None:
        with self.telemetry.span(
            "sandbox.stop", {"stockade.sandbox.id": self.id, "stockade.sandbox.tier": self.tier}
        ):
            self.wrapped.close()


class TracedBackend(WrapperBackend):
    def __init__(self, wrapped: Backend, telemetry: Telemetry) -> None:
        super().__init__(wrapped)
        self.telemetry = telemetry

    def start(self, spec: SandboxSpec) -> TracedInstance:
        with self.telemetry.span("sandbox.start", {"stockade.sandbox.tier": self.tier}) as span:
            instance = self.wrapped.start(spec)
            span.set_attribute("stockade.sandbox.id", instance.id)
        return TracedInstance(instance, self.telemetry)
