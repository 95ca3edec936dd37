"""An assembled agent with ``AgentConfig.telemetry`` emits GenAI spans on the real process
tier: the run, under it each model call and tool call, and under a tool call the sandbox
operations it made; retries and durations are metrics; a registered secret is in no span."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stockade.agent import RunLimits
from stockade.assembly import AgentConfig, build_agent
from stockade.audit import AuditLog, MemoryStore, Redactor
from stockade.models import ScriptedModel, tool_call
from stockade.observability import Telemetry
from stockade.tools import default_toolset, shell
from tests.conftest import require_tier

pytestmark = pytest.mark.process

EXAMPLE_POLICY = Path(__file__).parents[2] / "examples" / "policy.toml"
SECRET = "s3cr3t-deploy-token-4242"


def by_name(spans: Sequence[ReadableSpan], prefix: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name.startswith(prefix)]


def parent_of(span: ReadableSpan, spans: Sequence[ReadableSpan]) -> ReadableSpan:
    assert span.parent is not None, span.name
    (parent,) = [s for s in spans if s.context is not None and s.context.span_id == span.parent.span_id]
    return parent


def test_a_run_is_one_span_tree_and_the_secret_is_in_no_span(tmp_path: Path) -> None:
    require_tier("process")
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = InMemoryMetricReader()
    redactor = Redactor()
    redactor.add_secret(SECRET)
    telemetry = Telemetry(
        tracer_provider=tracer_provider,
        meter_provider=MeterProvider(metric_readers=[metrics]),
        redactor=redactor,
    )
    model = ScriptedModel(
        [
            tool_call("shell", {"command": f"echo {SECRET} > token.txt && cat token.txt"}),
            tool_call("read_file", {"path": "token.txt"}),
            f"stored {SECRET}",
        ]
    )
    config = AgentConfig(
        model=model,
        policy=EXAMPLE_POLICY,
        tier="process",
        audit=AuditLog(MemoryStore(), redactor=redactor),
        limits=RunLimits(max_steps=5),
        tools=default_toolset().including(shell),
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
        telemetry=telemetry,
    )
    with build_agent(config) as agent:
        result = agent.run_sync(f"keep {SECRET} in token.txt", run_id="traced")
    assert result.ok, result.state.error

    spans = exporter.get_finished_spans()
    (run,) = by_name(spans, "invoke_agent")
    assert run.attributes is not None and run.attributes["gen_ai.conversation.id"] == "traced"
    chats = by_name(spans, "chat ")
    tools = by_name(spans, "execute_tool ")
    assert len(chats) == 3 and [t.name for t in tools] == ["execute_tool shell", "execute_tool read_file"]
    assert all(parent_of(s, spans) is run for s in [*chats, *tools])
    # the sandbox operations each tool made are its children
    (command,) = by_name(spans, "sandbox.command")
    assert parent_of(command, spans).name == "execute_tool shell"
    assert command.attributes is not None and command.attributes["process.exit.code"] == 0
    # (the run's own bookkeeping, its baseline and final diff, reads outside any tool call)
    under_tools = [s for s in by_name(spans, "sandbox.read_file") if s.parent is not None]
    assert [parent_of(s, spans).name for s in under_tools] == ["execute_tool read_file"]

    for span in spans:
        texts = [str(v) for v in (span.attributes or {}).values()]
        texts += [str(v) for e in span.events for v in (e.attributes or {}).values()]
        assert not any(SECRET in text for text in texts), span.name

    data = metrics.get_metrics_data()
    assert data is not None
    names = {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert {
        "gen_ai.client.operation.duration",
        "stockade.tool.duration",
        "stockade.sandbox.duration",
    } <= names
