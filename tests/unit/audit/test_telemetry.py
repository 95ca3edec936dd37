"""Spans and metrics, captured with the OpenTelemetry SDK's in-memory exporter and reader."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from stockade import PolicyDenied
from stockade.audit import Redactor
from stockade.observability import Telemetry, TracedBackend, json_logger
from stockade.sandbox import Sandbox
from tests.conftest import require

try:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    HAVE_OTEL = True
except ImportError:  # the otel extra is not installed
    HAVE_OTEL = False


@dataclass
class Captured:
    telemetry: Telemetry
    spans: Any
    metrics: Any
    logs: io.StringIO

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def metric_points(self, name: str) -> list[Any]:
        data = self.metrics.get_metrics_data()
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]


@pytest.fixture
def captured() -> Iterator[Captured]:
    require("opentelemetry-sdk", HAVE_OTEL, 'pip install "stockade[otel]"')
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    redactor = Redactor()
    logs = io.StringIO()
    telemetry = Telemetry(
        tracer_provider=tracer_provider,
        meter_provider=MeterProvider(metric_readers=[reader]),
        redactor=redactor,
        logger=json_logger(logs, redactor=redactor),
    )
    yield Captured(telemetry, exporter, reader, logs)
    tracer_provider.shutdown()


def test_an_agent_run_with_a_model_call_and_a_tool_call_follows_the_genai_conventions(
    captured: Captured,
) -> None:
    telemetry = captured.telemetry
    with telemetry.agent_run("coder", run_id="run-1"):
        with telemetry.model_call(provider="openai", model="gpt-4o", run_id="run-1", step=1) as call:
            call.record_response(input_tokens=120, output_tokens=30, finish_reasons=["tool_calls"])
        with telemetry.tool_call("run_code", call_id="call-1", run_id="run-1", step=1):
            pass

    spans = {span.name: span for span in captured.finished()}
    assert set(spans) == {"invoke_agent coder", "chat gpt-4o", "execute_tool run_code"}
    chat = spans["chat gpt-4o"].attributes or {}
    assert chat["gen_ai.operation.name"] == "chat"
    assert chat["gen_ai.provider.name"] == "openai"
    assert chat["gen_ai.request.model"] == "gpt-4o"
    assert chat["gen_ai.usage.input_tokens"] == 120
    assert tuple(chat["gen_ai.response.finish_reasons"]) == ("tool_calls",)  # type: ignore[arg-type]
    tool = spans["execute_tool run_code"].attributes or {}
    assert tool["gen_ai.tool.name"] == "run_code" and tool["gen_ai.tool.call.id"] == "call-1"
    root = spans["invoke_agent coder"]
    assert spans["chat gpt-4o"].parent is not None
    assert spans["chat gpt-4o"].parent.span_id == root.context.span_id

    tokens = captured.metric_points("gen_ai.client.token.usage")
    assert sorted(p.sum for p in tokens) == [30, 120]
    assert captured.metric_points("gen_ai.client.operation.duration")[0].count == 1


def test_a_failing_tool_call_marks_its_span_as_an_error(captured: Captured) -> None:
    with pytest.raises(PolicyDenied), captured.telemetry.tool_call("write_file"):
        raise PolicyDenied("not there", rule="paths")
    (span,) = captured.finished()
    assert (span.attributes or {})["error.type"] == "PolicyDenied"
    assert not span.status.is_ok


def test_retries_breaker_trips_and_denials_are_counted(captured: Captured) -> None:
    telemetry = captured.telemetry
    with telemetry.tool_call("run_tests"):
        telemetry.retry(operation="sandbox.start", reason="SandboxStartError", attempt=1)
        telemetry.breaker_change(breaker="sandbox", state="open")
        telemetry.breaker_change(breaker="sandbox", state="closed")
        telemetry.denial(rule="no-network")

    assert [p.value for p in captured.metric_points("stockade.retries")] == [1]
    assert [p.value for p in captured.metric_points("stockade.breaker.trips")] == [1]
    assert [p.value for p in captured.metric_points("stockade.policy.denials")] == [1]
    (span,) = captured.finished()
    assert [e.name for e in span.events] == ["retry", "breaker_change", "breaker_change", "policy_denied"]


def test_sandbox_operations_are_spans(captured: Captured) -> None:
    from stockade.testing import FakeBackend

    with Sandbox.create(backend=TracedBackend(FakeBackend(), captured.telemetry)) as sbx:
        sbx.commands.run(["echo", "hi"])
        sbx.files.write("a.txt", "x")

    names = [span.name for span in captured.finished()]
    assert names == ["sandbox.start", "sandbox.command", "sandbox.write_file", "sandbox.stop"]
    command = next(s for s in captured.finished() if s.name == "sandbox.command").attributes or {}
    assert tuple(command["process.command_args"]) == ("echo", "hi")  # type: ignore[arg-type]
    assert command["process.exit.code"] == 0


def test_span_attributes_and_log_lines_are_redacted(captured: Captured) -> None:
    secret = "sk-proj-Zyxwvutsrqponmlk9876543210"
    with captured.telemetry.tool_call("run_code", call_id=f"key {secret}"):
        pass
    (span,) = captured.finished()
    assert secret not in json.dumps(dict(span.attributes or {}))
    assert secret not in captured.logs.getvalue()
    line = json.loads(captured.logs.getvalue().splitlines()[0])
    assert line["event"] == "execute_tool run_code" and line["level"] == "info"


def test_nothing_global_is_installed(captured: Captured) -> None:
    from opentelemetry import trace

    assert not isinstance(trace.get_tracer_provider(), TracerProvider)
