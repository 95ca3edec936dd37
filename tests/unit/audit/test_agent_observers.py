"""The agent loop's events, recorded into the audit trail and as spans, by plain observers."""

from __future__ import annotations

import pytest

from stockade import CommandResult
from stockade.agent import Agent
from stockade.agent.state import args_measure
from stockade.audit import AuditedBackend, AuditLog, EventKind, verify
from stockade.audit.agent import AuditObserver
from stockade.exceptions import AuditStoreError
from stockade.models.messages import ToolCall
from stockade.models.scripted import ScriptedModel, Turn
from stockade.sandbox import Sandbox
from stockade.sandbox.ops import RunCommand
from stockade.testing import FakeBackend, MemoryWorkspace, capture_audit
from stockade.tools import Toolset, idempotency_key, shell
from tests.conftest import require
from tests.unit.audit.test_log import FullStore

SCRIPT: list[Turn] = [ToolCall(name="write_file", args={"path": "a.py", "content": "x = 1"}), "done"]


def test_a_run_becomes_audit_events() -> None:
    with capture_audit() as audit, Sandbox.create(backend=FakeBackend()) as sbx:
        agent = Agent(ScriptedModel(SCRIPT), observers=[AuditObserver(audit)])
        assert agent.run_sync("write a.py", sandbox=sbx, run_id="run-7").ok

        assert audit.kinds() == [
            EventKind.RUN_START,
            EventKind.MODEL_CALL,
            EventKind.TOOL_CALL_START,  # before it runs: what a process killed during it leaves
            EventKind.TOOL_CALL,
            EventKind.STEP,
            EventKind.MODEL_CALL,
            EventKind.STEP,
            EventKind.RUN_END,
        ]
        (tool,) = audit.of(EventKind.TOOL_CALL)
        assert tool.step == 1 and tool.attributes["tool"] == "write_file"
        assert tool.attributes["idempotency_key"] == idempotency_key("run-7", 1, 0, "call_0_0")
        (start,) = audit.of(EventKind.TOOL_CALL_START)
        assert start.attributes["idempotency_key"] == tool.attributes["idempotency_key"]
        args = tool.attributes["args"]
        assert isinstance(args, dict) and "args" not in start.attributes  # their size and SHA-256 only
        assert (start.attributes["args_bytes"], start.attributes["args_digest"]) == args_measure(args)
        assert audit.of(EventKind.RUN_END)[0].attributes["status"] == "success"
        assert verify(audit.store).ok


def test_a_run_becomes_genai_spans() -> None:
    try:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    except ImportError:
        require("opentelemetry-sdk", False, 'pip install "stockade[otel]"')
        pytest.fail("unreachable")
    from stockade.observability import Telemetry
    from stockade.observability.agent import TelemetryObserver

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = TelemetryObserver(Telemetry(tracer_provider=provider))
    with Sandbox.create(backend=FakeBackend()) as sbx:
        Agent(ScriptedModel(SCRIPT), observers=[observer]).run_sync("write a.py", sandbox=sbx, run_id="run-8")

    spans = exporter.get_finished_spans()
    assert sorted(s.name for s in spans) == [
        "chat scripted",
        "chat scripted",
        "execute_tool write_file",
        "invoke_agent stockade",
    ]
    root = next(s for s in spans if s.name.startswith("invoke_agent"))
    assert all(
        s.parent is not None and s.parent.span_id == root.context.span_id for s in spans if s is not root
    )
    assert (root.attributes or {})["gen_ai.conversation.id"] == "run-8"


def test_a_run_stops_at_the_first_call_after_the_trail_cannot_be_written() -> None:
    """Fail closed on a full audit store: a call starts only once everything before it is
    written. Before, a run's calls went on for the log's flush interval after its store filled
    (11 ``run_code`` calls of 15 ran unrecorded, then the run ended on the failed write)."""
    ran: list[str] = []

    def command(op: RunCommand) -> CommandResult:
        ran.append(op.argv[-1])
        return CommandResult(exit_code=0, stdout="x" * 100, stderr="", duration_s=0.0)

    store = FullStore(room=24)
    log = AuditLog(store, flush_interval_s=None)  # no background write: what check() writes only
    turns: list[Turn] = [ToolCall(name="shell", args={"command": f"echo {i}"}) for i in range(15)]
    backend = AuditedBackend(FakeBackend(MemoryWorkspace(commands=command)), log, run_id="run-full")
    sbx = Sandbox.create(backend=backend)
    try:
        agent = Agent(ScriptedModel([*turns, "done"]), tools=Toolset([shell]), observers=[AuditObserver(log)])
        with pytest.raises(AuditStoreError, match="disk is full"):  # the run stops with it
            agent.run_sync("echo", sandbox=sbx, run_id="run-full")
        assert 0 < len(ran) < 15
        # each call that ran was in the trail, started, before it ran; none after the store filled
        started = [e for e in store.events() if e.kind == EventKind.TOOL_CALL_START]
        assert len(started) == len(ran)
    finally:
        store.room = 10**6  # room again: what is queued is written, and the sandbox closes
        log.flush()
        sbx.close()
    assert verify(store).ok
